"""Responses input items as chat messages, and a folded reply as output items.

Input: a string (one user message) or a list of items: messages (role user / system / developer /
assistant; content a string or `input_text` / `output_text` parts), `function_call` (call_id, name,
arguments) and `function_call_output` (call_id, output). Consecutive function calls (and an assistant
message before them) make one assistant message with tool calls. Anything else is a 400.
"""

from __future__ import annotations

import uuid
from typing import Any

from cbd.gateway.errors import bad_request

_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text", "text")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def input_items(value: Any) -> list[dict[str, Any]]:
    """The request's `input` as a list of items as input_items lists them: each with an id, a message's
    content as parts (a string becomes one `input_text`, an assistant's one `output_text`), messages and
    function calls with a status."""
    if isinstance(value, str):
        value = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": value}]}]
    if not isinstance(value, list) or not value:
        raise bad_request("'input' must be a string or a non-empty list of items", "input")
    items = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise bad_request(f"input[{i}] must be an object", f"input[{i}]")
        kind = item.get("type", "message")
        if not isinstance(kind, str):  # a list or object would not even be a key of the prefixes below
            raise bad_request(f"input[{i}].type must be a string", f"input[{i}].type")
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}.get(kind, "item")
        listed = {**item, "type": kind, "id": item.get("id") or new_id(prefix)}
        if kind == "message" and isinstance(listed.get("content"), str):  # listed as the API lists it: parts
            part = "output_text" if listed.get("role") == "assistant" else "input_text"
            text = {"type": part, "text": listed["content"]}
            listed["content"] = [{**text, "annotations": []} if part == "output_text" else text]
        if kind in ("message", "function_call"):
            listed.setdefault("status", "completed")
        items.append(listed)
    return items


def messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as normalised chat messages."""
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item["type"]
        if kind == "message":
            role = item.get("role")
            role = _ROLES.get(role) if isinstance(role, str) else None
            if role is None:
                raise bad_request(f"{where}.role must be user, system, developer or assistant", f"{where}.role")
            out.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = {name: item.get(name) for name in ("call_id", "name", "arguments")}
            if not all(isinstance(v, str) for v in call.values()):
                raise bad_request(f"{where}: a function_call needs string call_id, name and arguments", where)
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                out.append(last)
            last.setdefault("tool_calls", []).append(
                {"id": call["call_id"], "name": call["name"], "arguments": call["arguments"]}
            )
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where}: a function_call_output needs a string call_id", where)
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, where, "output")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        else:
            raise bad_request(f"{where}.type {kind!r} is not supported (message, function_call, "
                              "function_call_output)", f"{where}.type")  # fmt: skip
    return out


def _text(content: Any, where: str, field: str = "content") -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.{field} must be a string or a list of text parts", f"{where}.{field}")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.{field}[{j}]"
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            raise bad_request(f"{at}: only text content parts are supported ({', '.join(_TEXT_PARTS)})", at)
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{at}.text must be a string", f"{at}.text")
        texts.append(part["text"])
    return "".join(texts)


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id, "type": "message", "role": "assistant", "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }  # fmt: skip


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}  # fmt: skip
