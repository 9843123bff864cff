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


def test_systemd_notify_status_ready_watchdog_and_stopping(tiny_daemon, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import socket

    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(30)
        d = tiny_daemon(env={"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "200000"})
        messages = [sock.recv(256).decode() for _ in range(3)]
        assert messages[0] == "STATUS=loading the model"
        assert messages[1].startswith("READY=1\nSTATUS=serving")  # wait_serving returned: already queued
        assert messages[2] == "WATCHDOG=1"  # fed while the engine loop is healthy
        d.process.terminate()
        while (message := sock.recv(256).decode()) == "WATCHDOG=1":
            pass
        assert message == "STOPPING=1\nSTATUS=draining"
        assert d.process.wait(30) == 0


def test_unix_socket_is_group_only(tiny_daemon, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import stat

    d = tiny_daemon()
    mode = stat.S_IMODE((tmp_path / "cbd.sock").stat().st_mode)
    assert mode == 0o660


def test_bearer_token_is_required_except_for_health(tiny_daemon, tmp_path) -> None:  # type: ignore[no-untyped-def]
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    d = tiny_daemon("--auth-token-file", str(token_file))  # wait_serving polls health without a token
    for token in (None, "wrong"):
        with Client(d.address, timeout=30, token=token) as client, pytest.raises(CbdError) as info:
            client.generate(PROMPT, max_tokens=2)
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
        with Client(d.address, timeout=30, token=token) as client, pytest.raises(CbdError) as info:
            client.stats()
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
    with Client(d.address, timeout=30, token="s3cret-token") as client:
        assert len(client.generate(PROMPT, max_tokens=3, ignore_eos=True).candidates[0].token_ids) == 3
    assert "s3cret" not in d.log()


def test_config_error_exits_78_naming_the_key(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    bad = tmp_path / "cbd.toml"
    bad.write_text("[engine]\nblock_sise = 8\n")
    proc = subprocess.run([sys.executable, "-m", "cbd.server.app", "serve", "--config", str(bad)],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 78 and "block_sise" in proc.stderr


def test_print_defaults_is_a_documented_config_equal_to_the_defaults(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import os
    import subprocess
    import sys

    from cbd.config import EngineConfig
    from cbd.server.settings import ServerConfig, load_settings

    proc = subprocess.run([sys.executable, "-m", "cbd.server.app", "config", "--print-defaults"],
                          capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    assert "# Keep one step in flight" in proc.stdout
    path = tmp_path / "cbd.toml"
    path.write_text(proc.stdout)
    for name in [k for k in os.environ if k.startswith("CBD_")]:
        monkeypatch.delenv(name)
    engine, server = load_settings(["serve", "--config", str(path)])
    assert engine == EngineConfig() and server == ServerConfig()


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
    assert 0 < values["cbd_kv_usage_ratio"] <= 1 and values["cbd_open_sessions"] == 0
    assert values["cbd_inter_token_latency_seconds_count"] >= 4


def test_systemd_unit_verifies(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    unit = (Path(__file__).parents[1] / "systemd" / "cbd.service").read_text()
    cbd = Path(sys.executable).with_name("cbd")  # the installed entry point stands in for /usr/local/bin/cbd
    path = tmp_path / "cbd.service"
    path.write_text(unit.replace("/usr/local/bin/cbd", str(cbd)))
    proc = subprocess.run([analyze, "verify", str(path)], capture_output=True, text=True, timeout=60)
    problems = [line for line in (proc.stdout + proc.stderr).splitlines() if "cbd.service" in line]
    assert proc.returncode == 0 and not problems, proc.stdout + proc.stderr
