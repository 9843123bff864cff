"""What a caller sees when something is wrong: no daemon (fail at once, say where and what to do), a daemon
still loading (wait, say so), input the contract cannot carry (CbdError INVALID_ARGUMENT, never a raw
Python exception), and a command line that prints one line instead of a traceback."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cbd_client import AsyncClient, CbdError, Client
from daemon_process import DaemonProcess

CLIENT = [sys.executable, "-m", "cbd_client.cli"]


def run_client(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLIENT, *args], capture_output=True, text=True, timeout=timeout)


def test_no_socket_fails_at_once_naming_the_address(tmp_path) -> None:  # type: ignore[no-untyped-def]
    address = f"unix:{tmp_path / 'none.sock'}"
    started = time.monotonic()
    proc = run_client("--address", address, "hi")
    assert time.monotonic() - started < 20  # the interpreter's start-up, not a 120 s wait
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and address in proc.stderr and "cbd serve" in proc.stderr, proc.stderr
    with pytest.raises(CbdError) as info, Client(address) as client:
        client.wait_ready(120)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE


def test_refused_connection_fails_at_once(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))  # the file exists, nothing listens
    started = time.monotonic()
    with pytest.raises(CbdError) as info, Client(f"unix:{path}") as client:
        client.wait_ready(120)
    assert time.monotonic() - started < 10
    assert info.value.code == grpc.StatusCode.UNAVAILABLE and "no cbd daemon answers" in info.value.details

    async def wait_async() -> None:
        async with AsyncClient(f"unix:{path}") as client:
            await client.wait_ready(120)

    with pytest.raises(CbdError, match="no cbd daemon answers"):
        asyncio.run(wait_async())


def test_a_loading_daemon_is_waited_for_and_the_wait_is_announced(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # A daemon listens before it has loaded its model and answers health NOT_SERVING meanwhile.
    server = grpc.server(futures.ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    address = f"unix:{tmp_path / 'loading.sock'}"
    server.add_insecure_port(address)
    server.start()
    try:
        said: list[str] = []
        started = time.monotonic()
        with pytest.raises(CbdError) as info, Client(address) as client:
            client.wait_ready(1.5, on_wait=said.append)
        assert time.monotonic() - started >= 1.5
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
def test_bad_input_is_cbd_error_invalid_argument_before_any_call(tmp_path, prompt, kwargs, match) -> None:  # type: ignore[no-untyped-def]
    with Client(f"unix:{tmp_path / 'unused.sock'}") as client:  # refused before anything is sent
        with pytest.raises(CbdError, match=match) as info:
            client.generate(prompt, **kwargs)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(CbdError, match=match):
            list(client.stream(prompt, **kwargs))


def test_a_single_stop_string_is_one_string_not_its_characters(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from cbd_client import _convert

    assert list(_convert.generate_request("hi", 1, {"stop": "\n\n"}).sampling.stop) == ["\n\n"]


def test_cli_prints_one_line_for_daemon_refusals_and_answers_on_stdout(tiny_checkpoint, tmp_path) -> None:  # type: ignore[no-untyped-def]
    d = DaemonProcess(tmp_path / "cbd.sock", "--model", str(tiny_checkpoint("llama")))
    try:
        d.wait_serving(120)
        for args, needle in (
            (["--max-tokens", "-1", "hi"], "max_tokens must be a non-negative integer"),
            (["--stop", "", "--raw", "hi"], "stop strings must not be empty"),
            (["--raw", "-n", "100", "hi"], "INVALID_ARGUMENT"),
            (["-n", "0", "hi"], "n must be at least 1, got 0"),
        ):
            proc = run_client("--address", d.address, *args)
            assert proc.returncode == 1 and proc.stdout == "", (args, proc.stdout, proc.stderr)
            assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1 and needle in proc.stderr, (
                proc.stderr
            )
        ok = run_client("--address", d.address, "stats")  # the answer alone on stdout, nothing on stderr
        assert ok.returncode == 0 and '"uptime_seconds"' in ok.stdout and ok.stderr == "", ok.stderr
    finally:
        d.stop()


def test_threads_setting_is_used_and_logged(tiny_checkpoint, tmp_path) -> None:  # type: ignore[no-untyped-def]
    d = DaemonProcess(tmp_path / "cbd.sock", "--model", str(tiny_checkpoint("llama")), "--num-threads", "1")
    try:
        d.wait_serving(120)
        assert "1 intra-op threads" in d.log()
    finally:
        d.stop()


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
