"""API requests to cbd.v1 GenerateRequests: what is mapped, what is ignored, what is refused.

Mapped: messages (text content; system / developer / user / assistant with tool_calls / tool), n,
temperature, top_p, seed, stop, max_tokens / max_completion_tokens (chat: omitted means up to the
context; completions: 16, the legacy API's default), logprobs / top_logprobs, tools, tool_choice,
parallel_tool_calls (false: at most one call), response_format (text, json_object, json_schema; with
tools and tool_choice auto the reply is calls or text in the format), stream,
stream_options.include_usage. cbd's extensions, as top-level fields (the openai client's `extra_body`):
top_k, min_p, ignore_eos, stop_token_ids, cbd_session (see sessions.py). Fields that would change what
is generated but have no counterpart here (penalties, logit_bias, non-text content or output) are a
400; any other unknown field is ignored, as the API's clients expect. `model` is accepted and ignored:
one model is served, and replies name it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cbd.gateway import checks
from cbd.gateway.errors import ApiError, bad_request
from cbd.gateway.sessions import SessionKey
from cbd_client.calls import set_prompt
from cbd_client.contract import MAX_CANDIDATES, MAX_LOGPROBS, MAX_STOP_STRINGS
from cbd_client.errors import CbdError
from cbd_client.structured import set_response_format, set_tools
from cbd_client.v1 import cbd_pb2 as pb

_ROLES = {"developer": "system"}
_KNOWN_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_TOKENS = (1 << 31) - 1  # an omitted chat max_tokens: generation ends at the context length
COMPLETIONS_MAX_TOKENS = 16  # the legacy completions API's default


@dataclass(slots=True)
class Call:
    """One API request as cbd Generate requests (one per prompt) and how to answer it."""

    requests: list[pb.GenerateRequest]
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None  # top alternatives wanted per token (0: only the chosen token's), None: no logprobs
    session_key: SessionKey | None = None  # (the caller's key, the session's name)
    messages: list[dict[str, Any]] | None = None  # a chat's messages, normalised (sessions.py)


# The daemon's names of fields its refusals name, as each API names them (errors.named).
CHAT_DAEMON_PARAMS: dict[str, str] = {}
COMPLETIONS_DAEMON_PARAMS = {"messages": "prompt"}


def chat_call(body: dict[str, Any], session_header: str | None, owner: str = "") -> Call:
    """owner: the caller's key (agentic/caller.py), which scopes the session name."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list of messages", "messages")
    normal = [chat_message(m, i) for i, m in enumerate(messages)]
    checks.check_tool_results(normal, "messages")
    _refuse_unsupported(body)
    logprobs = None
    if checks.flag(body, "logprobs", False):
        logprobs = _int(body, "top_logprobs", 0, 0, MAX_LOGPROBS)
    elif body.get("top_logprobs") is not None:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    request = _request(body, logprobs)
    checked(lambda: set_prompt(request, normal))
    tools = body.get("tools")
    tool_choice = body.get("tool_choice")
    if tools is not None:
        checks.tools(tools)
    checks.tool_choice(tool_choice)
    parallel = checks.flag(body, "parallel_tool_calls", True)
    if tools:
        checked(lambda: set_tools(request, tools, tool_choice, parallel))
    elif tool_choice not in (None, "none", "auto"):
        raise bad_request("tool_choice needs tools", "tool_choice")
    response_format = body.get("response_format")
    if response_format is not None:
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind not in ("text", "json_object", "json_schema"):
            raise bad_request(
                f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}", "response_format"
            )
        if kind == "json_schema" and not isinstance(response_format.get("json_schema"), dict):
            raise bad_request("response_format.json_schema must be an object holding the schema", "response_format")
        if kind != "text":  # text: no grammar
            checked(lambda: set_response_format(request, response_format))
    key = body.get("cbd_session") or session_header
    if key is not None and not isinstance(key, str):
        raise bad_request("cbd_session must be a string", "cbd_session")
    scoped = (owner, key) if key else None
    return Call([request], request.n, _stream(body), _include_usage(body), logprobs, scoped, normal)


def completion_call(body: dict[str, Any], max_prompts: int = 256) -> Call:
    prompt = body.get("prompt")
    prompts: list[Any]
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        prompts = prompt
    else:
        raise bad_request("'prompt' must be a string, a list of token ids, or a list of either", "prompt")
    if len(prompts) > max_prompts:  # each is a Generate call: refused before any starts
        raise bad_request(f"at most {max_prompts} prompts in one call, got {len(prompts)}", "prompt")
    for i, p in enumerate(prompts):
        if isinstance(p, list):
            checks.token_ids(p, f"prompt[{i}]" if len(prompts) > 1 or prompt is not p else "prompt")
    _refuse_unsupported(body)
    if checks.flag(body, "echo", False):
        raise bad_request("echo is not supported", "echo")
    if body.get("suffix"):
        raise bad_request("suffix is not supported", "suffix")
    n = _int(body, "n", 1, 1, MAX_CANDIDATES)
    if _int(body, "best_of", n, 1, MAX_CANDIDATES) != n:
        raise bad_request("best_of other than n is not supported", "best_of")
    logprobs = None if body.get("logprobs") is None else _int(body, "logprobs", 0, 0, MAX_LOGPROBS)
    requests = []
    for p in prompts:
        max_tokens = body.get("max_tokens")
        request = _request(
            {**body, "max_tokens": COMPLETIONS_MAX_TOKENS if max_tokens is None else max_tokens}, logprobs
        )
        checked(lambda r=request, p=p: set_prompt(r, p))
        requests.append(request)
    return Call(requests, n, _stream(body), _include_usage(body), logprobs)


def chat_message(m: Any, i: int) -> dict[str, Any]:
    """A message as the daemon takes it: text content, the role's canonical name, tool fields kept."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise bad_request(f"messages[{i}] must be an object with a string 'role'", f"messages[{i}]")
    if m["role"] not in _KNOWN_ROLES:
        raise bad_request(
            f"messages[{i}].role must be one of {', '.join(_KNOWN_ROLES)}, got {m['role']!r}", f"messages[{i}].role"
        )
    content = m.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{i}]: only text content parts are supported", f"messages[{i}].content")
            texts.append(part["text"])
        content = "".join(texts)
    elif content is None:
        content = ""
    elif not isinstance(content, str):
        raise bad_request(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}]")
    out: dict[str, Any] = {"role": _ROLES.get(m["role"], m["role"]), "content": content}
    if m.get("tool_calls") is not None:
        out["tool_calls"] = checks.tool_calls(m["tool_calls"], i)
    if m.get("tool_call_id") is not None:
        out["tool_call_id"] = checks.tool_call_id(m["tool_call_id"], i)
    return out


def _request(body: dict[str, Any], logprobs: int | None) -> pb.GenerateRequest:
    request = pb.GenerateRequest(n=_int(body, "n", 1, 1, MAX_CANDIDATES))
    s = request.sampling
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    s.max_tokens = _int(body, name, MAX_TOKENS, 1, MAX_TOKENS)  # omitted: up to the context
    for name, high in (("temperature", 2.0), ("top_p", 1.0), ("min_p", 1.0)):  # the API's ranges
        value = checks.number(body, name, 0.0, high)
        if value is not None and name == "top_p":
            checks.set_top_p(s, value)
        elif value is not None:
            setattr(s, name, value)
    if body.get("top_k") is not None:
        s.top_k = max(0, _int(body, "top_k", 0, -1, (1 << 31) - 1))  # -1 disables, as 0 does here
    if body.get("seed") is not None:
        s.seed = _int(body, "seed", 0, -(1 << 63), (1 << 64) - 1) % (1 << 63)
    stop = body.get("stop")
    if isinstance(stop, str):
        s.stop.append(stop)
    elif isinstance(stop, list) and all(isinstance(x, str) for x in stop):
        s.stop.extend(stop)
    elif stop is not None:
        raise bad_request("stop must be a string or a list of strings", "stop")
    if len(s.stop) > MAX_STOP_STRINGS:
        raise bad_request(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(s.stop)}", "stop")
    ids = body.get("stop_token_ids")
    if ids is not None:
        s.stop_token_ids.extend(checks.token_ids(ids, "stop_token_ids"))
    s.ignore_eos = checks.flag(body, "ignore_eos", False)
    if logprobs is not None:
        s.logprobs = logprobs
    return request


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = body.get(name)
        if value not in (None, 0, 0.0, 1.0 if name == "repetition_penalty" else 0):
            raise bad_request(f"{name} is not supported (only its neutral value)", name)
    if body.get("logit_bias"):
        raise bad_request("logit_bias is not supported", "logit_bias")
    for name in ("functions", "function_call"):  # the API's older names for tools and tool_choice
        if body.get(name) is not None:
            raise bad_request(f"{name} is not supported: use tools and tool_choice", name)
    modalities = body.get("modalities")
    if modalities not in (None, ["text"]) or body.get("audio") is not None:
        raise bad_request("only text output is supported", "modalities")


def _stream(body: dict[str, Any]) -> bool:
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise bad_request("stream must be a boolean", "stream")
    return bool(stream)


def _include_usage(body: dict[str, Any]) -> bool:
    options = checks.section(body, "stream_options")
    return checks.flag(options, "include_usage", False, "stream_options.include_usage")


def _int(body: dict[str, Any], name: str, default: int, low: int, high: int) -> int:
    """body[name] (default when absent), an integer from low to high, both included."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise bad_request(f"{name} must be an integer from {low} to {high}, got {value!r}", name)
    return value


def checked(fn: Any) -> None:
    """The client library's conversions raise CbdError(INVALID_ARGUMENT); here that is a 400."""
    try:
        fn()
    except CbdError as exc:
        raise ApiError(400, exc.details) from None
    except (TypeError, ValueError) as exc:
        raise ApiError(400, str(exc)) from None
