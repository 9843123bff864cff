"""Optional bearer-token authentication: a server interceptor on every RPC except health.

The tokens are read from a file (so they never appear on a command line or in logs) and compared in
constant time. The file holds one token, or several lines of `NAME TOKEN` (blank lines and lines
starting with '#' are skipped); a bare token is named "default". A token's name is the caller's
tenant for fair scheduling (it wins over the request's own `tenant` field). Clients send the token
as `authorization: Bearer <token>` metadata (`Client(token=...)`).
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Sequence
from pathlib import Path

import grpc

_EXEMPT = ("/grpc.health.v1.Health/",)
_NAME = re.compile(r"[A-Za-z0-9._~-]{1,128}")


def read_tokens(path: str, setting: str = "auth_token_file") -> dict[str, bytes]:
    """name -> token from an auth token file (ValueError naming the setting and file if it is malformed)."""
    lines = [line.strip() for line in Path(path).read_text().splitlines()]
    lines = [line for line in lines if line and not line.startswith("#")]
    if not lines:
        raise ValueError(f"{setting} {path} is empty")
    if len(lines) == 1 and len(lines[0].split()) == 1:
        return {"default": lines[0].encode()}
    tokens: dict[str, bytes] = {}
    for number, line in enumerate(lines, 1):
        parts = line.split()
        if len(parts) != 2 or not _NAME.fullmatch(parts[0]):
            raise ValueError(f"{setting} {path}: entry {number} is not `NAME TOKEN` (NAME: letters, digits, ._~-)")
        if parts[0] in tokens:
            raise ValueError(f"{setting} {path}: the name {parts[0]!r} appears twice")
        tokens[parts[0]] = parts[1].encode()
    return tokens


def token_name(tokens: dict[str, bytes], metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    """The name of the token a call presents (None: none of them)."""
    presented = b""
    for key, value in metadata or ():
        if key == "authorization":
            presented = value.encode() if isinstance(value, str) else value
    scheme, _, credential = presented.partition(b" ")
    if scheme.lower() != b"bearer":  # the scheme is case-insensitive (RFC 9110), the token is not
        credential = b""
    found = None
    for name, token in tokens.items():  # every entry is compared: the time does not say which matched
        if hmac.compare_digest(credential, token) and credential:
            found = name
    return found


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, tokens: dict[str, bytes]) -> None:
        self._tokens = tokens

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(_EXEMPT):
            return await continuation(handler_call_details)
        if token_name(self._tokens, handler_call_details.invocation_metadata) is not None:
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
