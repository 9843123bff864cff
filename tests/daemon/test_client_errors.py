"""What a caller sees when something is wrong: no daemon (fail at once, say where and what to do), a daemon
still loading (wait, say so), input the contract cannot carry (CbdError INVALID_ARGUMENT, never a raw
Python exception), and a command line that prints one line instead of a traceback."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cbd_client import AsyncClient, CbdError, Client, readiness
from daemon_process import DaemonFactory, DaemonProcess

CLIENT = [sys.executable, "-m", "cbd_client.cli"]


def run_client(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLIENT, *args], capture_output=True, text=True, timeout=timeout)


def test_no_socket_fails_at_once_naming_the_address(tmp_path) -> None:
    address = f"unix:{tmp_path / 'none.sock'}"
    # At once: the command's bound (60 s) is below the 120 s it would wait for a loading daemon, and it never
    # says it waits.
    proc = run_client("--address", address, "hi")
    assert proc.returncode == 1 and proc.stdout == "" and "waiting" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and address in proc.stderr and "cbd serve" in proc.stderr, proc.stderr
    said: list[str] = []
    with pytest.raises(CbdError) as info, Client(address) as client:
        client.wait_ready(120, on_wait=said.append)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE and said == []  # failed, never waited


def test_refused_connection_fails_at_once(tmp_path) -> None:
    path = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))  # the file exists, nothing listens
    said: list[str] = []
    with pytest.raises(CbdError) as info, Client(f"unix:{path}") as client:
        client.wait_ready(120, on_wait=said.append)
    assert said == []  # at once: the first refused connection ends the wait (a wait would have been announced)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE and "no cbd daemon answers" in info.value.details

    async def wait_async() -> None:
        async with AsyncClient(f"unix:{path}") as client:
            await client.wait_ready(120)

    with pytest.raises(CbdError, match="no cbd daemon answers"):
        asyncio.run(wait_async())


class TickingClock:
    """Stands in for the `time` module inside cbd_client.readiness only: each reading is one poll later."""

    def __init__(self) -> None:
        self.start = self.now = 1000.0

    def monotonic(self) -> float:
        self.now += readiness.POLL_SECONDS
        return self.now


class CountingHealth(health.HealthServicer):
    def __init__(self) -> None:
        super().__init__()
        self.checks = 0

    def Check(self, request, context):  # noqa: N802 - the gRPC method's name
        self.checks += 1
        return super().Check(request, context)


def test_a_loading_daemon_is_waited_for_and_the_wait_is_announced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A daemon listens before it has loaded its model and answers health NOT_SERVING meanwhile.
    server = grpc.server(futures.ThreadPoolExecutor(2))
    servicer = CountingHealth()
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    address = f"unix:{tmp_path / 'loading.sock'}"
    server.add_insecure_port(address)
    server.start()
    clock = TickingClock()
    monkeypatch.setattr(readiness, "time", clock)
    try:
        said: list[str] = []
        with pytest.raises(CbdError) as info, Client(address) as client:
            client.wait_ready(1.5, on_wait=said.append)
        assert clock.now - clock.start >= 1.5 and servicer.checks >= 2  # it waited its whole timeout, polling
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and "still not ready" in info.value.details
        assert len(said) == 1 and address in said[0] and "loading" in said[0]
    finally:
        server.stop(None)


@pytest.mark.parametrize(
    "prompt, kwargs, match",
    [
        ("hi", {"n": 0}, "n must be an integer >= 1"),
        ("hi", {"max_tokens": -1}, "max_tokens must be a non-negative integer"),
        ("hi", {"top_k": -5}, "top_k must be a non-negative integer"),
        ("hi", {"seed": -1}, "seed must be a non-negative integer"),
        ("hi", {"temperature": "hot"}, "temperature has the wrong type"),
        ("hi", {"parent_candidate": -1}, "parent_candidate must be a non-negative integer"),
        ([{"content": "no role"}], {}, "chat message 0 needs a string 'role'"),
        ([1, -2, 3], {}, "token ids must be non-negative"),
        (3.5, {}, "prompt must be"),
    ],
)
def test_bad_input_is_cbd_error_invalid_argument_before_any_call(tmp_path, prompt, kwargs, match) -> None:
    with Client(f"unix:{tmp_path / 'unused.sock'}") as client:  # refused before anything is sent
        with pytest.raises(CbdError, match=match) as info:
            client.generate(prompt, **kwargs)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(CbdError, match=match):
            list(client.stream(prompt, **kwargs))


def test_a_single_stop_string_is_one_string_not_its_characters(tmp_path) -> None:
    from cbd_client import calls

    assert list(calls.generate_request("hi", 1, {"stop": "\n\n"}).sampling.stop) == ["\n\n"]


def test_cli_prints_one_line_for_daemon_refusals_and_answers_on_stdout(shared_tiny_daemon: DaemonProcess) -> None:
    address = shared_tiny_daemon.address
    for args, needle in (
        (["--max-tokens", "-1", "hi"], "max_tokens must be a non-negative integer"),
        (["--stop", "", "--raw", "hi"], "stop strings must not be empty"),
        (["--raw", "-n", "100", "hi"], "INVALID_ARGUMENT"),
        (["-n", "0", "hi"], "n must be at least 1, got 0"),
    ):
        proc = run_client("--address", address, *args)
        assert proc.returncode == 1 and proc.stdout == "", (args, proc.stdout, proc.stderr)
        assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1 and needle in proc.stderr, proc.stderr
    ok = run_client("--address", address, "stats")  # the answer alone on stdout, nothing on stderr
    assert ok.returncode == 0 and '"uptime_seconds"' in ok.stdout and ok.stderr == "", ok.stderr


def test_threads_setting_is_used_and_logged(tiny_daemon: DaemonFactory) -> None:
    d = tiny_daemon("--num-threads", "1")
    assert "1 intra-op threads" in d.log()


class _Refusal(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def test_a_proxy_without_a_healthy_replica_is_waited_for_not_reported_missing() -> None:
    from cbd_client.readiness import Waiter

    said: list[str] = []
    waiter = Waiter("127.0.0.1:50051", 60, said.append)
    envoy = _Refusal(grpc.StatusCode.UNAVAILABLE, "upstream connect error or disconnect/reset before headers")
    assert waiter.ready(envoy) is False  # a proxy answers, its replicas are loading: wait
    assert said and "no healthy replica behind the proxy" in said[0] and "cbd serve" not in said[0]
    assert waiter.ready(b"\x08\x01") is True  # SERVING once one replica is up
    with pytest.raises(CbdError, match="start one with"):  # nothing there at all: fail at once, say what to do
        Waiter("127.0.0.1:50051", 60, None).ready(_Refusal(grpc.StatusCode.UNAVAILABLE, "failed to connect"))
