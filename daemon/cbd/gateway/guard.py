"""The gateway's outer defences: request bodies bounded in size and time, headers bounded in time, and
every failure of a route answered in the API's error shape.

`Guard` is an ASGI middleware inside Starlette's error middleware and outside its exception middleware:
it wraps `receive`, so a body over the limit (413) or slower than the body timeout (408) fails the
route's own read, which answers in the API's shape; it turns an exception no handler took into one
`bug:` log line and a 500 in the API's shape, and a client that went away into one info line.

uvicorn bounds a request head's size (h11: 16 KiB, then 400) and the idle time between requests
(`timeout_keep_alive`), but not the time a head takes to arrive: a client sending a byte of headers
every few seconds holds its connection forever. `guarded_protocol` closes a connection whose next
request head has not arrived within the header timeout (from the connection's start, or from the last
response; plus the body timeout while uvicorn drains a body the route did not read).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import h11
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from cbd.gateway.errors import ApiError, bad_request
from cbd.gateway.limits import Limits, too_large

log = logging.getLogger("cbd.gateway")


class Guard:
    def __init__(self, app: ASGIApp, limits: Limits, render: Callable[[str, ApiError], Response]) -> None:
        """render(path, error): the refusal in the error shape of the API that `path` belongs to."""
        self.app = app
        self.limits = limits
        self.render = render

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        where = f"{scope['method']} {scope['path']}"
        declared = _content_length(scope)
        if isinstance(declared, ApiError) or (declared is not None and declared > self.limits.max_body_bytes):
            refusal = declared if isinstance(declared, ApiError) else too_large(self.limits.max_body_bytes, False)
            await self.render(scope["path"], refusal)(scope, receive, send)
            return
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, self._receiving(receive, declared is None), sending)
        except ClientDisconnect:
            log.info("client went away: %s", where)
        except Exception as exc:  # noqa: BLE001 - the one place a route's unexpected failure is answered
            log.error("bug: %s: %s: %s", where, type(exc).__name__, " ".join(str(exc).split())[:300])
            log.debug("bug: %s", where, exc_info=exc)
            if not started:
                bug = ApiError(500, "the gateway failed on this request (logged as a bug)", "server_error",
                               code="internal_error")  # fmt: skip
                await self.render(scope["path"], bug)(scope, receive, send)

    def _receiving(self, receive: Receive, undeclared: bool) -> Receive:
        """`receive`, with the body counted against the size limit and the whole body against the timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.body_timeout
        received = 0
        complete = False

        async def guarded() -> Message:
            nonlocal received, complete
            if complete:  # after the body: only http.disconnect comes, whenever it comes
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                raise ApiError(408, f"the request body did not arrive within {self.limits.body_timeout:g} s",
                               code="request_timeout", headers={"Connection": "close"}) from None  # fmt: skip
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limits.max_body_bytes:
                    raise too_large(self.limits.max_body_bytes, close=undeclared)
                complete = not message.get("more_body", False)
            else:
                complete = True
            return message

        return guarded


def _content_length(scope: Scope) -> int | ApiError | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            text = value.decode("latin-1").strip()
            return int(text) if text.isdigit() else bad_request("Content-Length must be a non-negative integer")
    return None


def guarded_protocol(limits: Limits) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing connections whose request head is late (see the module's docstring)."""

    class GuardedH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm(limits.header_timeout)

        def on_response_complete(self) -> None:
            # Armed first: the base class may parse a pipelined head at once (which disarms the timer).
            draining = self.conn.their_state is h11.SEND_BODY
            self._arm(limits.header_timeout + (limits.body_timeout if draining else 0.0))
            super().on_response_complete()

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request head arrived
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self, seconds: float) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(seconds, self._late)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _late(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                log.info("closed a connection whose request head did not arrive in time: %s", self.client)
                self.transport.close()

    return GuardedH11Protocol
