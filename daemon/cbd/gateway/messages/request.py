"""A Messages API body -> chat messages and what to generate.

Mapped: system (a string or text blocks), messages (user / assistant; a string or blocks: text,
tool_use, tool_result with string or text-block content; consecutive messages of one role are one turn:
their texts joined as one message's text blocks are, then their tool_use blocks), max_tokens (required), stop_sequences,
temperature (0 to 1), top_p, top_k, tools (name, description, input_schema), tool_choice (auto, any,
tool, none; disable_parallel_tool_use: at most one tool_use), metadata.user_id (the tenant, when the
daemon checks no tokens), output_config.format (json_schema; with tools and tool_choice auto the reply
is tool_use blocks or text in the format), stream, and cache_control (on the body, system, tools or
message blocks: type ephemeral, ttl 5m or 1h) as retention hints on the session. Refused with
invalid_request_error: other block types (images, documents, thinking), server tools, and thinking
enabled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from cbd.gateway import checks
from cbd.gateway.agentic import convert
from cbd.gateway.errors import bad_request
from cbd_client.contract import SCHEMA_PATH
from cbd_client.v1 import cbd_pb2 as pb

MAX_STOP_SEQUENCES = 16
# The daemon's paths its refusals begin with, as this API names them (errors.reworded).
DAEMON_PATHS = {SCHEMA_PATH: "output_config.format.schema"}
_TTL = {"5m": 300.0, "1h": 3600.0}


@dataclass(slots=True)
class MessagesCall:
    template: pb.GenerateRequest
    messages: list[dict[str, Any]]  # normalised chat messages, the system prompt first
    stream: bool
    stop_sequences: list[str]
    cache_ttl: float | None = None  # seconds a cache_control mark asks the prefix to stay (None: no mark)
    marks: list[str] = field(default_factory=list)
    prefill: bool = False  # the last message is the start of the reply: the reply continues it


def parse(body: dict[str, Any]) -> MessagesCall:
    marks: list[str] = []
    _mark(body, "cache_control", marks)
    template = pb.GenerateRequest(n=1)
    max_tokens = convert.integer(body, "max_tokens", 1, convert.MAX_TOKENS, required=True)
    _refuse_unsupported(body)
    convert.sampling(template, {k: body.get(k) for k in ("top_p", "top_k")}, max_tokens)
    temperature = checks.number(body, "temperature", 0, 1)
    if temperature is not None:
        template.sampling.temperature = temperature
    stops = body.get("stop_sequences") or []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_request("stop_sequences must be a list of non-empty strings", "stop_sequences")
    if len(stops) > MAX_STOP_SEQUENCES:
        raise bad_request(f"at most {MAX_STOP_SEQUENCES} stop_sequences", "stop_sequences")
    if stops:
        template.sampling.stop.extend(stops)
        template.sampling.logprobs = 0  # the tokens' texts tell which sequence stopped the reply
    messages = _system(body.get("system"), marks) + _messages(body.get("messages"), marks)
    prefill = _prefill(messages, len(body["messages"]))
    tools = _tools(body.get("tools"), marks)
    choice = _tool_choice(body.get("tool_choice"))
    if tools:
        convert.tools(template, tools, choice, not _single_tool_use(body.get("tool_choice")))
    elif choice not in (None, "auto", "none"):
        raise bad_request("tool_choice needs tools", "tool_choice")
    _format(template, body)
    user = checks.section(body, "metadata").get("user_id")
    if user is not None and not isinstance(user, str):
        raise bad_request("metadata.user_id must be a string", "metadata.user_id")
    if user:
        template.tenant = user[:128]
    ttl = max((_TTL[m] for m in marks), default=None)
    return MessagesCall(template, messages, checks.flag(body, "stream", False), list(stops), ttl, marks, prefill)


def _refuse_unsupported(body: dict[str, Any]) -> None:
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") not in (None, "disabled"):
        raise bad_request("thinking is not supported", "thinking")


def _mark(obj: dict[str, Any], where: str, marks: list[str]) -> None:
    mark = obj.get("cache_control")
    if mark is None:
        return
    ttl = mark.get("ttl", "5m") if isinstance(mark, dict) else None
    if not isinstance(mark, dict) or mark.get("type") != "ephemeral" or not isinstance(ttl, str) or ttl not in _TTL:
        raise bad_request(f"{where}: cache_control must be {{type: ephemeral, ttl: 5m or 1h}}", where)
    marks.append(ttl)


def _system(system: Any, marks: list[str]) -> list[dict[str, Any]]:
    if system is None or system == "":
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    return [{"role": "system", "content": _texts(system, "system", marks)}]


def _texts(blocks: Any, where: str, marks: list[str]) -> str:
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise bad_request(f"{where} must be a string or a list of text blocks", where)
    texts = []
    for i, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise bad_request(f"{where}[{i}] must be a text block", f"{where}[{i}]")
        _mark(b, f"{where}[{i}]", marks)
        texts.append(b["text"])
    return "".join(texts)


def _messages(value: Any, marks: list[str]) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise bad_request("messages must be a non-empty list", "messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise bad_request(f"{where}.role must be user or assistant", f"{where}.role")
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise bad_request(f"{where}.content must be a string or a list of blocks", f"{where}.content")
        texts, calls = [], []
        for j, b in enumerate(blocks):
            at = f"{where}.content[{j}]"
            kind = b.get("type") if isinstance(b, dict) else None
            if kind not in ("text", "tool_use", "tool_result"):
                raise bad_request(f"{at}: block type {kind!r} is not supported (text, tool_use, tool_result)", at)
            _mark(b, at, marks)
            if kind == "text":
                if not isinstance(b.get("text"), str):
                    raise bad_request(f"{at}.text must be a string", at)
                texts.append(b["text"])
            elif kind == "tool_use":
                if m["role"] != "assistant" or not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                    raise bad_request(f"{at}: tool_use blocks are the assistant's, with string id and name", at)
                if not isinstance(b.get("input", {}), dict):
                    raise bad_request(f"{at}.input must be an object (the call's arguments)", f"{at}.input")
                calls.append({"id": b["id"], "name": b["name"], "arguments": json.dumps(b.get("input") or {})})
            else:
                if m["role"] != "user" or not isinstance(b.get("tool_use_id"), str):
                    raise bad_request(f"{at}: tool_result blocks are the user's, with a string tool_use_id", at)
                result = _texts(b.get("content") or "", f"{at}.content", marks)
                out.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": result})
        if texts or (m["role"] == "assistant" and calls) or not blocks:
            previous = out[-1] if out else None
            if previous is not None and previous["role"] == m["role"]:  # consecutive turns of one role: one turn
                previous["content"] += "".join(texts)
                if calls:
                    previous.setdefault("tool_calls", []).extend(calls)
                continue
            message: dict[str, Any] = {"role": m["role"], "content": "".join(texts)}
            if calls:
                message["tool_calls"] = calls
            out.append(message)
    return out


def _prefill(messages: list[dict[str, Any]], count: int) -> bool:
    """Whether the conversation ends with the start of the reply (a final assistant message), which is then
    continued; an empty one is dropped (nothing to continue). `count`: the request's messages."""
    last = messages[-1] if messages else None
    if last is None or last["role"] != "assistant":
        return False
    where = f"messages[{count - 1}]"
    if last.get("tool_calls"):
        raise bad_request(f"{where}: a final assistant message with tool_use blocks needs their tool_result "
                          "in a user message after it", where)  # fmt: skip
    if not last["content"]:
        messages.pop()
        return False
    if last["content"] != last["content"].rstrip():
        raise bad_request(f"{where}: final assistant content cannot end with trailing whitespace", where)
    return True


def _tools(tools: Any, marks: list[str]) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad_request("tools must be a list", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "custom") != "custom" or not isinstance(t.get("name"), str):
            raise bad_request(f"tools[{i}]: only client tools (name, description, input_schema) are supported",
                              f"tools[{i}]")  # fmt: skip
        _mark(t, f"tools[{i}]", marks)
        if not isinstance(t.get("description"), (str, type(None))):
            raise bad_request(f"tools[{i}].description must be a string", f"tools[{i}].description")
        if not isinstance(t.get("input_schema"), dict):
            raise bad_request(f"tools[{i}].input_schema is required: a JSON schema object", f"tools[{i}].input_schema")
        out.append({"name": t["name"], "description": t.get("description"), "parameters": t["input_schema"]})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"name": choice["name"]}
    raise bad_request("tool_choice must be {type: auto | any | none} or {type: tool, name}", "tool_choice")


def _single_tool_use(choice: Any) -> bool:
    """tool_choice.disable_parallel_tool_use: at most one tool_use block in the reply."""
    flag = choice.get("disable_parallel_tool_use") if isinstance(choice, dict) else None
    if flag is not None and not isinstance(flag, bool):
        raise bad_request("tool_choice.disable_parallel_tool_use must be a boolean", "tool_choice")
    return bool(flag)


def _format(template: pb.GenerateRequest, body: dict[str, Any]) -> None:
    config = body.get("output_config")
    fmt = config.get("format") if isinstance(config, dict) else body.get("output_format")
    if fmt is None:
        return
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise bad_request("output_config.format must be {type: json_schema, schema}", "output_config")
    convert.response_format(template, {"type": "json_schema", "json_schema": {"schema": fmt["schema"]}})
