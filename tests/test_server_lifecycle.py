"""Daemon lifecycle on a tiny random-weight model: back-pressure and a shutdown that leaves no caller hanging."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from cbd_client import CbdError, Client
from daemon_process import DaemonProcess

PROMPT = list(range(2, 40))


@pytest.fixture()
def tiny_daemon(tiny_checkpoint, tmp_path):  # type: ignore[no-untyped-def]
    def start(*flags: str, env: dict[str, str] | None = None) -> DaemonProcess:
        d = DaemonProcess(tmp_path / "cbd.sock", "--model", str(tiny_checkpoint("llama")), *flags, env=env)
        d.wait_serving(120)
        started.append(d)
        return d

    started: list[DaemonProcess] = []
    yield start
    for d in started:
        d.stop()


def test_full_queue_is_resource_exhausted(tiny_daemon) -> None:  # type: ignore[no-untyped-def]
    d = tiny_daemon("--max-queued-requests", "1")
    with Client(d.address, timeout=60) as client:
        stream = client.stream(PROMPT, max_tokens=400, ignore_eos=True)
        next(stream)
        with pytest.raises(CbdError) as info:
            client.generate(PROMPT, max_tokens=2)
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit is 1" in info.value.details
        stream.close()


def test_shutdown_ends_every_stream_with_a_finish_reason(tiny_daemon) -> None:  # type: ignore[no-untyped-def]
    d = tiny_daemon("--max-num-seqs", "2", "--shutdown-grace", "0.2")
    finishes: list[object] = []

    def run() -> None:
        with Client(d.address, timeout=60) as client:
            try:
                for delta in client.stream(PROMPT, max_tokens=450, temperature=0.7, seed=1, ignore_eos=True):
                    if delta.finish_reason:
                        finishes.append(delta.finish_reason)
            except Exception as exc:  # noqa: BLE001 - recorded and asserted below
                finishes.append(exc)

    threads = [threading.Thread(target=run) for _ in range(8)]
    for t in threads:
        t.start()
    with Client(d.address, timeout=10) as probe:
        deadline = time.monotonic() + 30
        while probe.stats().live_requests < 8:  # 2 running, 6 queued behind them
            assert time.monotonic() < deadline
            time.sleep(0.01)
    d.process.terminate()
    for t in threads:
        t.join(60)
    assert d.process.wait(30) == 0, d.log()
    assert len(finishes) == 8 and set(finishes) <= {"abort", "length"}, finishes
    assert "abort" in finishes


def test_systemd_notify_ready_after_warmup_and_stopping(tiny_daemon, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import socket

    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(30)
        d = tiny_daemon(env={"NOTIFY_SOCKET": str(path)})
        assert sock.recv(64) == b"READY=1"  # wait_serving returned, so READY must already be queued
        d.process.terminate()
        assert sock.recv(64) == b"STOPPING=1"
        assert d.process.wait(30) == 0


def test_prometheus_metrics_count_requests_tokens_and_kv(tiny_daemon) -> None:  # type: ignore[no-untyped-def]
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = tiny_daemon("--metrics-port", str(port))
    with Client(d.address, timeout=60) as client:
        client.generate(PROMPT, n=2, max_tokens=5, temperature=0.5, seed=3, ignore_eos=True)
        stream = client.stream(PROMPT, max_tokens=400, ignore_eos=True)
        next(stream)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        stream.close()
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line and line[0] != "#"}
    assert values['cbd_requests_total{outcome="completed"}'] == 1
    assert values['cbd_candidates_total{finish_reason="length"}'] == 2
    assert values["cbd_completion_tokens_total"] == 10
    assert values["cbd_prompt_tokens_total"] == len(PROMPT)
    assert values["cbd_time_to_first_token_seconds_count"] >= 1
    assert values["cbd_live_requests"] == 1 and values["cbd_kv_blocks_used"] > 0
