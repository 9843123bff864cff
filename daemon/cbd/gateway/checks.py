"""Shape checks of the API's nested request fields: each wrong type is a 400 naming its field.

The client library's conversions assume the shapes its own callers pass (a tool's `function` is an
object, a call's `id` a string); an HTTP body can hold anything, so the gateway checks first.
"""

from __future__ import annotations

import json
from typing import Any

from cbd.gateway.errors import bad_request

MAX_TOKEN_ID = (1 << 31) - 1


def number(body: dict[str, Any], name: str, low: float, high: float) -> float | None:
    """body[name] (None when absent), a number from low to high, both included."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise bad_request(f"{name} must be a number from {low:g} to {high:g}, got {_short(value)}", name)
    return float(value)


def set_top_p(sampling: Any, top_p: float) -> None:
    """The APIs allow top_p 0 (the daemon's nucleus must be above 0): the smallest nucleus, the most likely
    token alone, is greedy decoding."""
    if top_p == 0:
        sampling.temperature = 0.0
    else:
        sampling.top_p = top_p


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def flag(body: dict[str, Any], name: str, default: bool, param: str | None = None) -> bool:
    """body[name] (default when absent), a boolean; `param`: its path when body is a nested object."""
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{param or name} must be a boolean", param or name)
    return value


def section(body: dict[str, Any], name: str) -> dict[str, Any]:
    """body[name], an object ({} when absent)."""
    value = body.get(name)
    if value is not None and not isinstance(value, dict):
        raise bad_request(f"{name} must be an object", name)
    return value or {}


def token_ids(value: Any, param: str) -> list[int]:
    """A list of token ids, each from 0 to 2^31 - 1."""
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID for t in value
    ):
        raise bad_request(f"{param} must be a list of token ids (integers from 0 to {MAX_TOKEN_ID})", param)
    return value


def tools(value: Any) -> None:
    if not isinstance(value, list):
        raise bad_request("tools must be a list of tools", "tools")
    for i, tool in enumerate(value):
        param = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad_request(f"{param} must be an object", param)
        spec = tool.get("function", tool) if tool.get("type") == "function" else tool
        if not isinstance(spec, dict):
            raise bad_request(f"{param}.function must be an object with a string 'name'", f"{param}.function")
        if not isinstance(spec.get("name"), str):
            raise bad_request(f"{param} needs a string 'name'", f"{param}.function.name")
        if not isinstance(spec.get("description"), (str, type(None))):
            raise bad_request(f"{param}'s description must be a string", f"{param}.function.description")


def tool_choice(value: Any) -> None:
    if value is None or value in ("auto", "none", "required"):
        return
    if not isinstance(value, dict):
        raise bad_request("tool_choice must be 'auto', 'none', 'required' or an object naming a tool", "tool_choice")
    function = value.get("function", value)
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request('tool_choice must name its tool as {"function": {"name": ...}}', "tool_choice.function")


def tool_calls(value: Any, i: int) -> list[dict[str, str]]:
    """messages[i].tool_calls as the daemon takes them: id, name, arguments (a JSON text; an object is dumped)."""
    param = f"messages[{i}].tool_calls"
    if not isinstance(value, list):
        raise bad_request(f"{param} must be a list of tool calls", param)
    calls = []
    for j, call in enumerate(value):
        at = f"{param}[{j}]"
        if not isinstance(call, dict):
            raise bad_request(f"{at} must be an object", at)
        function = call.get("function", call)
        if not isinstance(function, dict):
            raise bad_request(f"{at}.function must be an object with 'name' and 'arguments'", f"{at}.function")
        arguments = function.get("arguments", "")
        fields = {"id": call.get("id", ""), "name": function.get("name", ""),
                  "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}  # fmt: skip
        for name, text in fields.items():
            if not isinstance(text, str):
                where = f"{at}.id" if name == "id" else f"{at}.function.{name}"
                raise bad_request(f"{where} must be a string, got {type(text).__name__}", where)
        calls.append(fields)
    return calls


def tool_call_id(value: Any, i: int) -> str:
    param = f"messages[{i}].tool_call_id"
    if not isinstance(value, str):
        raise bad_request(f"{param} must be a string, got {type(value).__name__}", param)
    return value


def check_tool_results(messages: list[dict[str, Any]], where: str) -> None:
    """Every tool result names a call an earlier assistant message made."""
    called: set[str] = set()
    for m in messages:
        called.update(c.get("id", "") for c in m.get("tool_calls") or ())
        if m["role"] == "tool" and m.get("tool_call_id") not in called:
            raise bad_request(f"a tool result names no earlier tool call: {m.get('tool_call_id')!r}", where)
