"""A client session's state and its decisions, without I/O: Session and AsyncSession (session.py) are its
two shells, as readiness.py is wait_ready's.

State: the session's id (a new one after a recovery), the candidate `choose` picked for the next turn,
the transcript (recover=True). Decisions: which candidate a turn continues, whether a failed turn is
refused (the choice is kept), lost (re-open and run again) or over, and what a re-open starts from.
"""

from __future__ import annotations

import grpc

from cbd_client.errors import CbdError
from cbd_client.replay import Replay
from cbd_client.transcript import Transcript
from cbd_client.types import Completion, Prompt, SessionInfo

# Answers the daemon gives before a turn starts: the session is as it was, so the choice still holds.
_REFUSALS = frozenset({
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND,
})  # fmt: skip


# A session whose daemon is gone: NOT_FOUND from another daemon, or UNAVAILABLE from a proxy meanwhile.
_LOST = frozenset({grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE})
RECOVERY_ATTEMPTS = 20


class SessionState:
    """A session's state and decisions, without I/O (Session and AsyncSession are its two shells).

    The candidate `choose` picked is used by the next turn, and kept if the daemon refuses that turn.
    recover=True: the session keeps a Transcript, and a turn that finds the session lost (its daemon gone
    behind a proxy: NOT_FOUND or UNAVAILABLE) re-opens it from the transcript under a new id (so on a live
    daemon) and runs the turn there (send and stream alike); without it such a turn raises the CbdError."""

    def __init__(self, info: SessionInfo, prefix: Prompt | None, ttl: float | None, recover: bool) -> None:
        self.session_id = info.session_id
        self._parent: int | None = None
        self._ttl = ttl
        self.transcript = Transcript(prefix) if recover else None
        self.recoveries = 0  # how many times the session was re-opened elsewhere

    def choose(self, candidate: int) -> None:
        """The candidate of the last (n > 1) turn that the next turn continues; the others are released then."""
        self._parent = candidate

    def _take_parent(self, explicit: int | None) -> int | None:
        parent = explicit if explicit is not None else self._parent
        self._parent = None
        return parent

    def _failed(
        self, error: CbdError, attempt: int, parent: int | None, explicit: int | None, replay: Replay | None = None
    ) -> bool:
        """A turn's call failed: True if the answer is whole anyway (a stream lost after every candidate's
        last delta: nothing to run again; the transcript has it for the next turn), False if the session
        is lost and is to be re-opened; otherwise the error is raised."""
        if not (self.transcript is not None and error.code in _LOST and attempt < RECOVERY_ATTEMPTS):
            streamed = replay is not None and replay.started
            if explicit is None and not streamed and error.code in _REFUSALS and self._parent is None:
                self._parent = parent  # a refused turn (e.g. retried after RESOURCE_EXHAUSTED) keeps the choice
            raise error
        return replay is not None and replay.finished

    def _reopen_from(self, parent: int | None) -> Prompt | None:
        """The session is lost: the prefix to open it again with (the chosen candidate included)."""
        assert self.transcript is not None
        self.transcript.continue_from(parent)
        return self.transcript.as_prefix()

    def _reopened(self, session_id: str | None, error: CbdError | None) -> None:
        """The re-open's outcome; a daemon still lost is tried again on the turn's next attempt."""
        if error is not None and error.code not in _LOST:
            raise error
        if session_id is not None:
            self.session_id = session_id
            self.recoveries += 1

    def _record(self, prompt: Prompt, parent: int | None, completion: Completion) -> None:
        if self.transcript is not None:
            self.transcript.continue_from(parent)
            self.transcript.turn(prompt, completion)
