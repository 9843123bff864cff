"""The client's calls without their I/O: each API method's request, routing key and reply conversion.

`Client` and `AsyncClient` are thin shells over this module: a method builds its call here and runs
it (blocking, or awaited), so a call is written once. A request the contract's types cannot carry is
refused here with CbdError(INVALID_ARGUMENT), as the daemon would refuse it. Public: the OpenAI gateway
builds its requests with `set_prompt` too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from cbd_client import replies
from cbd_client.contract import PRIORITY_PROTO, RETENTION_PROTO, Priority, Retention
from cbd_client.errors import invalid_argument as invalid
from cbd_client.routing import fork_session_id, new_session_id
from cbd_client.structured import set_message_tool_fields, set_response_format, set_tools
from cbd_client.types import ModelInfo, Prompt, SessionInfo, Stats
from cbd_client.v1 import cbd_pb2 as pb

R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class Unary(Generic[R]):
    """One unary call: the Cbd method, its request, the affinity key it is routed by, its result."""

    method: str  # the stub's attribute, e.g. "GetSession"
    request: Message
    result: Callable[[Any], R]  # the reply message -> what the API method returns
    key: str | None = None  # a session id or a plain call's affinity key (routing.with_affinity)


@dataclass(frozen=True, slots=True)
class Generate:
    """A Generate call: its request and routing key; its responses are folded by replies.py."""

    request: pb.GenerateRequest
    key: str | None


_SAMPLING_FIELDS = frozenset(pb.SamplingParams.DESCRIPTOR.fields_by_name)
_REQUEST_OPTIONS = frozenset(
    {"request_id", "session_id", "parent_candidate", "tools", "tool_choice", "parallel_tool_calls", "response_format",
     "expected_idle_ms", "retention", "priority", "tenant", "affinity", "allow_special_tokens", "stream_interval"}
)  # fmt: skip


def generate(prompt: Prompt, n: int, options: dict[str, Any]) -> Generate:
    """options: request_id, session_id, parent_candidate, tools, tool_choice, parallel_tool_calls, response_format and
    the sampling keywords (see the module docstring of client.py)."""
    request = generate_request(prompt, n, options)
    return Generate(request, request.session_id or options.get("affinity"))


def tokenize(prompt: str | list[dict[str, str]], allow_special_tokens: bool) -> Unary[list[int]]:
    request = pb.TokenizeRequest(allow_special_tokens=allow_special_tokens)
    set_prompt(request, prompt)
    return Unary("Tokenize", request, lambda reply: list(reply.token_ids))


def model_info() -> Unary[ModelInfo]:
    return Unary("GetModelInfo", pb.GetModelInfoRequest(), replies.model_info)


def stats() -> Unary[Stats]:
    return Unary("GetStats", pb.GetStatsRequest(), replies.stats)


def open_session(
    prefix: Prompt | None, ttl: float | None, session_id: str | None, expected_idle_ms: int | None,
    retention: str | None, priority: str | None,
) -> Unary[SessionInfo]:  # fmt: skip
    """The id is proposed here (`session_id`, or a random one), so that a proxy routes the open like the
    session's later calls."""
    sid = session_id or new_session_id()
    return Unary("OpenSession", open_session_request(prefix, ttl, sid, expected_idle_ms, retention, priority),
                 replies.session_info, sid)  # fmt: skip


def get_session(session_id: str, tenant: str) -> Unary[SessionInfo]:
    request = pb.GetSessionRequest(session_id=session_id, tenant=tenant)
    return Unary("GetSession", request, replies.session_info, session_id)


def list_sessions(all_tenants: bool) -> Unary[list[SessionInfo]]:
    request = pb.ListSessionsRequest(all_tenants=all_tenants)
    return Unary("ListSessions", request, lambda reply: [replies.session_info(s) for s in reply.sessions])


def fork_session(
    session_id: str, candidate: int | None, ttl: float | None, new_session_id: str | None
) -> Unary[SessionInfo]:
    request = pb.ForkSessionRequest(session_id=session_id, ttl_seconds=ttl or 0.0,
                                    new_session_id=new_session_id or fork_session_id(session_id))  # fmt: skip
    if candidate is not None:
        request.candidate = candidate
    return Unary("ForkSession", request, replies.session_info, session_id)


def close_session(session_id: str, tenant: str) -> Unary[None]:
    request = pb.CloseSessionRequest(session_id=session_id, tenant=tenant)
    return Unary("CloseSession", request, lambda reply: None, session_id)


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


def set_priority(message: Message, priority: str | None) -> None:
    """priority: "interactive" | "batch" (None: unset; see the proto's Priority)."""
    if priority is not None:
        if priority not in PRIORITY_PROTO:
            raise invalid(f"priority must be one of {sorted(p.value for p in Priority)}, got {priority!r}")
        _set(message, "priority", PRIORITY_PROTO[Priority(priority)])


def set_hints(message: Message, expected_idle_ms: int | None, retention: str | None) -> None:
    """Retention hints of a session (see proto SessionInfo.kv_tier): expected_idle_ms, and retention
    "low" | "normal" | "high" (None: unchanged / the default)."""
    if expected_idle_ms is not None:
        if isinstance(expected_idle_ms, bool) or not isinstance(expected_idle_ms, int):
            raise invalid(f"expected_idle_ms must be an integer number of milliseconds, got {expected_idle_ms!r}")
        _set(message, "expected_idle_ms", expected_idle_ms)
    if retention is not None:
        if retention not in RETENTION_PROTO:
            raise invalid(f"retention must be one of {sorted(r.value for r in Retention)}, got {retention!r}")
        _set(message, "retention", RETENTION_PROTO[Retention(retention)])


def generate_request(prompt: Prompt, n: int, options: dict[str, Any]) -> pb.GenerateRequest:
    """The GenerateRequest of `generate` (options as there)."""
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
    if options.get("stream_interval") is not None:  # tokens per stream message (see the proto)
        _set(request, "stream_interval", options["stream_interval"])
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
