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

from cbd_client._convert import Prompt
from cbd_client.types import Completion, Delta, SessionInfo

if TYPE_CHECKING:
    from cbd_client.aio import AsyncClient
    from cbd_client.client import Client


class Session:
    def __init__(self, client: Client, info: SessionInfo) -> None:
        self.client = client
        self.session_id = info.session_id
        self._parent: int | None = None

    def send(self, prompt: Prompt, *, n: int = 1, parent_candidate: int | None = None, **sampling) -> Completion:  # type: ignore[no-untyped-def]
        """One turn, run to completion. With n > 1, call `choose` before the next turn."""
        parent = self._take_parent(parent_candidate)
        return self.client.generate(prompt, n=n, session_id=self.session_id, parent_candidate=parent, **sampling)

    def stream(self, prompt: Prompt, *, n: int = 1, parent_candidate: int | None = None, **sampling) -> Iterator[Delta]:  # type: ignore[no-untyped-def]
        parent = self._take_parent(parent_candidate)
        yield from self.client.stream(prompt, n=n, session_id=self.session_id, parent_candidate=parent, **sampling)

    def choose(self, candidate: int) -> None:
        """The candidate of the last (n > 1) turn that the next turn continues; the others are released then."""
        self._parent = candidate

    def fork(self, candidate: int | None = None, ttl: float | None = None) -> Session:
        """A new session continuing from this one (or from a pending candidate), sharing its KV copy-on-write."""
        return Session(self.client, self.client.fork_session(self.session_id, candidate, ttl))

    def info(self) -> SessionInfo:
        return self.client.get_session(self.session_id)

    def close(self) -> None:
        self.client.close_session(self.session_id)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _take_parent(self, explicit: int | None) -> int | None:
        parent = explicit if explicit is not None else self._parent
        self._parent = None
        return parent


class AsyncSession:
    def __init__(self, client: AsyncClient, info: SessionInfo) -> None:
        self.client = client
        self.session_id = info.session_id
        self._parent: int | None = None

    async def send(self, prompt: Prompt, *, n: int = 1, parent_candidate: int | None = None, **sampling) -> Completion:  # type: ignore[no-untyped-def]
        parent = self._take_parent(parent_candidate)
        return await self.client.generate(prompt, n=n, session_id=self.session_id, parent_candidate=parent, **sampling)

    async def stream(self, prompt: Prompt, *, n: int = 1, parent_candidate: int | None = None, **sampling) -> AsyncIterator[Delta]:  # type: ignore[no-untyped-def]
        parent = self._take_parent(parent_candidate)
        async for delta in self.client.stream(prompt, n=n, session_id=self.session_id, parent_candidate=parent, **sampling):
            yield delta

    def choose(self, candidate: int) -> None:
        self._parent = candidate

    async def fork(self, candidate: int | None = None, ttl: float | None = None) -> AsyncSession:
        return AsyncSession(self.client, await self.client.fork_session(self.session_id, candidate, ttl))

    async def info(self) -> SessionInfo:
        return await self.client.get_session(self.session_id)

    async def close(self) -> None:
        await self.client.close_session(self.session_id)

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _take_parent(self, explicit: int | None) -> int | None:
        parent = explicit if explicit is not None else self._parent
        self._parent = None
        return parent
