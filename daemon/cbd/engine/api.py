"""The engine's API, declared once: every command, reply and event, as msgspec structs.

The in-process `Engine` (engine.py), the engine process's endpoint (ipc/endpoint.py) and the frontend's
`RemoteEngine` (ipc/remote.py) all speak it; between the two processes it crosses MessagePack-encoded.

- Requests: `AddRequest`, `AddTurn` (answered with `TurnAccepted` or `Refused`), `Abort`.
- Questions (`Question`): each declares its typed reply (`reply`); the engine thread answers them through
  one handler table (engine_loop.py), and both engines ask them through one generic `ask` (across the
  process boundary wrapped in `Ask` with a call id). Tells (`Tell`) have no answer.
- Adding a command: declare it here (with its reply) and handle it in engine_loop.py.

The engine process answers with `Events`: at most one message per turn of its loop, carrying every output
of that step for all requests, the replies, expired sessions, the loop's heartbeat and its stats. Its first
message is `Hello` (the model's facts, or why the engine could not start). SamplingParams crosses as
`WireParams` (its fields, typed, without the compiled grammar): the grammar's spec crosses beside its
compiled form, serialized by the frontend's compile worker (ipc/grammar_pool.py); the engine process loads
it off its command thread, or takes it from its cache by spec, and never compiles. Errors cross by
`ErrorKind`, never by class name: `ERRORS` is the one table between kinds and cbd's error classes.
"""

from __future__ import annotations

import enum
from typing import Union

import msgspec

from cbd import errors
from cbd.engine.grammar.matcher import CompiledGrammar, GrammarSpec
from cbd.engine.outputs import EngineStats, ModelFacts, RequestOutput, SaveReport
from cbd.engine.sampling_params import SamplingParams
from cbd.engine.sessions.records import SessionInfo

# ---- replies and errors --------------------------------------------------------------------------


class ErrorKind(enum.Enum):
    """What went wrong, as it crosses: one per cbd error class (ERRORS), and the engine's start failures."""

    INVALID_REQUEST = "invalid_request"
    CAPACITY_EXCEEDED = "capacity_exceeded"
    UNKNOWN_REQUEST = "unknown_request"
    ENGINE_STOPPED = "engine_stopped"
    UNSUPPORTED_MODEL = "unsupported_model"
    UNKNOWN_SESSION = "unknown_session"
    SESSION_EXISTS = "session_exists"
    PERMISSION_DENIED = "permission_denied"
    SESSION_BUSY = "session_busy"
    HISTORY_MISMATCH = "history_mismatch"
    ENGINE_FAILURE = "engine_failure"  # also any error that is not a cbd error (a bug)
    SETTING = "setting"  # the engine could not start: a setting that cannot work on this host
    LOAD = "load"  # the engine could not start: the model could not be read as configured


ERRORS: dict[ErrorKind, type[errors.CbdError]] = {
    ErrorKind.INVALID_REQUEST: errors.InvalidRequest, ErrorKind.CAPACITY_EXCEEDED: errors.CapacityExceeded,
    ErrorKind.UNKNOWN_REQUEST: errors.UnknownRequest, ErrorKind.ENGINE_STOPPED: errors.EngineStopped,
    ErrorKind.UNSUPPORTED_MODEL: errors.UnsupportedModel, ErrorKind.UNKNOWN_SESSION: errors.UnknownSession,
    ErrorKind.SESSION_EXISTS: errors.SessionExists, ErrorKind.PERMISSION_DENIED: errors.PermissionDenied,
    ErrorKind.SESSION_BUSY: errors.SessionBusy, ErrorKind.HISTORY_MISMATCH: errors.HistoryMismatch,
    ErrorKind.ENGINE_FAILURE: errors.EngineFailure, ErrorKind.SETTING: errors.SettingError,
}  # fmt: skip
_KINDS = {cls: kind for kind, cls in ERRORS.items()}


class Failure(msgspec.Struct, array_like=True):
    """An error raised in the engine process: its kind, message and retry hint."""

    kind: ErrorKind
    message: str
    retry_after: float | None = None


class SessionReply(msgspec.Struct, tag=True, array_like=True):
    """Answers OpenSession, GetSession and ForkSession."""

    call_id: int
    info: SessionInfo

    def value(self) -> SessionInfo:
        return self.info


class SessionsReply(msgspec.Struct, tag=True, array_like=True):
    """Answers ListSessions."""

    call_id: int
    infos: list[SessionInfo]

    def value(self) -> list[SessionInfo]:
        return self.infos


class TurnAccepted(msgspec.Struct, tag=True, array_like=True):
    """Answers AddTurn: the turn is queued under this request id."""

    call_id: int
    request_id: str

    def value(self) -> str:
        return self.request_id


class Done(msgspec.Struct, tag=True, array_like=True):
    """Answers a question whose answer is only that it was done (CloseSession)."""

    call_id: int

    def value(self) -> None:
        return None


class Refused(msgspec.Struct, tag=True, array_like=True):
    """Answers any call that failed."""

    call_id: int
    error: Failure


class SavedReply(msgspec.Struct, tag=True, array_like=True):
    """Answers SaveSessions."""

    call_id: int
    report: SaveReport

    def value(self) -> SaveReport:
        return self.report


class NotesReply(msgspec.Struct, tag=True, array_like=True):
    """Answers SavedNotes."""

    call_id: int
    notes: dict[str, bytes]

    def value(self) -> dict[str, bytes]:
        return self.notes


Reply = Union[SessionReply, SessionsReply, TurnAccepted, Done, SavedReply, NotesReply, Refused]


# ---- requests -------------------------------------------------------------------------------------


class WireParams(msgspec.Struct, array_like=True):
    """SamplingParams as it crosses, without its compiled grammar (that crosses beside it, see above)."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    logprobs: int | None
    n: int
    skip_special_tokens: bool
    priority: int | None
    tenant: str
    cache_scope: str
    stream_interval: int | None
    batch_stream_interval: int

    @classmethod
    def of(cls, params: SamplingParams) -> WireParams:
        return cls(**{f: getattr(params, f) for f in cls.__struct_fields__})

    def to_params(self, grammar: CompiledGrammar | None = None) -> SamplingParams:
        return SamplingParams(**{f: getattr(self, f) for f in self.__struct_fields__}, grammar=grammar)


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    prompt: list[int]
    params: WireParams
    grammar: GrammarSpec | None
    compiled_grammar: str | None = None  # the grammar compiled, serialized (grammar_to_wire)


class AddTurn(msgspec.Struct, tag=True, array_like=True):
    call_id: int  # answered with the request id, or the error that refused the turn
    request_id: str
    session_id: str
    token_ids: list[int]
    replace: bool
    parent_candidate: int | None
    params: WireParams
    grammar: GrammarSpec | None
    expected_idle: float | None = None  # retention hints (sessions.TurnInput)
    retention: int | None = None
    compiled_grammar: str | None = None  # the grammar compiled, serialized (grammar_to_wire)
    extends: bool = False  # sessions.TurnInput.extends


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_id: str


# ---- questions (answered) and tells (not) ----------------------------------------------------------


class OpenSession(msgspec.Struct, tag=True, array_like=True):
    ttl: float | None
    token_ids: list[int]  # its first history (a system prompt), validated by the caller
    chat: bool  # the history is a rendered conversation (turns re-render it)
    session_id: str | None = None  # proposed by the caller; None: the engine makes one
    expected_idle: float | None = None  # retention hints (SessionManager.open)
    retention: int = 0
    priority: int = 0  # its turns' scheduling class (sampling_params.PRIORITY_*)

    def reply(self, call_id: int, info: SessionInfo) -> Reply:
        return SessionReply(call_id, info)


class CloseSession(msgspec.Struct, tag=True, array_like=True):
    session_id: str

    def reply(self, call_id: int, _: None) -> Reply:
        return Done(call_id)


class GetSession(msgspec.Struct, tag=True, array_like=True):
    session_id: str

    def reply(self, call_id: int, info: SessionInfo) -> Reply:
        return SessionReply(call_id, info)


class ListSessions(msgspec.Struct, tag=True, array_like=True):
    def reply(self, call_id: int, infos: list[SessionInfo]) -> Reply:
        return SessionsReply(call_id, infos)


class ForkSession(msgspec.Struct, tag=True, array_like=True):
    session_id: str
    candidate: int | None
    ttl: float | None
    new_session_id: str | None = None  # the fork's id, proposed by the caller; None: the engine makes one

    def reply(self, call_id: int, info: SessionInfo) -> Reply:
        return SessionReply(call_id, info)


class SaveSessions(msgspec.Struct, tag=True, array_like=True):
    """Save sessions to their files (engine/sessions/checkpoints.py), with the frontend's changed notes.
    seconds: save every changed session, with KV within that many seconds (at shutdown); None: queue the
    changed sessions idle for at least idle_for seconds (in the background). Without a disk tier: nothing."""

    notes: dict[str, bytes]
    seconds: float | None
    idle_for: float = 0.0

    def reply(self, call_id: int, report: SaveReport) -> Reply:
        return SavedReply(call_id, report)


class SavedNotes(msgspec.Struct, tag=True, array_like=True):
    """The notes of the sessions restored at start (the frontend's chat transcripts)."""

    def reply(self, call_id: int, notes: dict[str, bytes]) -> Reply:
        return NotesReply(call_id, notes)


class SessionNote(msgspec.Struct, tag=True, array_like=True):
    """The note of one session (claimed from the shared session directory if another daemon left it there):
    asked before a chat turn of a session whose transcript the frontend does not have."""

    session_id: str

    def reply(self, call_id: int, notes: dict[str, bytes]) -> Reply:
        return NotesReply(call_id, notes)


Question = Union[
    OpenSession, CloseSession, GetSession, ListSessions, ForkSession, SaveSessions, SavedNotes, SessionNote
]


class TouchSession(msgspec.Struct, tag=True, array_like=True):
    """Its client is still there (a turn refused for now): the idle TTL starts over."""

    session_id: str


class ResetPrefixCache(msgspec.Struct, tag=True, array_like=True):
    """Drop every reusable prefix that no live request holds."""


Tell = Union[TouchSession, ResetPrefixCache]
# Commands about one existing session: applied in order behind that session's turn whose grammar still
# loads in the engine process (ipc/grammar_loads.py).
SESSION_ORDERED = (CloseSession, GetSession, ForkSession, TouchSession, SessionNote)


class Ask(msgspec.Struct, tag=True, array_like=True):
    """A question across the process boundary: answered by the reply with the same call id."""

    call_id: int
    question: Question


class Stop(msgspec.Struct, tag=True, array_like=True):
    """Stop the loop (live requests end with ABORT, streamed back), then exit."""


Command = Union[AddRequest, AddTurn, Abort, Ask, TouchSession, ResetPrefixCache, Stop]


# ---- events: engine -> its caller ---------------------------------------------------------------


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


def grammar_to_wire(grammar: CompiledGrammar | None) -> tuple[GrammarSpec | None, str | None]:
    """A request's grammar as it crosses: its spec and its serialized compiled form."""
    if grammar is None:
        return None, None
    if grammar.serialized is None:
        raise ValueError("a grammar crosses to the engine process compiled by the frontend's pool, serialized")
    return grammar.spec, grammar.serialized


def failure(exc: BaseException) -> Failure:
    kind = next((_KINDS[c] for c in type(exc).__mro__ if c in _KINDS), None)
    if kind is None:  # not a cbd error: a bug, reported with its class name
        return Failure(ErrorKind.ENGINE_FAILURE, f"{type(exc).__name__}: {exc}")
    return Failure(kind, str(exc), getattr(exc, "retry_after", None))


def raise_failure(f: Failure) -> BaseException:
    """The exception a Failure stands for (a cbd error of its kind)."""
    cls = ERRORS.get(f.kind, errors.EngineFailure)
    if cls is errors.CapacityExceeded:
        return errors.CapacityExceeded(f.message, retry_after=f.retry_after)
    return cls(f.message)
