"""The daemon's command line as a new user meets it: one daemon per address, start-up failures that say what
to fix (exit 78, nothing left behind), `cbd serve --detach` / `cbd stop`, signals, help. Real processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from cbd_client import Client
from daemon_process import CallInThread, DaemonFactory, DaemonProcess
from helpers import poll_until

PROMPT = list(range(2, 40))
CBD = [sys.executable, "-m", "cbd.server.app"]


def run_cbd(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CBD, *args], capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


def assert_one_clear_line(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 78, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_a_second_daemon_on_the_same_socket_is_refused_and_the_first_keeps_serving(
    tiny_daemon: DaemonFactory, tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    first = tiny_daemon()
    second = run_cbd("serve", "--listen", first.address, "--model", str(tiny_checkpoint("llama")))
    assert_one_clear_line(second, f"pid {first.process.pid}", "already serves")
    with Client(first.address, timeout=30) as client:
        assert len(client.generate(PROMPT, max_tokens=3, ignore_eos=True).candidates[0].token_ids) == 3
    assert first.stop() == 0
    assert not (tmp_path / "cbd.sock").exists() and not (tmp_path / "cbd.sock.lock").exists()


def test_a_second_daemon_on_the_same_tcp_port_is_refused(
    tiny_daemon: DaemonFactory, tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"127.0.0.1:{port}"
    first = tiny_daemon("--listen", f"unix:{tmp_path / 'cbd.sock'},{address}")
    second = run_cbd("serve", "--listen", address, "--model", str(tiny_checkpoint("llama")))
    assert_one_clear_line(second, "port is in use")
    for _ in range(5):  # every connection reaches the first daemon: the port is not shared
        with Client(address, timeout=30) as client:
            assert client.stats().uptime_seconds > 0
    assert first.process.poll() is None


def test_a_stale_socket_is_replaced_and_a_foreign_file_is_refused(tiny_checkpoint, tmp_path) -> None:
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(stale))  # a socket file nothing listens on, as a killed daemon leaves it
    d = DaemonProcess(stale, "--model", str(tiny_checkpoint("llama")))
    try:
        d.wait_serving(120)
    finally:
        assert d.stop() == 0
    assert not stale.exists()

    foreign = tmp_path / "foreign.sock"
    foreign.write_text("not a socket")
    proc = run_cbd("serve", "--listen", f"unix:{foreign}", "--model", str(tiny_checkpoint("llama")))
    assert proc.returncode == 78 and "is not a socket" in proc.stderr, proc.stderr
    assert foreign.read_text() == "not a socket"


@pytest.mark.parametrize(
    "args, env, toml, needles",
    [
        (["--model", "/nonexistent/model"], {}, None, ["model", "/nonexistent/model", "does not exist"]),
        (["--socket-group", "no-such-group-xyz"], {}, None, ["socket_group", "no-such-group-xyz"]),
        (["--block-size", "abc"], {}, None, ["--block-size", "abc"]),
        ([], {"CBD_MAX_NUM_SEQS": "many"}, None, ["CBD_MAX_NUM_SEQS", "many"]),
        ([], {}, '[engine]\nblock_size = "abc"\n', ["block_size", "abc"]),
        ([], {}, "[server]\nshutdown_grace = true\n", ["shutdown_grace"]),
        (["--host-kv-gib", "1000000"], {}, None, ["host_kv_gib", "1000000", "RAM"]),
        (["--listen", "127.0.0.1:99999"], {}, None, ["listen", "127.0.0.1:99999", "port from 1 to 65535"]),
        (["--disk-kv-dir", "/dev/null"], {}, None, ["disk_kv_dir", "/dev/null", "not a directory"]),
    ],
)
def test_start_up_failures_exit_78_with_one_line_and_leave_nothing_behind(tmp_path, args, env, toml, needles) -> None:
    if toml is not None:
        (tmp_path / "cbd.toml").write_text(toml)
        args = [*args, "--config", str(tmp_path / "cbd.toml")]
    sock = tmp_path / "cbd.sock"
    proc = run_cbd("serve", "--listen", f"unix:{sock}", *args, env=env)
    assert_one_clear_line(proc, *needles)
    assert sorted(p.name for p in tmp_path.iterdir()) == (["cbd.toml"] if toml else [])


def test_a_model_file_that_is_not_a_checkpoint_is_refused_before_anything_is_bound(tmp_path) -> None:
    (tmp_path / "bad.gguf").write_text("garbage")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{not json")
    for model, needle in ((tmp_path / "bad.gguf", "not a GGUF file"), (tmp_path / "ckpt", "not readable JSON")):
        proc = run_cbd("serve", "--listen", f"unix:{tmp_path / 'cbd.sock'}", "--model", str(model))
        assert_one_clear_line(proc, "model", needle)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf", "ckpt"]


def test_a_session_directory_owner_held_by_a_live_daemon_is_refused_before_anything_is_bound(
    tiny_daemon: DaemonFactory, tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    sessions = tmp_path / "sessions"
    first = tiny_daemon("--disk-kv-dir", str(sessions), "--disk-kv-owner", "shared")
    second = tmp_path / "second"
    second.mkdir()
    proc = run_cbd("serve", "--listen", f"unix:{second / 'cbd.sock'}", "--model", str(tiny_checkpoint("llama")),
                   "--disk-kv-dir", str(sessions), "--disk-kv-owner", "shared", "--pid-file", str(second / "pid"))  # fmt: skip
    assert_one_clear_line(proc, "disk_kv_owner", "another cbd daemon holds the owner name 'shared'")
    assert list(second.iterdir()) == []
    assert first.health(timeout=30) == "SERVING"


def test_a_host_kv_tier_that_cannot_be_allocated_is_a_configuration_error(tiny_checkpoint, tmp_path) -> None:
    proc = run_cbd("serve", "--listen", f"unix:{tmp_path / 'cbd.sock'}", "--model", str(tiny_checkpoint("llama")),
                   "--num-host-kv-blocks", str(10**14))  # fmt: skip
    # Found once the model is loaded (its block size is known), so the start-up log lines come first.
    assert proc.returncode == 78 and "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "host_kv_gib" in last and "cannot allocate" in last, last
    assert list(tmp_path.iterdir()) == []


def test_flash_attention_where_it_cannot_run_exits_78_with_one_line(tiny_checkpoint, tmp_path) -> None:
    proc = run_cbd("serve", "--listen", f"unix:{tmp_path / 'cbd.sock'}", "--model", str(tiny_checkpoint("llama")),
                   "--attention-backend", "flash")  # fmt: skip
    # Found once the model is loaded (its head dim is known), so the start-up log lines come first.
    assert proc.returncode == 78 and "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "attention_backend flash" in last and "FlashAttention-4" in last and "cannot run" in last, last
    assert list(tmp_path.iterdir()) == []


def test_fused_swiglu_on_where_it_cannot_run_exits_78_with_one_line(tiny_checkpoint, tmp_path) -> None:
    proc = run_cbd("serve", "--listen", f"unix:{tmp_path / 'cbd.sock'}", "--model", str(tiny_checkpoint("llama")),
                   "--fused-swiglu", "on")  # fmt: skip
    assert proc.returncode == 78 and "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "fused_swiglu on" in last and "cannot run: it needs CUDA" in last, last
    assert list(tmp_path.iterdir()) == []


def test_cuda_without_cuda_is_a_configuration_error(tmp_path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    proc = run_cbd("serve", "--listen", f"unix:{tmp_path / 'cbd.sock'}", "--device", "cuda")
    assert_one_clear_line(proc, "device", "CUDA is not available")
    assert list(tmp_path.iterdir()) == []


def test_detach_prints_the_pid_and_cbd_stop_stops_exactly_that_daemon(tiny_checkpoint, tmp_path) -> None:
    address, pid_file, log_file = f"unix:{tmp_path / 'cbd.sock'}", tmp_path / "cbd.pid", tmp_path / "cbd.log"
    started = run_cbd("serve", "--detach", "--listen", address, "--model", str(tiny_checkpoint("llama")),
                      "--pid-file", str(pid_file), "--log-file", str(log_file))  # fmt: skip
    assert started.returncode == 0, started.stderr
    pid = int(started.stdout.strip())
    try:
        assert pid_file.read_text().strip() == str(pid)
        with Client(address, timeout=60) as client:  # detach returns once it listens; the model may still load
            client.wait_ready(120)
            assert len(client.generate(PROMPT, max_tokens=2, ignore_eos=True).candidates[0].token_ids) == 2
        stopped = run_cbd("stop", address)
        assert stopped.returncode == 0 and f"stopped pid {pid}" in stopped.stderr, stopped.stderr
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
        assert not (tmp_path / "cbd.sock").exists() and not pid_file.exists()
        assert "serving" in log_file.read_text()
    finally:
        if Path(f"/proc/{pid}").exists():
            os.kill(pid, signal.SIGKILL)
    again = run_cbd("stop", address)
    assert again.returncode == 1 and "no daemon is listening" in again.stderr


def test_stop_by_pid_file_refuses_a_process_that_is_not_cbd(tmp_path) -> None:
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        pid_file = tmp_path / "x.pid"
        pid_file.write_text(str(sleeper.pid))
        proc = run_cbd("stop", "--pid-file", str(pid_file))
        assert proc.returncode == 1 and "not a cbd daemon" in proc.stderr
        assert sleeper.poll() is None
    finally:
        sleeper.kill()


def test_sighup_drains_and_a_second_signal_exits_at_once_leaving_no_socket(
    tiny_daemon: DaemonFactory, tmp_path: Path
) -> None:
    d = tiny_daemon(socket_name="hup.sock")
    d.process.send_signal(signal.SIGHUP)
    assert d.process.wait(60) == 0
    assert not (tmp_path / "hup.sock").exists()

    d = tiny_daemon("--shutdown-grace", "60", socket_name="twice.sock")
    call = CallInThread(d.address, PROMPT, max_tokens=400, ignore_eos=True)
    with Client(d.address, timeout=10) as probe, d.engine_paused():  # the call cannot end by itself
        call.start()
        poll_until(lambda: probe.stats().live_requests == 1, 30, what="a live call")
        d.process.send_signal(signal.SIGTERM)  # the live call keeps the first signal's drain waiting
        # The first signal was taken once health turns NOT_SERVING (the drain has begun): only then is the
        # next one a second signal.
        poll_until(lambda: d.health() == "NOT_SERVING", 60, what="the first SIGTERM starts the drain")
        d.process.send_signal(signal.SIGTERM)
        assert d.process.wait(30) == 1
    call.join(60)
    assert len(call.ended) == 1  # the call ended (the daemon's exit ends it)
    assert not (tmp_path / "twice.sock").exists() and not (tmp_path / "twice.sock.lock").exists()


def test_help_says_what_each_flag_means_with_its_real_default(monkeypatch) -> None:
    from cbd.server.settings import build_parser, default_listen

    monkeypatch.delenv("CBD_LISTEN", raising=False)
    monkeypatch.delenv("CBD_ADDRESS", raising=False)
    text = " ".join(run_cbd("serve", "--help", env={"CBD_ADDRESS": ""}).stdout.split())
    assert "embedded SmolLM2-135M-Instruct" in text and f"Default: {default_listen()}" in text
    serve = next(a for a in build_parser()._subparsers._group_actions[0].choices.items() if a[0] == "serve")[1]  # type: ignore[union-attr]
    settings = [a for a in serve._actions if a.dest.startswith(("engine.", "server."))]
    assert len(settings) > 30
    for action in settings:
        assert action.help and "Default:" in action.help and "env CBD_" in action.help, action.option_strings
        assert len(action.help.split(". Default:")[0]) > 10, (action.option_strings, action.help)  # says what it means
    config = run_cbd("config")
    assert config.returncode == 0 and "--print-defaults" in config.stdout
    top = subprocess.run([*CBD, "--help"], capture_output=True, text=True, timeout=60).stdout
    assert all(command in top for command in ("serve", "stop", "config"))
    # `cbd config --print-defaults | head`: a reader that goes away ends it quietly (141, as a shell's SIGPIPE).
    cut = subprocess.Popen([sys.executable, "-m", "cbd.cli", "config", "--print-defaults"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert cut.stdout is not None and cut.stderr is not None
    cut.stdout.close()
    assert cut.stderr.read() == "" and cut.wait(60) == 141


@pytest.mark.slow
def test_readme_serve_and_ask_with_the_embedded_model(tmp_path) -> None:
    """README's first command after the install: `cbd serve --detach && cbd-client "..."`, then `cbd stop`."""
    env = {**os.environ, "CBD_ADDRESS": f"unix:{tmp_path / 'cbd.sock'}"}
    shell = 'cbd serve --detach --log-file "$LOG" && cbd-client --max-tokens 24 "What is the capital of France?"'
    bin_dir = Path(sys.executable).parent
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    try:
        proc = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, timeout=600,
                              env={**env, "LOG": str(tmp_path / "cbd.log")})  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert "Paris" in proc.stdout
    finally:
        stopped = subprocess.run([str(bin_dir / "cbd"), "stop"], capture_output=True, text=True, timeout=120, env=env)
    assert stopped.returncode == 0, stopped.stderr
    assert not (tmp_path / "cbd.sock").exists()
