"""Every message between the frontend and the engine process: msgspec structs, MessagePack-encoded.

Commands go frontend -> engine process, one message each, in order on one socket. The engine process
answers with `Events`: at most one message per turn of its loop, carrying every output of that step for
all requests, the answers to commands, expired sessions, the loop's heartbeat and its stats. The
first message it sends is `Hello` (the model's facts, or why the engine could not start).

SamplingParams crosses as a plain mapping of its fields without the compiled grammar: the grammar's
spec crosses beside its compiled form, serialized by the frontend's compile worker (ipc/grammar_pool.py);
the engine process loads it off its command thread, or takes it from its cache by spec, and never compiles.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Union

import msgspec

from cbd import errors
from cbd.engine.grammar import CompiledGrammar, GrammarSpec
from cbd.engine.outputs import EngineStats, ModelFacts, RequestOutput
from cbd.engine.sampling_params import SamplingParams
from cbd.engine.sessions import SessionInfo

# ---- frontend -> engine process ------------------------------------------------------------------


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    prompt: list[int]
    params: dict[str, Any]  # params_to_wire
    grammar: GrammarSpec | None
    compiled_grammar: str | None = None  # the grammar compiled, serialized (grammar_to_wire)


class AddTurn(msgspec.Struct, tag=True, array_like=True):
    call_id: int  # answered with the request id, or the error that refused the turn
    request_id: str
    session_id: str
    token_ids: list[int]
    replace: bool
    parent_candidate: int | None
    params: dict[str, Any]
    grammar: GrammarSpec | None
    expected_idle: float | None = None  # retention hints (sessions.TurnInput)
    retention: int | None = None
    compiled_grammar: str | None = None  # the grammar compiled, serialized (grammar_to_wire)
    extends: bool = False  # sessions.TurnInput.extends


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_id: str


class OpenSession(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    ttl: float | None
    token_ids: list[int]
    chat: bool
    session_id: str | None = None  # proposed by the client
    expected_idle: float | None = None  # retention hints (SessionManager.open)
    retention: int = 0
    priority: int = 0  # its turns' scheduling class


class CloseSession(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    session_id: str


class GetSession(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    session_id: str


class ListSessions(msgspec.Struct, tag=True, array_like=True):
    call_id: int


class ForkSession(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    session_id: str
    candidate: int | None
    ttl: float | None
    new_session_id: str | None = None  # proposed by the client


class TouchSession(msgspec.Struct, tag=True, array_like=True):
    session_id: str


class ResetPrefixCache(msgspec.Struct, tag=True, array_like=True):
    pass


class Stop(msgspec.Struct, tag=True, array_like=True):
    """Stop the loop (live requests end with ABORT, streamed back), then exit."""


Command = Union[
    AddRequest, AddTurn, Abort, OpenSession, CloseSession, GetSession, ListSessions, ForkSession,
    TouchSession, ResetPrefixCache, Stop,
]  # fmt: skip

# ---- engine process -> frontend ------------------------------------------------------------------


class Failure(msgspec.Struct, array_like=True):
    """An error raised in the engine process, by class name (cbd.errors), message and retry hint."""

    kind: str
    message: str
    retry_after: float | None = None


class Reply(msgspec.Struct, array_like=True):
    call_id: int
    value: SessionInfo | list[SessionInfo] | str | None = None
    error: Failure | None = None


class Events(msgspec.Struct, array_like=True):
    outputs: list[RequestOutput]
    replies: list[Reply]
    expired: list[str]  # sessions that expired
    heartbeat: float  # the loop's heartbeat (time.monotonic(), one clock for every process of the host)
    stats: EngineStats | None
    fatal: Failure | None = None  # the error that stopped the engine (the process exits after this)


class Hello(msgspec.Struct, array_like=True):
    facts: ModelFacts | None
    checkpoint_dir: str | None  # where the frontend loads the same tokenizer from
    error: Failure | None = None  # the engine could not start; kind "load": the model could not be read


# ---- encoding ------------------------------------------------------------------------------------

command_encoder = msgspec.msgpack.Encoder()
command_decoder = msgspec.msgpack.Decoder(Command)
events_encoder = msgspec.msgpack.Encoder()
events_decoder = msgspec.msgpack.Decoder(Events)
hello_decoder = msgspec.msgpack.Decoder(Hello)


def params_to_wire(params: SamplingParams) -> dict[str, Any]:
    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.name != "grammar"}


def grammar_to_wire(grammar: CompiledGrammar | None) -> tuple[GrammarSpec | None, str | None]:
    """A request's grammar as it crosses: its spec and its serialized compiled form."""
    if grammar is None:
        return None, None
    if grammar.serialized is None:
        raise ValueError("a grammar crosses to the engine process compiled by the frontend's pool, serialized")
    return grammar.spec, grammar.serialized


def params_from_wire(values: dict[str, Any]) -> SamplingParams:
    for name in ("stop", "stop_token_ids"):
        values[name] = tuple(values[name])
    return SamplingParams(**values)


def failure(exc: BaseException) -> Failure:
    kind = type(exc).__name__ if isinstance(exc, errors.CbdError) else "EngineFailure"
    message = str(exc) if isinstance(exc, errors.CbdError) else f"{type(exc).__name__}: {exc}"
    return Failure(kind, message, getattr(exc, "retry_after", None))


def raise_failure(f: Failure) -> BaseException:
    """The exception a Failure stands for (a cbd error of the same class; EngineFailure otherwise)."""
    cls = getattr(errors, f.kind, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.CbdError)):
        cls = errors.EngineFailure
    if cls is errors.CapacityExceeded:
        return errors.CapacityExceeded(f.message, retry_after=f.retry_after)
    return cls(f.message)
