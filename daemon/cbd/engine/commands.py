"""Commands that cross into the engine thread: one small dataclass each, dispatched by type.

Callers (any thread) put a command in the engine's inbox; the engine thread applies the queued
commands between steps, in order. A command that has an answer carries a `Future`: the engine
thread sets its result (plain types: a request id, a `SessionInfo`, None) or the error to raise.
A command whose request was reserved in admission carries that `LiveRequest` record, so the
engine thread never looks the request up again.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Union

from cbd.engine.live import LiveRequest
from cbd.engine.sampling_params import SamplingParams
from cbd.engine.sessions import SessionInfo, TurnInput


@dataclass(slots=True)
class AddRequest:
    live: LiveRequest  # reserved and validated by the caller
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(slots=True)
class AddTurn:
    live: LiveRequest  # reserved by the caller; the prompt is validated when the turn begins
    session_id: str
    turn: TurnInput
    params: SamplingParams
    future: Future[str]  # the request id once the turn is queued


@dataclass(slots=True)
class Abort:
    request_id: str


@dataclass(slots=True)
class OpenSession:
    ttl: float | None
    token_ids: list[int]  # the session's first history (a system prompt), validated by the caller
    chat: bool  # the history is a rendered conversation (turns re-render it)
    future: Future[SessionInfo]
    session_id: str | None = None  # proposed by the caller; None: the engine makes one
    expected_idle: float | None = None  # retention hints (see SessionManager.open)
    retention: int = 0
    priority: int = 0  # its turns' scheduling class (sampling_params.PRIORITY_*)


@dataclass(slots=True)
class CloseSession:
    session_id: str
    future: Future[None]


@dataclass(slots=True)
class GetSession:
    session_id: str
    future: Future[SessionInfo]


@dataclass(slots=True)
class ListSessions:
    future: Future[list[SessionInfo]]


@dataclass(slots=True)
class ForkSession:
    session_id: str
    candidate: int | None
    ttl: float | None
    future: Future[SessionInfo]
    new_session_id: str | None = None  # the fork's id, proposed by the caller; None: the engine makes one


@dataclass(slots=True)
class TouchSession:
    """Its client is still there (a turn refused for now): the idle TTL starts over."""

    session_id: str


@dataclass(slots=True)
class ResetPrefixCache:
    pass


@dataclass(slots=True)
class RunInEngine:
    """Tests and tools only: run fn(core) between steps. The server never sends it."""

    fn: Callable[[Any], Any]
    future: Future[Any]


@dataclass(slots=True)
class Stop:
    pass


Command = Union[
    AddRequest, AddTurn, Abort, OpenSession, CloseSession, GetSession, ListSessions, ForkSession,
    TouchSession, ResetPrefixCache, RunInEngine, Stop,
]  # fmt: skip
