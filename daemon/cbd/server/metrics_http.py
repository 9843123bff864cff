"""The Prometheus scrape endpoint (GET /metrics): a small HTTP/1.x server on the daemon's event loop.

What a caller can hold is bounded: at most `max_connections` connections are open at once (one more
is answered 503 and closed without being read); a connection has `read_timeout` seconds to deliver
its request head (at most MAX_HEAD_BYTES) and then as long again to take the reply, or it is closed;
one request per connection. With tokens set, a scrape must present `Authorization: Bearer <token>`
(compared in constant time by `auth.token_name`) or gets 401. The exposition is generated on the
loop: the collectors read counters and the engine's last stats snapshot, no I/O.
"""

from __future__ import annotations

import asyncio
from http import HTTPStatus

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from cbd.server.auth import token_name

MAX_HEAD_BYTES = 8192
PATH = "/metrics"


class MetricsEndpoint:
    def __init__(
        self, registry: CollectorRegistry, max_connections: int, read_timeout: float, tokens: dict[str, bytes] | None
    ) -> None:
        self._registry = registry
        self._max_connections = max_connections
        self._read_timeout = read_timeout
        self._tokens = tokens
        self.num_open = 0  # connections being served; only the event loop touches it

    async def start(self, host: str, port: int) -> asyncio.Server:
        return await asyncio.start_server(self._connection, host, port, limit=MAX_HEAD_BYTES)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.num_open >= self._max_connections:
            await self._send(writer, HTTPStatus.SERVICE_UNAVAILABLE, b"too many connections\n")
            return
        self.num_open += 1
        try:
            async with asyncio.timeout(self._read_timeout):
                head = await reader.readuntil(b"\r\n\r\n")
        except TimeoutError:
            await self._send(writer, HTTPStatus.REQUEST_TIMEOUT, b"request not received in time\n")
        except asyncio.LimitOverrunError:
            await self._send(writer, HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, b"request head too large\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.transport.abort()
        else:
            await self._send(writer, *self._respond(head))
        finally:
            self.num_open -= 1

    def _respond(self, head: bytes) -> tuple[HTTPStatus, bytes, dict[str, str]]:
        lines = head.decode("latin-1").split("\r\n")
        request = lines[0].split(" ")
        if len(request) != 3 or not request[2].startswith("HTTP/1."):
            return HTTPStatus.BAD_REQUEST, b"not an HTTP/1.x request\n", {}
        if request[0] != "GET":
            return HTTPStatus.METHOD_NOT_ALLOWED, b"only GET\n", {"Allow": "GET"}
        if request[1].split("?")[0] != PATH:
            return HTTPStatus.NOT_FOUND, f"metrics are at {PATH}\n".encode(), {}
        headers = [
            (name.strip().lower(), value.strip()) for name, _, value in (line.partition(":") for line in lines[1:])
        ]
        if self._tokens is not None and token_name(self._tokens, headers) is None:
            return HTTPStatus.UNAUTHORIZED, b"a valid bearer token is required\n", {"WWW-Authenticate": "Bearer"}
        encoder, content_type = choose_encoder(next((value for name, value in headers if name == "accept"), ""))
        return HTTPStatus.OK, encoder(self._registry), {"Content-Type": content_type}

    async def _send(
        self, writer: asyncio.StreamWriter, status: HTTPStatus, body: bytes, headers: dict[str, str] | None = None
    ) -> None:
        fields = {"Content-Type": "text/plain; charset=utf-8", **(headers or {})}
        fields.update({"Content-Length": str(len(body)), "Connection": "close"})
        head = f"HTTP/1.1 {status.value} {status.phrase}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in fields.items())
        writer.write(head.encode("latin-1") + b"\r\n" + body)
        try:
            async with asyncio.timeout(self._read_timeout):  # a caller that does not read is not waited for
                await writer.drain()
                writer.close()
                await writer.wait_closed()
        except (TimeoutError, ConnectionError):
            writer.transport.abort()
