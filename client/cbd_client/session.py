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

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any, Protocol

from cbd_client.errors import CbdError
from cbd_client.replay import Replay
from cbd_client.session_state import SessionState
from cbd_client.types import Completion, Delta, Prompt, SessionInfo


class _Client(Protocol):
    """What a Session needs of its client (cbd_client.Client; declared here so that the client module,
    which makes sessions, is imported by no one below it)."""

    def generate(self, prompt: Prompt, *, n: int = 1, **options: Any) -> Completion: ...
    def stream(self, prompt: Prompt, *, n: int = 1, **options: Any) -> Iterator[Delta]: ...
    def session(self, prefix: Prompt | None = None, ttl: float | None = None) -> Session: ...
    def fork_session(self, session_id: str, candidate: int | None = None, ttl: float | None = None) -> SessionInfo: ...
    def get_session(self, session_id: str) -> SessionInfo: ...
    def close_session(self, session_id: str) -> None: ...


class _AsyncClient(Protocol):
    """What an AsyncSession needs of its client (cbd_client.AsyncClient)."""

    async def generate(self, prompt: Prompt, *, n: int = 1, **options: Any) -> Completion: ...
    def stream(self, prompt: Prompt, *, n: int = 1, **options: Any) -> AsyncIterator[Delta]: ...
    async def session(self, prefix: Prompt | None = None, ttl: float | None = None) -> AsyncSession: ...
    async def fork_session(
        self, session_id: str, candidate: int | None = None, ttl: float | None = None
    ) -> SessionInfo: ...
    async def get_session(self, session_id: str) -> SessionInfo: ...
    async def close_session(self, session_id: str) -> None: ...


RECOVERY_PAUSE = 0.25  # seconds between re-open attempts (a proxy takes a health-check interval to eject a daemon)


class Session(SessionState):
    def __init__(
        self, client: _Client, info: SessionInfo, prefix: Prompt | None = None, ttl: float | None = None,
        recover: bool = False,
    ) -> None:  # fmt: skip
        super().__init__(info, prefix, ttl, recover)
        self.client = client

    def send(self, prompt: Prompt, *, n: int = 1, parent_candidate: int | None = None, **sampling: Any) -> Completion:
        """One turn, run to completion. With n > 1, call `choose` before the next turn."""
        parent = self._take_parent(parent_candidate)
        attempt = 0
        while True:
            try:
                completion = self.client.generate(prompt, n=n, session_id=self.session_id, parent_candidate=parent,
                                                  **sampling)  # fmt: skip
                break
            except CbdError as e:
                self._failed(e, attempt, parent, parent_candidate)
                attempt += 1
                self._reopen(parent)
                parent = None  # the chosen candidate is in the re-opened session's history now
        self._record(prompt, parent, completion)
        return completion

    def stream(
        self, prompt: Prompt, *, n: int = 1, parent_candidate: int | None = None, **sampling: Any
    ) -> Iterator[Delta]:
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
                if self._failed(e, attempt, parent, parent_candidate, replay):
                    break
                attempt += 1
                self._reopen(parent)
                parent = None  # the chosen candidate is in the re-opened session's history now
        self._record(prompt, parent, replay.completion())

    def _reopen(self, parent: int | None) -> None:
        prefix = self._reopen_from(parent)
        time.sleep(RECOVERY_PAUSE)
        try:
            session_id = self.client.session(prefix, self._ttl).session_id
        except CbdError as e:
            self._reopened(None, e)
        else:
            self._reopened(session_id, None)

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


class AsyncSession(SessionState):
    def __init__(
        self, client: _AsyncClient, info: SessionInfo, prefix: Prompt | None = None, ttl: float | None = None,
        recover: bool = False,
    ) -> None:  # fmt: skip
        super().__init__(info, prefix, ttl, recover)
        self.client = client

    async def send(
        self, prompt: Prompt, *, n: int = 1, parent_candidate: int | None = None, **sampling: Any
    ) -> Completion:
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
                self._failed(e, attempt, parent, parent_candidate)
                attempt += 1
                await self._reopen(parent)
                parent = None  # the chosen candidate is in the re-opened session's history now
        self._record(prompt, parent, completion)
        return completion

    async def stream(
        self, prompt: Prompt, *, n: int = 1, parent_candidate: int | None = None, **sampling: Any
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
                if self._failed(e, attempt, parent, parent_candidate, replay):
                    break
                attempt += 1
                await self._reopen(parent)
                parent = None
        self._record(prompt, parent, replay.completion())

    async def _reopen(self, parent: int | None) -> None:
        prefix = self._reopen_from(parent)
        await asyncio.sleep(RECOVERY_PAUSE)
        try:
            session_id = (await self.client.session(prefix, self._ttl)).session_id
        except CbdError as e:
            self._reopened(None, e)
        else:
            self._reopened(session_id, None)

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
