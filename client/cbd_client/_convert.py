"""Between the client's Python arguments and results and the cbd.v1 messages."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any, cast

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from cbd_client.errors import invalid_argument as invalid
from cbd_client.structured import set_message_tool_fields, set_response_format, set_tools
from cbd_client.types import (
    Candidate,
    Completion,
    Delta,
    ModelInfo,
    SessionInfo,
    Stats,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    Usage,
)  # fmt: skip
from cbd_client.v1 import cbd_pb2 as pb

Prompt = str | Sequence[int] | Sequence[dict[str, str]]

_FINISH = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
    pb.FINISH_REASON_ERROR: "error",
    pb.FINISH_REASON_TOOL_CALLS: "tool_calls",
}
_SAMPLING_FIELDS = frozenset(pb.SamplingParams.DESCRIPTOR.fields_by_name)


def set_prompt(message: pb.GenerateRequest | pb.TokenizeRequest | pb.OpenSessionRequest, prompt: Prompt) -> None:
    """A str is text; a list of ints is token ids; a list of {"role", "content"} dicts is a chat."""
    if isinstance(prompt, str):
        message.text = prompt
    elif isinstance(prompt, Sequence) and prompt and all(isinstance(m, dict) for m in prompt):
        for i, item in enumerate(prompt):
            m = cast(dict[str, Any], item)
            content = m.get("content")
            if content is None and m.get("tool_calls"):
                content = ""  # an assistant message that only calls tools
            if not isinstance(m.get("role"), str) or not isinstance(content, str):
                raise invalid(f"chat message {i} needs a string 'role' and a string 'content', got {m!r}")
            set_message_tool_fields(message.chat.messages.add(role=m["role"], content=content), m)
    elif (
        isinstance(message, (pb.GenerateRequest, pb.OpenSessionRequest))
        and isinstance(prompt, Sequence)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        if any(not 0 <= t < 2**32 for t in prompt):  # type: ignore[operator]
            raise invalid("token ids must be non-negative integers below 2^32")
        message.tokens.ids.extend(prompt)
    else:
        kinds = "a str, a list of token ids, or a list of chat message dicts"
        raise invalid(
            f"prompt must be {kinds if not isinstance(message, pb.TokenizeRequest) else 'a str or chat message dicts'}"
        )


_REQUEST_OPTIONS = frozenset(
    {"request_id", "session_id", "parent_candidate", "tools", "tool_choice", "parallel_tool_calls", "response_format",
     "expected_idle_ms", "retention", "priority", "tenant", "affinity", "allow_special_tokens"}
)  # fmt: skip

_RETENTION = {"low": pb.RETENTION_LOW, "normal": pb.RETENTION_NORMAL, "high": pb.RETENTION_HIGH}
_RETENTION_NAMES = {v: k for k, v in _RETENTION.items()}
_PRIORITY = {"interactive": pb.PRIORITY_INTERACTIVE, "batch": pb.PRIORITY_BATCH}
_PRIORITY_NAMES = {v: k for k, v in _PRIORITY.items()}
_KV_TIERS = {pb.KV_TIER_NONE: "none", pb.KV_TIER_GPU: "gpu", pb.KV_TIER_HOST: "host", pb.KV_TIER_RECOMPUTE: "recompute"}


def set_priority(message: Message, priority: str | None) -> None:
    """priority: "interactive" | "batch" (None: unset; see the proto's Priority)."""
    if priority is not None:
        if priority not in _PRIORITY:
            raise invalid(f"priority must be one of {sorted(_PRIORITY)}, got {priority!r}")
        _set(message, "priority", _PRIORITY[priority])


def set_hints(message: Message, expected_idle_ms: int | None, retention: str | None) -> None:
    """Retention hints of a session (see proto SessionInfo.kv_tier): expected_idle_ms, and retention
    "low" | "normal" | "high" (None: unchanged / the default)."""
    if expected_idle_ms is not None:
        if isinstance(expected_idle_ms, bool) or not isinstance(expected_idle_ms, int):
            raise invalid(f"expected_idle_ms must be an integer number of milliseconds, got {expected_idle_ms!r}")
        _set(message, "expected_idle_ms", expected_idle_ms)
    if retention is not None:
        if retention not in _RETENTION:
            raise invalid(f"retention must be one of {sorted(_RETENTION)}, got {retention!r}")
        _set(message, "retention", _RETENTION[retention])


def generate_request(prompt: Prompt, n: int, options: dict[str, Any]) -> pb.GenerateRequest:
    """options: request_id, session_id, parent_candidate, tools, tool_choice, parallel_tool_calls, response_format and the
    sampling keywords (see the module docstring of client.py)."""
    sampling = {k: v for k, v in options.items() if k not in _REQUEST_OPTIONS}
    unknown = sorted(set(sampling) - _SAMPLING_FIELDS)
    if unknown:
        raise TypeError(f"unknown parameters {unknown}; known: {sorted(_SAMPLING_FIELDS | _REQUEST_OPTIONS)}")
    request_id, session_id = options.get("request_id") or "", options.get("session_id") or ""
    affinity = options.get("affinity")
    if affinity is not None and (session_id or not isinstance(affinity, str) or not affinity):
        raise invalid("affinity routes a plain request (a session's calls are routed by its id); give a non-empty str")
    parent_candidate = options.get("parent_candidate")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise invalid(f"n must be an integer >= 1, got {n!r}")
    request = pb.GenerateRequest()
    _set(request, "n", n)
    _set(request, "request_id", request_id)
    _set(request, "session_id", session_id)
    if parent_candidate is not None:
        _set(request, "parent_candidate", parent_candidate)
    set_hints(request, options.get("expected_idle_ms"), options.get("retention"))
    set_priority(request, options.get("priority"))
    if options.get("tenant") is not None:
        _set(request, "tenant", options["tenant"])
    if options.get("allow_special_tokens"):  # raw mode: special-token strings in a text prompt are tokens
        _set(request, "allow_special_tokens", True)
    set_prompt(request, prompt)
    parallel = options.get("parallel_tool_calls")
    set_tools(request, options.get("tools"), options.get("tool_choice"), True if parallel is None else parallel)
    set_response_format(request, options.get("response_format"))
    for name, value in sampling.items():
        if value is not None:
            _set(request.sampling, name, [value] if isinstance(value, str) and name == "stop" else value)
    return request


def _set(message: Message, name: str, value: object) -> None:
    """Set a field, turning protobuf's ValueError / TypeError into the daemon's style of message."""
    field = message.DESCRIPTOR.fields_by_name[name]
    unsigned = field.cpp_type in (FieldDescriptor.CPPTYPE_UINT32, FieldDescriptor.CPPTYPE_UINT64)
    try:
        values = list(value) if field.is_repeated else [value]  # type: ignore[call-overload]
        if unsigned and any(isinstance(v, int) and v < 0 for v in values):
            raise ValueError("negative")
        if field.is_repeated:
            getattr(message, name).extend(values)
        else:
            setattr(message, name, value)
    except ValueError:
        bits = 32 if field.cpp_type == FieldDescriptor.CPPTYPE_UINT32 else 64
        wanted = f"a non-negative integer below 2^{bits}" if unsigned else "in range"
        raise invalid(f"{name} must be {wanted}, got {value!r}") from None
    except TypeError:
        raise invalid(f"{name} has the wrong type: got {type(value).__name__} {value!r}") from None


def _usage(message: pb.Usage) -> Usage:
    return Usage(message.prompt_tokens, message.cached_prompt_tokens, message.completion_tokens)


def deltas(response: pb.GenerateResponse) -> list[Delta]:
    out = []
    for c in response.candidates:
        logprobs = tuple(
            TokenLogprob(lp.token_id, lp.logprob, tuple((t.token_id, t.logprob) for t in lp.top)) for lp in c.logprobs
        )
        out.append(
            Delta(
                request_id=response.request_id,
                index=c.index,
                text=c.text,
                token_ids=tuple(c.token_ids),
                logprobs=logprobs,
                finish_reason=_FINISH.get(c.finish_reason),
                usage=_usage(c.usage) if c.HasField("usage") else None,
                tool_calls=tuple(ToolCallDelta(t.index, t.id, t.name, t.arguments) for t in c.tool_calls),
            )  # fmt: skip
        )
    return out


class CompletionBuilder:
    """Folds a Generate stream into finished candidates."""

    def __init__(self, n: int) -> None:
        self.request_id = ""
        self.candidates = [Candidate(i) for i in range(n)]
        self.usage: Usage | None = None

    def add(self, response: pb.GenerateResponse) -> list[Delta]:
        self.request_id = response.request_id
        if response.HasField("usage"):
            self.usage = _usage(response.usage)
        ds = deltas(response)
        for d in ds:
            c = self.candidates[d.index]
            c.text += d.text
            c.token_ids += d.token_ids
            c.logprobs += d.logprobs
            c.finish_reason = d.finish_reason or c.finish_reason
            c.usage = d.usage or c.usage
            for t in d.tool_calls:
                if t.index == len(c.tool_calls):
                    c.tool_calls.append(ToolCall(t.id, t.name))
                c.tool_calls[t.index].arguments += t.arguments
        return ds

    def result(self) -> Completion:
        return Completion(self.request_id, self.candidates, self.usage)


def model_info(message: pb.ModelInfo) -> ModelInfo:
    values = {f.name: getattr(message, f.name) for f in pb.ModelInfo.DESCRIPTOR.fields}
    values["eos_token_ids"] = tuple(values["eos_token_ids"])
    return ModelInfo(**values)


def stats(message: pb.Stats) -> Stats:
    return Stats(**{f.name: getattr(message, f.name) for f in pb.Stats.DESCRIPTOR.fields})


def session_info(message: pb.SessionInfo) -> SessionInfo:
    values = {f.name: getattr(message, f.name) for f in pb.SessionInfo.DESCRIPTOR.fields}
    values["kv_tier"] = _KV_TIERS.get(message.kv_tier, "none")
    values["retention"] = _RETENTION_NAMES.get(message.retention, "normal")
    values["expected_idle_ms"] = message.expected_idle_ms if message.HasField("expected_idle_ms") else None
    values["priority"] = _PRIORITY_NAMES.get(message.priority, "interactive")
    return SessionInfo(**values)


# Session affinity (proto/cbd/v1/cbd.proto, "Affinity"): every call about a session carries its key.
AFFINITY_HEADER = "x-cbd-affinity"


def affinity_key(session_id: str) -> str:
    """The part of a session id a proxy routes by: up to the first '.'."""
    return session_id.split(".", 1)[0]


def new_session_id() -> str:
    return uuid.uuid4().hex


def fork_session_id(source: str) -> str:
    """A fork's id: its source's affinity key, so that it lands on the daemon that holds the shared KV."""
    return f"{affinity_key(source)}.{uuid.uuid4().hex[:16]}"


def with_affinity(metadata: tuple[tuple[str, str], ...] | None, session_id: str | None, routes: Any = None) -> Any:
    """metadata plus the affinity header of session_id (a session id or a plain call's key) and, when a
    proxy named one for that key earlier, the replica header (routing.Routes)."""
    if not session_id:
        return metadata
    key = affinity_key(session_id)
    replica = routes.header(key) if routes is not None else None
    return (*(metadata or ()), (AFFINITY_HEADER, key), *((replica,) if replica else ()))


def open_session_request(
    prefix: Prompt | None, ttl: float | None, session_id: str, expected_idle_ms: int | None = None,
    retention: str | None = None, priority: str | None = None,
) -> pb.OpenSessionRequest:  # fmt: skip
    request = pb.OpenSessionRequest(session_id=session_id)
    _set(request, "ttl_seconds", ttl or 0.0)
    set_hints(request, expected_idle_ms, retention)
    set_priority(request, priority)
    if prefix is not None:
        set_prompt(request, prefix)
    return request
