"""What the engine thread's inbox holds: the API's tells (api.py) and these in-process envelopes.

Callers (any thread) put a command in the inbox; the engine thread applies the queued commands between
steps, in order. A request reserved in admission travels with its `LiveRequest` record, so the engine
thread never looks it up again; a question travels with the `Future` its answer (or error) is set on.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Union

from cbd.engine import api
from cbd.engine.live import LiveRequest
from cbd.engine.sampling_params import SamplingParams
from cbd.engine.sessions.records import TurnInput


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
class Asked:
    question: api.Question
    future: Future[Any]  # its answer, of the type its reply declares (api.py)


@dataclass(slots=True)
class RunInEngine:
    """Tests and tools only: run fn(core) between steps. The server never sends it."""

    fn: Callable[[Any], Any]
    future: Future[Any]


Command = Union[AddRequest, AddTurn, Asked, RunInEngine, api.Abort, api.TouchSession, api.ResetPrefixCache, api.Stop]
