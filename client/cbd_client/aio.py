"""asyncio client: the same API as Client, with coroutines and async iterators.

from cbd_client import AsyncClient
async with AsyncClient() as client:
    result = await client.generate([{"role": "user", "content": "Hi"}], n=4, seed=1)
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from cbd_client import _convert, readiness
from cbd_client._convert import Prompt
from cbd_client.address import default_address, tls_credentials
from cbd_client.errors import CbdError
from cbd_client.routing import Routes
from cbd_client.session import AsyncSession
from cbd_client.types import Completion, Delta, ModelInfo, SessionInfo, Stats
from cbd_client.v1 import cbd_pb2 as pb
from cbd_client.v1.cbd_pb2_grpc import CbdStub


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
        builder = _convert.CompletionBuilder(n)
        request = _convert.generate_request(prompt, n, options)
        key = request.session_id or options.get("affinity")
        call = self._stub.Generate(
            request, timeout=timeout or self.timeout, metadata=_convert.with_affinity(self._metadata, key, self._routes)
        )
        try:
            async for response in call:
                builder.add(response)
        except grpc.RpcError as e:
            raise CbdError.from_rpc(e) from None
        finally:
            await self._learn(key, call)
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
        request = _convert.generate_request(prompt, n, options)
        key = request.session_id or options.get("affinity")
        call = self._stub.Generate(
            request, timeout=timeout or self.timeout, metadata=_convert.with_affinity(self._metadata, key, self._routes)
        )
        try:
            async for response in call:
                for delta in _convert.deltas(response):
                    yield delta
        except grpc.RpcError as e:
            raise CbdError.from_rpc(e) from None
        finally:
            call.cancel()
            await self._learn(key, call)

    async def tokenize(self, prompt: str | list[dict[str, str]], allow_special_tokens: bool = False) -> list[int]:
        request = pb.TokenizeRequest(allow_special_tokens=allow_special_tokens)
        _convert.set_prompt(request, prompt)
        return list((await self._call(self._stub.Tokenize, request)).token_ids)

    async def model_info(self) -> ModelInfo:
        return _convert.model_info(await self._call(self._stub.GetModelInfo, pb.GetModelInfoRequest()))

    async def stats(self) -> Stats:
        return _convert.stats(await self._call(self._stub.GetStats, pb.GetStatsRequest()))

    async def session(
        self, prefix: Prompt | None = None, ttl: float | None = None, session_id: str | None = None,
        recover: bool = False, *, expected_idle_ms: int | None = None, retention: str | None = None,
        priority: str | None = None,
    ) -> AsyncSession:  # fmt: skip
        """As Client.session."""
        sid = session_id or _convert.new_session_id()
        request = _convert.open_session_request(prefix, ttl, sid, expected_idle_ms, retention, priority)
        info = _convert.session_info(await self._call(self._stub.OpenSession, request, sid))
        return AsyncSession(self, info, prefix, ttl, recover)

    async def get_session(self, session_id: str, tenant: str = "") -> SessionInfo:
        """As Client.get_session."""
        request = pb.GetSessionRequest(session_id=session_id, tenant=tenant)
        return _convert.session_info(await self._call(self._stub.GetSession, request, session_id))

    async def list_sessions(self, all_tenants: bool = False) -> list[SessionInfo]:
        """As Client.list_sessions."""
        reply = await self._call(self._stub.ListSessions, pb.ListSessionsRequest(all_tenants=all_tenants))
        return [_convert.session_info(s) for s in reply.sessions]

    async def fork_session(
        self, session_id: str, candidate: int | None = None, ttl: float | None = None, new_session_id: str | None = None
    ) -> SessionInfo:
        """As Client.fork_session."""
        request = pb.ForkSessionRequest(session_id=session_id, ttl_seconds=ttl or 0.0,
                                        new_session_id=new_session_id or _convert.fork_session_id(session_id))  # fmt: skip
        if candidate is not None:
            request.candidate = candidate
        return _convert.session_info(await self._call(self._stub.ForkSession, request, session_id))

    async def close_session(self, session_id: str, tenant: str = "") -> None:
        """As Client.close_session."""
        request = pb.CloseSessionRequest(session_id=session_id, tenant=tenant)
        await self._call(self._stub.CloseSession, request, session_id)

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

    async def _call(self, method, request, session_id: str | None = None):
        call = method(
            request, timeout=self.timeout, metadata=_convert.with_affinity(self._metadata, session_id, self._routes)
        )
        try:
            return await call
        except grpc.RpcError as e:
            raise CbdError.from_rpc(e) from None
        finally:
            await self._learn(session_id, call)

    async def _learn(self, key: str | None, call: Any) -> None:
        """Remember the replica a proxy named in the call's response headers for its affinity key."""
        if key:
            try:  # an error answer has no headers of its own: the proxy's header comes with the trailers then
                metadata = [*((await call.initial_metadata()) or ()), *((await call.trailing_metadata()) or ())]
            except (grpc.RpcError, asyncio.CancelledError):
                return
            self._routes.learn(_convert.affinity_key(key), metadata)
