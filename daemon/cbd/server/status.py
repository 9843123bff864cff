"""The one place where errors become gRPC status codes."""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from cbd.errors import (
    CapacityExceeded,
    CbdError,
    EngineFailure,
    EngineStopped,
    HistoryMismatch,
    InvalidRequest,
    PermissionDenied,
    SessionBusy,
    SessionExists,
    UnknownRequest,
    UnknownSession,
)
from cbd_client.contract import RETRY_PUSHBACK_HEADER

log = logging.getLogger(__name__)
T = TypeVar("T")

_CODES: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (CapacityExceeded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (EngineStopped, grpc.StatusCode.UNAVAILABLE),
    (UnknownRequest, grpc.StatusCode.NOT_FOUND),
    (UnknownSession, grpc.StatusCode.NOT_FOUND),
    (SessionBusy, grpc.StatusCode.FAILED_PRECONDITION),
    (HistoryMismatch, grpc.StatusCode.ABORTED),
    (SessionExists, grpc.StatusCode.ALREADY_EXISTS),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (EngineFailure, grpc.StatusCode.INTERNAL),
]


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return code, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


async def abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    """End the call with `exc`'s status (raises grpc.aio.AbortError)."""
    code, message = status_of(exc)
    if not isinstance(exc, CbdError):
        log.exception("unexpected error in a handler", exc_info=exc)
    trailers: tuple[tuple[str, str], ...] = ()
    if isinstance(exc, CapacityExceeded) and exc.retry_after is not None:
        trailers = ((RETRY_PUSHBACK_HEADER, str(max(1, round(exc.retry_after * 1000)))),)
    await context.abort(code, message, trailing_metadata=trailers)


def unary(handler: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    @functools.wraps(handler)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> T:
        try:
            return await handler(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await abort(context, exc)
            raise  # unreachable: abort raises

    return wrapper


def streaming(handler: Callable[..., AsyncIterator[T]]) -> Callable[..., AsyncIterator[T]]:
    @functools.wraps(handler)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[T]:
        try:
            async for item in handler(self, request, context):
                yield item
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await abort(context, exc)

    return wrapper
