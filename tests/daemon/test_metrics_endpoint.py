"""The /metrics HTTP endpoint: bounded connections, a request deadline, bearer auth; in-process and through a daemon."""

from __future__ import annotations

import asyncio
import http.client
import socket
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter

from cbd.server.metrics_http import MAX_HEAD_BYTES, MetricsEndpoint
from cbd_client.address import free_port

SCRAPE = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"


async def _until(condition: Callable[[], bool], bound: float = 30.0) -> None:
    deadline = time.monotonic() + bound
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def _exchange(port: int, data: bytes) -> bytes:
    """Send `data`, return everything the server sends until it closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    try:
        return await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()


def test_endpoint_bounds_connections_closes_slow_ones_and_checks_tokens() -> None:
    async def scenario() -> None:
        registry = CollectorRegistry()
        Counter("probe", "A counter.", registry=registry).inc()
        endpoint = MetricsEndpoint(registry, max_connections=2, read_timeout=60, tokens={"default": b"tok"})
        hasty = MetricsEndpoint(registry, max_connections=2, read_timeout=0.2, tokens=None)
        servers = [await endpoint.start("127.0.0.1", 0), await hasty.start("127.0.0.1", 0)]
        port, hasty_port = (s.sockets[0].getsockname()[1] for s in servers)
        try:
            held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
            for _, writer in held:
                writer.write(b"GET /metr")  # half a request line, then nothing
            await _until(lambda: endpoint.num_open == 2)
            assert (await _exchange(port, b"")).startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
            held[0][1].close()  # a caller that goes away gives its slot back
            await _until(lambda: endpoint.num_open == 1)
            authorized = SCRAPE.replace(b"\r\n\r\n", b"\r\nAuthorization: Bearer tok\r\n\r\n")
            reply = await _exchange(port, authorized)
            assert reply.startswith(b"HTTP/1.1 200 OK\r\n") and b"\nprobe_total 1.0\n" in reply
            for request in (SCRAPE, authorized.replace(b"Bearer tok", b"Bearer tok2")):
                reply = await _exchange(port, request)
                assert reply.startswith(b"HTTP/1.1 401 ") and b"WWW-Authenticate: Bearer\r\n" in reply
            assert endpoint.num_open == 1  # the held connection is still held: 60 s have not passed
            assert (await _exchange(hasty_port, b"GET /metr")).startswith(b"HTTP/1.1 408 ")
            for request, status in (
                (b"GET / HTTP/1.1\r\n\r\n", b"404"),
                (b"POST /metrics HTTP/1.1\r\n\r\n", b"405"),
                (b"hello there\r\n\r\n", b"400"),
                (b"GET /metrics HTTP/1.1\r\nX: " + b"y" * MAX_HEAD_BYTES, b"431"),
            ):
                assert (await _exchange(hasty_port, request)).startswith(b"HTTP/1.1 " + status + b" "), request
            assert hasty.num_open == 0
        finally:
            for server in servers:
                server.close()

    asyncio.run(scenario())


def _scrape(port: int, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request("GET", "/metrics", headers=headers or {})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def _read_until_closed(s: socket.socket) -> bytes:
    received = b""
    try:
        while chunk := s.recv(4096):  # the socket's timeout bounds the wait
            received += chunk
    except ConnectionResetError:
        pass
    return received


def test_half_open_connections_are_closed_and_do_not_stop_scrapes(tiny_daemon) -> None:
    port = free_port()
    tiny_daemon("--metrics-port", str(port), "--metrics-read-timeout", "2")
    stalled = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(40)]
    try:
        for s in stalled:
            s.sendall(b"GET /metr")
        deadline = time.monotonic() + 60
        while True:
            try:
                status, body = _scrape(port)
            except (ConnectionError, http.client.HTTPException):  # refused past the bound while they are held
                status, body = 0, b""
            if status == 200:
                break
            assert status in (0, 503) and time.monotonic() < deadline, status
            time.sleep(0.1)
        assert b"cbd_engine_steps_total" in body
        replies = [_read_until_closed(s) for s in stalled]  # every one is closed by the daemon
        assert all(r == b"" or r.startswith((b"HTTP/1.1 408 ", b"HTTP/1.1 503 ")) for r in replies), replies
        assert any(r.startswith(b"HTTP/1.1 408 ") for r in replies)
    finally:
        for s in stalled:
            s.close()


def test_metrics_token_is_required_when_set(tiny_daemon, tmp_path) -> None:
    token_file = tmp_path / "metrics-token"
    token_file.write_text("scrape-secret\n")
    port = free_port()
    tiny_daemon("--metrics-port", str(port), "--metrics-auth-token-file", str(token_file))
    assert _scrape(port)[0] == 401
    assert _scrape(port, {"Authorization": "Bearer scrape-secreT"})[0] == 401
    assert _scrape(port, {"Authorization": "scrape-secret"})[0] == 401
    status, body = _scrape(port, {"Authorization": "Bearer scrape-secret"})
    assert status == 200 and b"cbd_engine_steps_total" in body
    assert _scrape(port, {"Authorization": "bearer scrape-secret"})[0] == 200  # the scheme's case is free
