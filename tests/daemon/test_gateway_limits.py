"""The gateway fails safely against a real daemon (embedded model) and a real `cbd openai` process with
small limits: session names scoped by token, bodies bounded in size and time, headers bounded in time,
the daemon's message-size refusal as 413, oversized fan-outs refused up front, quiet disconnects."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from cbd_client import Client
from daemon_process import DaemonProcess
from gateway_process import GatewayProcess

pytestmark = pytest.mark.slow
BODY_LIMIT = 256 << 10
LIMITS = ("--max-body-bytes", str(BODY_LIMIT), "--body-timeout", "2", "--header-timeout", "2", "--max-prompts", "8")
RSS_GROWTH_BOUND = 64 << 20  # what 100 MB sent at the gateway may add to its memory (it holds at most one body)
GENEROUS = 30.0  # seconds: a bound on "was cut", far above the 2 s timeouts


class Stack:
    def __init__(self, daemon: DaemonProcess, gateway: GatewayProcess, token: str | None = None) -> None:
        self.daemon, self.gateway, self.token = daemon, gateway, token

    def chat(self, token: str, messages: list[dict], session: str) -> dict:
        headers = {"Authorization": f"Bearer {token}", "X-Cbd-Session": session}
        body = {"model": "m", "messages": messages, "max_tokens": 4, "temperature": 0}
        response = httpx.post(f"{self.gateway.base}/v1/chat/completions", json=body, headers=headers, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()

    def sessions(self, token: str | None) -> dict[str, int]:
        with Client(self.daemon.address, timeout=30, token=token) as c:
            return {s.session_id: s.num_tokens for s in c.list_sessions()}

    def stats(self):
        with Client(self.daemon.address, timeout=30, token=self.token) as c:
            return c.stats()


def _start(tmp, *daemon_flags: str, token: str | None = None) -> Stack:
    daemon = DaemonProcess(tmp / "cbd.sock", *daemon_flags)
    gateway = GatewayProcess(daemon.address, tmp / "gateway.log", *LIMITS)
    daemon.wait_serving()
    gateway.wait_serving()
    return Stack(daemon, gateway, token)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    # No auth: the daemon ignores tokens, so only the gateway can keep two callers' session names apart.
    s = _start(tmp_path_factory.mktemp("gwlimits"), "--max-message-bytes", "32768")
    try:
        yield s
    finally:
        s.gateway.stop()
        assert s.daemon.stop() == 0, s.daemon.log()


def _two_callers_share_a_name(stack: Stack, alice: str, bob: str) -> None:
    name = "shared-name"
    first = [{"role": "user", "content": "Name a fruit."}]
    before = set(stack.sessions(alice)) | set(stack.sessions(bob))
    reply = stack.chat(alice, first, name)["choices"][0]["message"]
    (alice_session,) = set(stack.sessions(alice)) - before
    tokens = stack.sessions(alice)[alice_session]
    stack.chat(bob, [{"role": "user", "content": "Name a colour."}], name)
    (bob_session,) = set(stack.sessions(bob)) - before - {alice_session}
    assert alice_session in stack.sessions(alice)  # bob's call under the same name did not close alice's session
    stack.chat(alice, [*first, {"role": "assistant", "content": reply["content"]},
                       {"role": "user", "content": "Another one?"}], name)  # fmt: skip
    after = stack.sessions(alice)
    # alice's second turn continued her session (it grew) instead of opening a fresh one
    assert set(after) - before - {bob_session} == {alice_session} and after[alice_session] > tokens, after
    assert bob_session in stack.sessions(bob)


def test_two_tokens_using_one_session_name_get_separate_sessions(stack) -> None:
    _two_callers_share_a_name(stack, "tok-alice", "tok-bob")


def test_two_tenants_using_one_session_name_get_separate_sessions(tmp_path) -> None:
    (tmp_path / "tokens").write_text("alice tok-alice\nbob tok-bob\n")
    s = _start(tmp_path, "--auth-token-file", str(tmp_path / "tokens"), token="tok-alice")
    try:
        _two_callers_share_a_name(s, "tok-alice", "tok-bob")
    finally:
        s.gateway.stop()
        assert s.daemon.stop() == 0, s.daemon.log()


def _raw(stack: Stack) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", stack.gateway.port), timeout=GENEROUS)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    """What the gateway answers until it closes the connection (raises socket.timeout past GENEROUS)."""
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


def test_a_body_over_the_limit_is_413_and_the_gateway_memory_stays_bounded(stack) -> None:
    declared = httpx.post(f"{stack.gateway.base}/v1/chat/completions", content=b"{" + b" " * (BODY_LIMIT + 10) + b"}")
    assert declared.status_code == 413 and declared.json()["error"]["code"] == "request_too_large"
    rss_before = stack.gateway.rss_bytes()
    sock = _raw(stack)  # 100 MB streamed (chunked, no declared length): counted as it arrives
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
    chunk = b"%x\r\n%s\r\n" % (1 << 20, b" " * (1 << 20))
    sent = 0
    try:
        for _ in range(100):
            sock.sendall(chunk)
            sent += 1
    except OSError:
        pass  # the gateway answered 413 and closed: the rest need not be sent
    answer = _read_all(sock)
    sock.close()
    assert answer == b"" or answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert stack.gateway.rss_bytes() - rss_before < RSS_GROWTH_BOUND
    assert httpx.get(f"{stack.gateway.base}/health", timeout=10).status_code == 200


def test_a_body_sent_slowly_is_cut_after_the_body_timeout(stack) -> None:
    sock = _raw(stack)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
    stop = threading.Event()

    def drip() -> None:  # a byte every half second: 500 s for the whole body
        while not stop.wait(0.5):
            try:
                sock.sendall(b" ")
            except OSError:
                return

    dripper = threading.Thread(target=drip)
    dripper.start()
    try:
        answer = _read_all(sock)  # ends when the gateway closes the connection (socket.timeout: it never did)
    finally:
        stop.set()
        dripper.join()
        sock.close()
    assert answer == b"" or answer.startswith(b"HTTP/1.1 408"), answer[:200]
    if answer:
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"


def test_headers_sent_slowly_are_cut_after_the_header_timeout(stack) -> None:
    sock = _raw(stack)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\n")
    stop = threading.Event()

    def drip() -> None:
        while not stop.wait(0.5):
            try:
                sock.sendall(b"X")  # one long header line, never finished
            except OSError:
                return

    dripper = threading.Thread(target=drip)
    dripper.start()
    try:
        assert _read_all(sock) == b""  # closed without an answer
    finally:
        stop.set()
        dripper.join()
        sock.close()
    # an idle connection that never sends anything is closed too
    with _raw(stack) as idle:
        assert _read_all(idle) == b""


def test_the_daemons_message_size_refusal_is_413_and_not_retried(stack) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 40_000}], "max_tokens": 2}
    response = httpx.post(f"{stack.gateway.base}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 413 and "retry-after" not in response.headers, response.text
    assert "larger than max" in response.json()["error"]["message"]


def test_too_many_prompts_are_refused_up_front(stack) -> None:
    body = {"model": "m", "prompt": ["Hello"] * 5000, "max_tokens": 2}
    response = httpx.post(f"{stack.gateway.base}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt", response.text
    assert "at most 8 prompts" in response.json()["error"]["message"]
    assert stack.stats().live_requests == 0


def test_a_client_that_goes_away_is_one_info_line(stack) -> None:
    before = stack.gateway.log()
    with _raw(stack) as sock:  # gone while its body is arriving
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        time.sleep(0.2)
    body = {"model": "m", "messages": [{"role": "user", "content": "Count to one thousand."}], "max_tokens": 500,
            "ignore_eos": True}  # fmt: skip
    with stack.daemon.engine_paused(), pytest.raises(httpx.ReadTimeout):  # gone while its reply is being made
        httpx.post(f"{stack.gateway.base}/v1/chat/completions", json=body, timeout=1.5)
    streamed = {**body, "stream": True}
    with httpx.stream("POST", f"{stack.gateway.base}/v1/chat/completions", json=streamed, timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")  # gone while its reply streams: after the first chunk
    deadline = time.monotonic() + GENEROUS
    while (log := stack.gateway.log()[len(before) :]).count("client went away") < 3:
        assert time.monotonic() < deadline, log
        time.sleep(0.1)
    assert log.count("client went away mid-stream: POST /v1/chat/completions") == 1, log
    assert "Traceback" not in log and "ClientDisconnect" not in log, log
    while (s := stack.stats()).live_requests:
        assert time.monotonic() < deadline, s
        time.sleep(0.1)
