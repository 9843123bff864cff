"""Reading a daemon's Generate stream while an HTTP client waits: shared by every API route.

A call is read one way only (with `read()`): `first` takes the message that says the daemon accepted
it, `rest` the ones after. `unless_gone` awaits work unless the HTTP client disconnects first.
`settled_when_dropped` runs a streamed reply's clean-up also when the server never starts its body;
`noting_gone` logs a client that goes away while its reply streams.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import grpc
from starlette.requests import Request

from cbd.gateway.errors import ApiError
from cbd_client.v1 import cbd_pb2 as pb

log = logging.getLogger("cbd.gateway")


class ClientGone(ApiError):
    def __init__(self) -> None:
        super().__init__(499, "the client closed the connection", "cancelled")


async def first(stream: Any) -> pb.GenerateResponse:
    """The stream's first message (the daemon took the call); EOF before it is the daemon's fault."""
    response = await stream.read()
    if response is grpc.aio.EOF:
        raise ApiError(500, "the daemon ended the reply without a message", "server_error")
    return response


async def rest(stream: Any) -> AsyncIterator[pb.GenerateResponse]:
    """The responses after the first."""
    while True:
        response = await stream.read()
        if response is grpc.aio.EOF:
            return
        yield response


async def unless_gone(request: Request, work: Any) -> Any:
    """Await `work` unless the HTTP client disconnects first (then it is cancelled: so are its gRPC calls).

    The body has been read, so the next ASGI message is http.disconnect, whenever the client goes: one
    blocking receive waits for it. (Polling request.is_disconnected() instead receives with a cancelled
    scope every half second: a message that arrives in that window is consumed and lost, and any message
    but http.disconnect is taken for "still here" only by luck of timing.)"""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        log.info("client went away before the reply: %s %s", request.method, request.url.path)
        raise ClientGone()
    finally:
        for future in (task, gone):
            future.cancel()
            future.add_done_callback(_retrieved)  # its CancelledError is expected: not "never retrieved" noise


def _retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def settled_when_dropped(
    events: AsyncGenerator[bytes, None], settle: Callable[[], object]
) -> AsyncGenerator[bytes, None]:
    """`events`, whose `settle` (idempotent) also runs when the generator is dropped: a client gone before
    the response started means its body is never iterated, so its own `finally` never runs."""
    weakref.finalize(events, settle)
    return events


async def noting_gone(events: AsyncGenerator[bytes, None], request: Request) -> AsyncGenerator[bytes, None]:
    """`events`, as a streamed reply's body: a client that goes away before its end (the server cancels the
    body, or closes it unfinished) is logged in one info line, and `events` is closed at once (its own
    clean-up cancels the daemon's calls now, not when it is collected)."""
    gone = False
    try:
        async for chunk in events:
            yield chunk
    except (asyncio.CancelledError, GeneratorExit):
        gone = True
        raise
    finally:
        if gone:
            log.info("client went away mid-stream: %s %s", request.method, request.url.path)
        await events.aclose()
