"""Sessions on the client: a multi-turn conversation whose KV cache stays on the daemon between turns.

    with client.session([{"role": "system", "content": "You are terse."}]) as s:
        print(s.send([{"role": "user", "content": "Hi"}]).text)          # one reply joins the history
        options = s.send([{"role": "user", "content": "Plan?"}], n=4, temperature=0.9)
        s.choose(best(options.candidates))                                 # that candidate continues
        alt = s.fork()                                                     # a copy-on-write branch
        s.send([{"role": "user", "content": "Go on."}])

Each turn sends only the new input (chat messages, text or token ids, as the session began). After a
turn with n > 1 the next turn continues from the candidate given to `choose` (or `parent_candidate=`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING

import grpc

from cbd_client._convert import Prompt
from cbd_client.errors import CbdError
from cbd_client.replay import Replay
from cbd_client.transcript import Transcript
from cbd_client.types import Completion, Delta, SessionInfo

if TYPE_CHECKING:
    from cbd_client.aio import AsyncClient
    from cbd_client.client import Client


# Answers the daemon gives before a turn starts: the session is as it was, so the choice still holds.
_REFUSALS = frozenset({
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND,
})  # fmt: skip


# A session whose daemon is gone: NOT_FOUND from another daemon, or UNAVAILABLE from a proxy meanwhile.
_LOST = frozenset({grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE})
RECOVERY_ATTEMPTS = 20
RECOVERY_PAUSE = 0.25  # seconds between attempts (a proxy takes a health-check interval to eject a daemon)


class _ChosenCandidate:
    """The candidate `choose` picked; used by the next turn, kept if the daemon refuses that turn.

    recover=True: the session keeps a Transcript, and a turn that finds the session lost (its daemon gone
    behind a proxy: NOT_FOUND or UNAVAILABLE) re-opens it from the transcript under a new id (so on a live
    daemon) and runs the turn there (send and stream alike); without it such a turn raises the CbdError."""

    def __init__(self, prefix: Prompt | None = None, ttl: float | None = None, recover: bool = False) -> None:
        self._parent: int | None = None
        self._ttl = ttl
        self.transcript = Transcript(prefix) if recover else None
        self.recoveries = 0  # how many times the session was re-opened elsewhere

    def _lost(self, error: CbdError, attempt: int) -> bool:
        return self.transcript is not None and error.code in _LOST and attempt < RECOVERY_ATTEMPTS

    def choose(self, candidate: int) -> None:
        """The candidate of the last (n > 1) turn that the next turn continues; the others are released then."""
        self._parent = candidate

    def _take_parent(self, explicit: int | None) -> int | None:
        parent = explicit if explicit is not None else self._parent
        self._parent = None
        return parent

    def _stream_broke(
        self, error: CbdError, attempt: int, replay: Replay, parent: int | None, explicit: int | None
    ) -> bool:
        """A streamed turn's call failed: True if the answer is whole anyway (lost after every candidate's
        last delta: nothing to run again; the transcript has it for the next turn), False if the session
        is lost and is to be re-opened; otherwise the error is raised."""
        if not self._lost(error, attempt):
            self._refused(parent, explicit, error, replay.started)
            raise error
        return replay.finished

    def _refused(self, parent: int | None, explicit: int | None, error: CbdError, streamed: bool) -> None:
        if explicit is None and not streamed and error.code in _REFUSALS and self._parent is None:
            self._parent = parent  # a refused turn (e.g. retried after RESOURCE_EXHAUSTED) keeps the choice


class Session(_ChosenCandidate):
    def __init__(
        self, client: Client, info: SessionInfo, prefix: Prompt | None = None, ttl: float | None = None,
        recover: bool = False,
    ) -> None:  # fmt: skip
        super().__init__(prefix, ttl, recover)
        self.client = client
        self.session_id = info.session_id

    def send(self, prompt: Prompt, *, n: int = 1, parent_candidate: int | None = None, **sampling) -> Completion:
        """One turn, run to completion. With n > 1, call `choose` before the next turn."""
        parent = self._take_parent(parent_candidate)
        attempt = 0
        while True:
            try:
                completion = self.client.generate(prompt, n=n, session_id=self.session_id, parent_candidate=parent,
                                                  **sampling)  # fmt: skip
                break
            except CbdError as e:
                if not self._lost(e, attempt):
                    self._refused(parent, parent_candidate, e, streamed=False)
                    raise
                attempt += 1
                self._reopen(parent)
                parent = None  # the chosen candidate is in the re-opened session's history now
        if self.transcript is not None:
            self.transcript.continue_from(parent)
            self.transcript.turn(prompt, completion)
        return completion

    def _reopen(self, parent: int | None) -> None:
        """The session is lost: open it again from the transcript (the chosen candidate included)."""
        import time

        assert self.transcript is not None
        self.transcript.continue_from(parent)
        time.sleep(RECOVERY_PAUSE)
        try:
            self.session_id = self.client.session(self.transcript.as_prefix(), self._ttl).session_id
            self.recoveries += 1
        except CbdError as e:
            if e.code not in _LOST:
                raise

    def stream(self, prompt: Prompt, *, n: int = 1, parent_candidate: int | None = None, **sampling) -> Iterator[Delta]:
        """One turn, streamed. With recover=True a lost session is re-opened from the transcript and the
        turn run again there; the caller still sees one stream (see replay.py: what was already streamed
        must come out the same, as greedy or seeded sampling does, else the turn fails with ABORTED)."""
        parent = self._take_parent(parent_candidate)
        replay = Replay(n)
        attempt = 0
        while True:
            replay.restart()
            try:
                for delta in self.client.stream(
                    prompt, n=n, session_id=self.session_id, parent_candidate=parent, **sampling
                ):
                    fresh = replay.feed(delta)
                    if fresh is not None:
                        yield fresh
                break
            except CbdError as e:
                if self._stream_broke(e, attempt, replay, parent, parent_candidate):
                    break
                attempt += 1
                self._reopen(parent)
                parent = None  # the chosen candidate is in the re-opened session's history now
        if self.transcript is not None:
            self.transcript.continue_from(parent)
            self.transcript.turn(prompt, replay.completion())

    def fork(self, candidate: int | None = None, ttl: float | None = None) -> Session:
        """A new session continuing from this one (or from a pending candidate), sharing its KV copy-on-write."""
        fork = Session(self.client, self.client.fork_session(self.session_id, candidate, ttl))
        fork.transcript = self.transcript.fork(candidate) if self.transcript is not None else None
        return fork

    def info(self) -> SessionInfo:
        return self.client.get_session(self.session_id)

    def close(self) -> None:
        self.client.close_session(self.session_id)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncSession(_ChosenCandidate):
    def __init__(
        self, client: AsyncClient, info: SessionInfo, prefix: Prompt | None = None, ttl: float | None = None,
        recover: bool = False,
    ) -> None:  # fmt: skip
        super().__init__(prefix, ttl, recover)
        self.client = client
        self.session_id = info.session_id

    async def send(self, prompt: Prompt, *, n: int = 1, parent_candidate: int | None = None, **sampling) -> Completion:
        """As Session.send (with recover=True, a lost session is re-opened from the transcript)."""
        parent = self._take_parent(parent_candidate)
        attempt = 0
        while True:
            try:
                completion = await self.client.generate(
                    prompt, n=n, session_id=self.session_id, parent_candidate=parent, **sampling
                )
                break
            except CbdError as e:
                if not self._lost(e, attempt):
                    self._refused(parent, parent_candidate, e, streamed=False)
                    raise
                attempt += 1
                await self._reopen(parent)
                parent = None  # the chosen candidate is in the re-opened session's history now
        if self.transcript is not None:
            self.transcript.continue_from(parent)
            self.transcript.turn(prompt, completion)
        return completion

    async def _reopen(self, parent: int | None) -> None:
        import asyncio

        assert self.transcript is not None
        self.transcript.continue_from(parent)
        await asyncio.sleep(RECOVERY_PAUSE)
        try:
            self.session_id = (await self.client.session(self.transcript.as_prefix(), self._ttl)).session_id
            self.recoveries += 1
        except CbdError as e:
            if e.code not in _LOST:
                raise

    async def stream(
        self, prompt: Prompt, *, n: int = 1, parent_candidate: int | None = None, **sampling
    ) -> AsyncIterator[Delta]:
        """As Session.stream (with recover=True, a lost session is re-opened and the turn replayed)."""
        parent = self._take_parent(parent_candidate)
        replay = Replay(n)
        attempt = 0
        while True:
            replay.restart()
            try:
                async for delta in self.client.stream(prompt, n=n, session_id=self.session_id,
                                                      parent_candidate=parent, **sampling):  # fmt: skip
                    fresh = replay.feed(delta)
                    if fresh is not None:
                        yield fresh
                break
            except CbdError as e:
                if self._stream_broke(e, attempt, replay, parent, parent_candidate):
                    break
                attempt += 1
                await self._reopen(parent)
                parent = None
        if self.transcript is not None:
            self.transcript.continue_from(parent)
            self.transcript.turn(prompt, replay.completion())

    async def fork(self, candidate: int | None = None, ttl: float | None = None) -> AsyncSession:
        fork = AsyncSession(self.client, await self.client.fork_session(self.session_id, candidate, ttl))
        fork.transcript = self.transcript.fork(candidate) if self.transcript is not None else None
        return fork

    async def info(self) -> SessionInfo:
        return await self.client.get_session(self.session_id)

    async def close(self) -> None:
        await self.client.close_session(self.session_id)

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
