"""asyncio client: the same API as Client, with coroutines and async iterators.

from cbd_client import AsyncClient
async with AsyncClient() as client:
    result = await client.generate([{"role": "user", "content": "Hi"}], n=4, seed=1)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, TypeVar

import grpc

from cbd_client import calls, readiness, replies
from cbd_client.address import default_address, tls_credentials
from cbd_client.errors import CbdError
from cbd_client.routing import Routes, affinity_key, with_affinity
from cbd_client.session import AsyncSession
from cbd_client.types import Completion, Delta, ModelInfo, Prompt, SessionInfo, Stats
from cbd_client.v1 import cbd_pb2 as pb
from cbd_client.v1.cbd_pb2_grpc import CbdStub

R = TypeVar("R")


class AsyncClient:
    def __init__(
        self,
        address: str | None = None,
        timeout: float | None = None,
        token: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
    ) -> None:
        """token: the daemon's bearer token (auth_token_file). tls_ca: PEM file of the CA that signed the
        daemon's certificate (TCP with TLS); tls_cert / tls_key: this client's certificate (mutual TLS)."""
        self.address = address or default_address()
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._routes = Routes()  # the replica a proxy chose per affinity key (routing.py)
        self.timeout = timeout
        if tls_ca:
            self._channel = grpc.aio.secure_channel(self.address, tls_credentials(tls_ca, tls_cert, tls_key))
        else:
            self._channel = grpc.aio.insecure_channel(self.address)
        self._stub = CbdStub(self._channel)

    async def generate(
        self,
        prompt: Prompt,
        *,
        n: int = 1,
        timeout: float | None = None,
        **options: Any,
    ) -> Completion:
        """As Client.generate."""
        builder = replies.CompletionBuilder(n)
        async with contextlib.aclosing(self._responses(calls.generate(prompt, n, options), timeout)) as responses:
            async for response in responses:
                builder.add(response)
        return builder.result()

    async def stream(
        self,
        prompt: Prompt,
        *,
        n: int = 1,
        timeout: float | None = None,
        **options: Any,
    ) -> AsyncIterator[Delta]:
        """Yield deltas as they arrive; closing the iterator early cancels the request on the daemon."""
        async with contextlib.aclosing(self._responses(calls.generate(prompt, n, options), timeout)) as responses:
            async for response in responses:
                for delta in replies.deltas(response):
                    yield delta

    async def tokenize(self, prompt: str | list[dict[str, str]], allow_special_tokens: bool = False) -> list[int]:
        """As Client.tokenize."""
        return await self._run(calls.tokenize(prompt, allow_special_tokens))

    async def model_info(self) -> ModelInfo:
        return await self._run(calls.model_info())

    async def stats(self) -> Stats:
        return await self._run(calls.stats())

    async def session(
        self, prefix: Prompt | None = None, ttl: float | None = None, session_id: str | None = None,
        recover: bool = False, *, expected_idle_ms: int | None = None, retention: str | None = None,
        priority: str | None = None,
    ) -> AsyncSession:  # fmt: skip
        """As Client.session."""
        info = await self._run(calls.open_session(prefix, ttl, session_id, expected_idle_ms, retention, priority))
        return AsyncSession(self, info, prefix, ttl, recover)

    async def get_session(self, session_id: str, tenant: str = "") -> SessionInfo:
        """As Client.get_session."""
        return await self._run(calls.get_session(session_id, tenant))

    async def list_sessions(self, all_tenants: bool = False) -> list[SessionInfo]:
        """As Client.list_sessions."""
        return await self._run(calls.list_sessions(all_tenants))

    async def fork_session(
        self, session_id: str, candidate: int | None = None, ttl: float | None = None, new_session_id: str | None = None
    ) -> SessionInfo:
        """As Client.fork_session."""
        return await self._run(calls.fork_session(session_id, candidate, ttl, new_session_id))

    async def close_session(self, session_id: str, tenant: str = "") -> None:
        """As Client.close_session."""
        await self._run(calls.close_session(session_id, tenant))

    async def wait_ready(self, timeout: float = 120.0, on_wait: Callable[[str], None] | None = None) -> ModelInfo:
        """As Client.wait_ready: fail at once where no daemon listens, wait while one is loading."""
        waiter = readiness.Waiter(self.address, timeout, on_wait)
        check = self._channel.unary_unary(readiness.HEALTH_CHECK)
        while True:
            try:
                outcome: bytes | grpc.RpcError = await check(readiness.HEALTH_REQUEST, timeout=readiness.CHECK_TIMEOUT)
            except grpc.RpcError as e:
                outcome = e
            if waiter.ready(outcome):
                return await self.model_info()
            await asyncio.sleep(readiness.POLL_SECONDS)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _run(self, call: calls.Unary[R]) -> R:
        metadata = with_affinity(self._metadata, call.key, self._routes)
        rpc = getattr(self._stub, call.method)(call.request, timeout=self.timeout, metadata=metadata)
        try:
            response = await rpc
        except grpc.RpcError as e:
            raise CbdError.from_rpc(e) from None
        finally:
            await self._learn(call.key, rpc)
        return call.result(response)

    async def _responses(
        self, call: calls.Generate, timeout: float | None
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """The call's responses; closing the iterator early cancels the call on the daemon."""
        rpc = self._stub.Generate(
            call.request, timeout=timeout or self.timeout,
            metadata=with_affinity(self._metadata, call.key, self._routes),
        )  # fmt: skip
        try:
            async for response in rpc:
                yield response
        except grpc.RpcError as e:
            raise CbdError.from_rpc(e) from None
        finally:
            rpc.cancel()  # a no-op once the stream has ended
            await self._learn(call.key, rpc)

    async def _learn(self, key: str | None, call: Any) -> None:
        """Remember the replica a proxy named in the call's response headers for its affinity key."""
        if key:
            try:  # an error answer has no headers of its own: the proxy's header comes with the trailers then
                metadata = [*((await call.initial_metadata()) or ()), *((await call.trailing_metadata()) or ())]
            except (grpc.RpcError, asyncio.CancelledError):
                return
            self._routes.learn(affinity_key(key), metadata)
