"""Optional bearer-token authentication: a server interceptor on every RPC except health.

The token is read from a file (so it never appears on a command line or in logs) and compared in
constant time. Clients send it as `authorization: Bearer <token>` metadata (`Client(token=...)`).
"""

from __future__ import annotations

import hmac
from pathlib import Path

import grpc

_EXEMPT = ("/grpc.health.v1.Health/",)


def read_token(path: str) -> bytes:
    token = Path(path).read_text().strip()
    if not token:
        raise ValueError(f"auth_token_file {path} is empty")
    return token.encode()


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: bytes) -> None:
        self._expected = b"Bearer " + token

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(_EXEMPT):
            return await continuation(handler_call_details)
        presented = b""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                presented = value.encode() if isinstance(value, str) else value
        if hmac.compare_digest(presented, self._expected):
            return await continuation(handler_call_details)
        return _deny(method)


def _deny(method: str) -> grpc.RpcMethodHandler:
    async def abort_unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "a valid bearer token is required")

    async def abort_stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "a valid bearer token is required")
        yield  # pragma: no cover - makes this an async generator

    if method.endswith("/Generate"):
        return grpc.unary_stream_rpc_method_handler(abort_stream)
    return grpc.unary_unary_rpc_method_handler(abort_unary)
