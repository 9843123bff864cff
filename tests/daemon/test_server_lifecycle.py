"""Daemon lifecycle on a tiny random-weight model: back-pressure and a shutdown that leaves no caller hanging."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from cbd_client import CbdError, Client
from cbd_client.v1 import cbd_pb2 as pb
from cbd_client.v1 import cbd_pb2_grpc
from daemon_process import DaemonProcess, serving
from helpers import poll_until

PROMPT = list(range(2, 40))


def wait_idle(client: Client) -> None:
    """Until the daemon holds no live request (a closed stream's seat comes back once its cancel arrives)."""
    poll_until(lambda: client.stats().live_requests == 0, 30, what="no live request left")


@contextmanager
def held_call(d: DaemonProcess, client: Client) -> Iterator[None]:
    """A streaming call admitted and held live for the block (the engine process paused: nothing can end
    it); cancelled at the end, the engine resumed, and the daemon idle again."""
    request = pb.GenerateRequest(tokens=pb.TokenIds(ids=PROMPT), sampling=pb.SamplingParams(max_tokens=400))
    with grpc.insecure_channel(d.address) as channel:
        with d.engine_paused():
            call = cbd_pb2_grpc.CbdStub(channel).Generate(request, timeout=120)
            try:
                poll_until(lambda: client.stats().live_requests == 1, 30, what="the held call admitted")
                yield
            finally:
                call.cancel()
        wait_idle(client)


@pytest.fixture(scope="module")
def one_seat(tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """A daemon that admits one live request; each test leaves it idle."""
    with serving(
        tmp_path_factory.mktemp("one-seat"), "--max-queued-requests", "1", model=str(tiny_checkpoint("llama"))
    ) as d:
        yield d


def test_full_queue_is_resource_exhausted(one_seat: DaemonProcess) -> None:
    d = one_seat
    with Client(d.address, timeout=60) as client:
        with held_call(d, client), pytest.raises(CbdError) as info:
            client.generate(PROMPT, max_tokens=2)
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit is 1" in info.value.details
        assert info.value.retry_after is not None and 0.05 <= info.value.retry_after <= 30  # the pushback trailer


def test_a_refused_session_turn_keeps_the_chosen_candidate(one_seat: DaemonProcess) -> None:
    d = one_seat
    with Client(d.address, timeout=60) as client, client.session(PROMPT) as session:
        wait_idle(client)
        session.send([5, 6, 7], n=2, max_tokens=4, temperature=0.9, seed=3)
        session.choose(1)
        with held_call(d, client), pytest.raises(CbdError) as info:  # the one seat is taken
            session.send([8, 9], max_tokens=3)
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED  # and then the seat is free again
        reply = session.send([8, 9], max_tokens=3, ignore_eos=True)  # retried: still continues candidate 1
        assert len(reply.candidates[0].token_ids) == 3 and session.info().pending_candidates == 0


def test_shutdown_ends_every_stream_with_a_finish_reason(tiny_daemon) -> None:
    d = tiny_daemon("--max-num-seqs", "2", "--shutdown-grace", "0.2")
    with Client(d.address, timeout=30) as client:  # a request's candidates run at once: n is bounded by the seats
        assert client.model_info().max_n == 2
        with pytest.raises(CbdError) as info:
            client.generate(PROMPT, n=3, max_tokens=2)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "n must be at most 2" in info.value.details
        assert len(client.generate(PROMPT, n=2, max_tokens=2).candidates) == 2
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
    with d.engine_paused():  # no step runs: all eight stay live (two would run, six wait) until the grace is over
        for t in threads:
            t.start()
        with Client(d.address, timeout=10) as probe:
            poll_until(lambda: probe.stats().live_requests == 8, 30, what="eight live streams")
        d.process.terminate()
        poll_until(lambda: "the grace is over: 8 live requests end with ABORT" in d.log(), 30, what="the grace's end")
    for t in threads:
        t.join(60)
    assert d.process.wait(30) == 0, d.log()
    assert finishes == ["abort"] * 8, finishes


def test_systemd_notify_status_ready_watchdog_and_stopping(tiny_daemon, tmp_path) -> None:
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


def test_unix_socket_is_group_only(shared_tiny_daemon: DaemonProcess) -> None:
    import stat

    mode = stat.S_IMODE(Path(shared_tiny_daemon.address.removeprefix("unix:")).stat().st_mode)
    assert mode == 0o660


def test_bearer_token_is_required_except_for_health(tiny_daemon, tmp_path) -> None:
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


def test_config_error_exits_78_naming_the_key(tmp_path) -> None:
    import subprocess
    import sys

    bad = tmp_path / "cbd.toml"
    bad.write_text("[engine]\nblock_sise = 8\n")
    proc = subprocess.run([sys.executable, "-m", "cbd.server.app", "serve", "--config", str(bad)],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 78 and "block_sise" in proc.stderr


def test_print_defaults_is_a_documented_config_equal_to_the_defaults(tmp_path, monkeypatch) -> None:
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


def test_prometheus_metrics_count_requests_tokens_and_kv(tmp_path: Path) -> None:
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # The embedded model: its stream of 4000 tokens is still live when the metrics are read.
    with serving(tmp_path, "--metrics-port", str(port)) as d, Client(d.address, timeout=60) as client:
        client.generate(PROMPT, n=2, max_tokens=5, temperature=0.5, seed=3, ignore_eos=True)
        for bad in ({"temperature": -1.0}, {"session_id": "no-such-session"}):  # refused before they run
            with pytest.raises(CbdError):
                client.generate(PROMPT, max_tokens=5, **bad)
        stream = client.stream(PROMPT, max_tokens=4000, ignore_eos=True)
        for _ in range(5):  # five messages with tokens: four gaps between them, each observed before it went
            next(stream)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        stream.close()
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line and line[0] != "#"}
    assert values['cbd_requests_total{outcome="completed"}'] == 1
    assert values['cbd_requests_refused_total{code="INVALID_ARGUMENT"}'] == 1
    assert values['cbd_requests_refused_total{code="NOT_FOUND"}'] == 1
    assert values['cbd_candidates_total{finish_reason="length"}'] == 2
    assert values["cbd_completion_tokens_total"] == 10
    assert values["cbd_prompt_tokens_total"] == len(PROMPT)
    assert values['cbd_time_to_first_token_seconds_count{priority="interactive"}'] >= 1
    assert values["cbd_live_requests"] == 1 and values["cbd_kv_blocks_used"] > 0
    assert 0 < values["cbd_kv_usage_ratio"] <= 1 and values["cbd_open_sessions"] == 0
    assert (
        values["cbd_inter_token_latency_seconds_count"] >= 4
        and values['cbd_queue_seconds_count{priority="interactive"}'] >= 1
    )


def test_systemd_unit_verifies(tmp_path) -> None:
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    # Everything but the executable's path, on any host; tests/daemon/test_service_install.py verifies the unit
    # unmodified after the documented install puts /opt/cbd/bin/cbd in place.
    unit = (Path(__file__).parents[2] / "systemd" / "cbd.service").read_text()
    assert "ExecStart=/opt/cbd/bin/cbd serve\n" in unit
    cbd = Path(sys.executable).with_name("cbd")  # this environment's entry point stands in for /opt/cbd/bin/cbd
    path = tmp_path / "cbd.service"
    path.write_text(unit.replace("/opt/cbd/bin/cbd", str(cbd)))
    proc = subprocess.run([analyze, "verify", str(path)], capture_output=True, text=True, timeout=60)
    problems = [line for line in (proc.stdout + proc.stderr).splitlines() if "cbd.service" in line]
    assert proc.returncode == 0 and not problems, proc.stdout + proc.stderr


def test_one_json_log_line_per_request_without_prompt_text(shared_tiny_daemon: DaemonProcess) -> None:
    import json

    d = shared_tiny_daemon
    with Client(d.address, timeout=60) as client:
        client.generate(PROMPT, max_tokens=3, ignore_eos=True, request_id="req-log-1")
        stream = client.stream(PROMPT, max_tokens=400, ignore_eos=True, request_id="req-log-2")
        next(stream)
        stream.close()  # cancelled mid-stream: its line still counts its prompt
    poll_until(lambda: '"req-log-2"' in d.log(), 30, what="the cancelled request's log line")
    records = [json.loads(line) for line in d.log().splitlines() if line.startswith("{")]
    assert records and all("event" in r and "level" in r and "timestamp" in r for r in records)
    lines = [r for r in records if r.get("logger") == "cbd.request" and r.get("request_id") == "req-log-1"]
    assert len(lines) == 1
    line = lines[0]
    assert line["outcome"] == "completed" and line["completion_tokens"] == 3 and line["finish_reasons"] == ["length"]
    assert line["prompt_tokens"] > 0 and line["ttft_s"] > 0 and line["duration_s"] >= line["ttft_s"]
    assert ", ".join(map(str, PROMPT[:8])) not in d.log()  # no prompt content
    cancelled = [r for r in records if r.get("logger") == "cbd.request" and r.get("request_id") == "req-log-2"]
    assert len(cancelled) == 1 and cancelled[0]["outcome"] == "cancelled"
    assert cancelled[0]["prompt_tokens"] == len(PROMPT)


def _certificates(directory):
    """A CA, a server certificate for 127.0.0.1 / localhost and a client certificate, as PEM files."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def make(name, issuer=None, issuer_key=None, ca=False, san=None):
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        builder = (
            x509.CertificateBuilder().subject_name(subject).issuer_name(issuer or subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )  # fmt: skip
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        cert = builder.sign(issuer_key or key, hashes.SHA256())
        return key, cert

    ca_key, ca = make("cbd test CA", ca=True)
    san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    server_key, server = make("localhost", ca.subject, ca_key, san=san)
    client_key, client = make("agent", ca.subject, ca_key)
    paths = {}
    for name, key, cert in (("ca", ca_key, ca), ("server", server_key, server), ("client", client_key, client)):
        (directory / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (directory / f"{name}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))  # fmt: skip
        paths[name] = (str(directory / f"{name}.pem"), str(directory / f"{name}.key"))
    return paths


def test_mutual_tls_on_tcp(tiny_daemon, tmp_path) -> None:
    import socket

    pem = _certificates(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tcp = f"127.0.0.1:{port}"
    d = tiny_daemon("--listen", f"unix:{tmp_path / 'cbd.sock'},{tcp}", "--tls-cert-file", pem["server"][0],
                    "--tls-key-file", pem["server"][1], "--tls-client-ca-file", pem["ca"][0])  # fmt: skip
    ca = pem["ca"][0]
    with Client(tcp, timeout=30, tls_ca=ca, tls_cert=pem["client"][0], tls_key=pem["client"][1]) as client:
        assert len(client.generate(PROMPT, max_tokens=2, ignore_eos=True).candidates[0].token_ids) == 2
    with Client(tcp, timeout=10, tls_ca=ca) as client, pytest.raises(CbdError):  # no client certificate
        client.stats()
    with Client(tcp, timeout=10) as client, pytest.raises(CbdError):  # plaintext to a TLS port
        client.stats()
    assert d.process.poll() is None


def test_sigterm_lets_eight_live_calls_finish_and_refuses_new_calls(tiny_daemon) -> None:
    d = tiny_daemon("--shutdown-grace", "60")
    results: list[object] = []

    def run() -> None:
        with Client(d.address, timeout=120) as client:
            try:
                results.append(client.generate(PROMPT, max_tokens=200, ignore_eos=True).candidates[0])
            except Exception as exc:  # noqa: BLE001 - asserted below
                results.append(exc)

    threads = [threading.Thread(target=run) for _ in range(8)]
    with Client(d.address, timeout=10) as probe, d.engine_paused():  # all eight are live when the signal comes
        for t in threads:
            t.start()
        poll_until(lambda: probe.stats().live_requests == 8, 30, what="eight live calls")
        d.process.terminate()
        poll_until(lambda: d.health() == "NOT_SERVING", 30, what="the signal taken")
        with pytest.raises(CbdError) as info:  # new calls are refused from then on
            probe.generate(PROMPT, max_tokens=2)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
    for t in threads:
        t.join(120)
    assert d.process.wait(60) == 0, d.log()
    assert len(results) == 8 and all(getattr(r, "finish_reason", None) == "length" for r in results), results
    assert all(len(r.token_ids) == 200 for r in results)  # type: ignore[union-attr]


def test_injected_step_error_fails_its_request_with_internal_and_the_daemon_goes_on(tiny_daemon) -> None:
    d = tiny_daemon(env={"CBD_INJECT_FAULT": "error:8"})  # warm-up uses the first steps
    with Client(d.address, timeout=60) as client:
        with pytest.raises(CbdError) as info:
            client.generate(PROMPT, max_tokens=50, ignore_eos=True)
        assert info.value.code == grpc.StatusCode.INTERNAL
        assert len(client.generate(PROMPT, max_tokens=4, ignore_eos=True).candidates[0].token_ids) == 4
        assert client.stats().kv_blocks_used == 0
    assert d.process.poll() is None


def test_injected_device_error_fails_requests_and_exits_non_zero(tiny_daemon) -> None:
    d = tiny_daemon(env={"CBD_INJECT_FAULT": "device-error:8"})
    with Client(d.address, timeout=60) as client, pytest.raises(CbdError) as info:
        client.generate(PROMPT, max_tokens=50, ignore_eos=True)
    assert info.value.code == grpc.StatusCode.INTERNAL
    assert d.process.wait(30) == 1


def _serving_after_stall(messages: list[str]) -> bool:
    return (
        "STATUS=engine stalled" in messages and "STATUS=serving" in messages[messages.index("STATUS=engine stalled") :]
    )


def test_wedged_engine_stops_the_watchdog_and_turns_health_not_serving(tiny_daemon, tmp_path) -> None:
    import socket

    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(30)
        env = {"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "200000", "CBD_INJECT_FAULT": "stall:8:4"}
        d = tiny_daemon("--stall-seconds", "1", env=env)
        done: list[object] = []
        worker = threading.Thread(target=lambda: done.append(
            Client(d.address, timeout=60).generate(PROMPT, max_tokens=20, ignore_eos=True)))  # fmt: skip
        worker.start()
        events: list[tuple[float, str]] = []
        health_seen: set[str | None] = set()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not done:
            sock.settimeout(0.1)
            try:
                events.append((time.monotonic(), sock.recv(256).decode()))
            except TimeoutError:
                pass
            health_seen.add(d.health(timeout=0.5))
        worker.join(30)
        # The reply can beat the watchdog's next look at the engine: read on until it says so (bounded).
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not _serving_after_stall([m for _, m in events]):
            try:
                events.append((time.monotonic(), sock.recv(256).decode()))
            except TimeoutError:
                pass
    messages = [m for _, m in events]
    assert (
        "STATUS=engine stalled" in messages and "STATUS=serving" in messages[messages.index("STATUS=engine stalled") :]
    )
    stalled_at = events[messages.index("STATUS=engine stalled")][0]
    resumed_at = events[messages.index("STATUS=serving", messages.index("STATUS=engine stalled"))][0]
    pings_while_stalled = [t for t, m in events if m == "WATCHDOG=1" and stalled_at < t < resumed_at]
    assert resumed_at - stalled_at > 1.5 and not pings_while_stalled
    assert "NOT_SERVING" in health_seen and done and len(done[0].candidates[0].token_ids) == 20  # type: ignore[attr-defined]


def test_limits_on_queued_tokens_stop_lists_and_message_size(tiny_daemon) -> None:
    d = tiny_daemon("--max-queued-tokens", "60", "--max-message-bytes", "4096")
    with Client(d.address, timeout=60) as client:
        with held_call(d, client), pytest.raises(CbdError) as info:  # its 38 prompt tokens queued
            client.generate(PROMPT, max_tokens=2)
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry" in info.value.details
        assert info.value.retry_after is not None  # and then its queued tokens are released
        assert len(client.generate(PROMPT, max_tokens=2, ignore_eos=True).candidates[0].token_ids) == 2
        for kw, match in ((dict(stop_token_ids=list(range(65))), "at most 64 ids"),):
            with pytest.raises(CbdError) as info:
                client.generate(PROMPT, max_tokens=2, **kw)
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and match in info.value.details
        with pytest.raises(CbdError) as info:  # over the message limit: refused by gRPC before any work
            client.generate(list(range(2, 200)) * 20, max_tokens=2)
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_stop_strings_are_bounded() -> None:
    from cbd.engine.sampling_params import SamplingParams
    from cbd.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="at most 256 characters"):
        SamplingParams(stop=("x" * 257,))
    with pytest.raises(InvalidRequest, match="at most 16 strings"):
        SamplingParams(stop=tuple("abcdefghijklmnopq"))
    with pytest.raises(InvalidRequest, match="stop strings must not be empty"):
        SamplingParams(stop=("",))


def test_a_thousand_streams_cancelled_at_random_points_leave_nothing_behind(tiny_daemon) -> None:
    """Cancelled before their first token, mid-stream, mid-fan-out and mid-session-turn: all KV comes back."""
    import asyncio
    import random

    from cbd_client import AsyncClient

    d = tiny_daemon("--max-queued-requests", "2000", "--num-kv-blocks", "512")
    rng = random.Random(11)

    async def one(client: AsyncClient, i: int, session) -> str:
        kw = dict(max_tokens=rng.randrange(5, 200), ignore_eos=True, temperature=0.7, seed=i)
        if i % 5 == 1:
            kw["n"] = rng.randrange(2, 5)  # a fan-out
        prompt = [rng.randrange(2, 250) for _ in range(rng.randrange(3, 60))]
        stream = session.stream(prompt, **kw) if session is not None else client.stream(prompt, **kw)
        stop_after = rng.choice([0, 0, 1, 3, 10, 1000])
        seen = 0
        try:
            async for _ in stream:
                seen += 1
                if seen >= stop_after:
                    break
        except CbdError as e:  # a session turn may find its session busy: that is a clean refusal
            assert e.code == grpc.StatusCode.FAILED_PRECONDITION, e
        finally:
            await stream.aclose()  # cancels the call on the daemon
        return "done"

    async def main() -> None:
        async with AsyncClient(d.address, timeout=120) as client:
            sessions = [await client.session(ttl=120) for _ in range(20)]
            tasks = []
            for i in range(1000):
                session = sessions[i % 20] if i % 7 == 3 else None
                tasks.append(asyncio.ensure_future(one(client, i, session)))
                if i % 50 == 0:
                    await asyncio.sleep(0.01)
            # some calls are cancelled from outside before they produced anything at all
            for t in rng.sample(tasks, 50):
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for s in sessions:
                await s.close()
            deadline = time.monotonic() + 30
            while True:
                stats = await client.stats()
                if (stats.running, stats.waiting, stats.kv_blocks_used, stats.live_requests) == (0, 0, 0, 0):
                    break
                assert time.monotonic() < deadline, stats
                await asyncio.sleep(0.1)
            assert stats.open_sessions == 0

    asyncio.run(main())
    assert d.process.poll() is None
