"""Grammar bombs through a real daemon cannot hurt other requests: six expensive schemas sent at once
compile at most `grammar_compile_workers` at a time and each ends with its documented error, while a
greedy stream keeps advancing, a plain and a regex request are answered and health answers within its
deadline; afterwards both processes' memory is back within its documented bound; a cancelled compile
stops (its worker is killed) and frees its slot."""

from __future__ import annotations

import re
import threading
import time
import urllib.request

import grpc
import pytest

from cbd_client import CbdError, Client
from cbd_client.address import free_port
from cbd_client.v1 import cbd_pb2 as pb
from cbd_client.v1.cbd_pb2_grpc import CbdStub
from daemon_process import BackgroundStream, DaemonProcess, alive, rss_bytes
from grammar_cases import MASK_BOMB, schema_bomb

pytestmark = [pytest.mark.slow, pytest.mark.first]
ASK = [{"role": "user", "content": "Write something."}]
WORKERS = 2  # --grammar-compile-workers
MEMORY_BOUND = 150 * 2**20  # README's limits: RSS after grammar bombs, over its value before
REGEX = {"type": "regex", "regex": "[a-z]+"}  # its masks cost microseconds, far below the budget


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_port()  # picked as the module starts, just before its daemon binds it


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, metrics_port):
    d = DaemonProcess(
        tmp_path_factory.mktemp("cbd") / "cbd.sock", "--grammar-compile-workers", str(WORKERS),
        "--grammar-compile-timeout", "4", "--grammar-mask-budget-ms", "20", "--metrics-port", str(metrics_port),
    )  # fmt: skip
    try:
        d.wait_serving()
        with Client(d.address, timeout=300) as c:  # both processes hold a compiled grammar (and its library)
            assert c.generate(ASK, max_tokens=4, temperature=0.0, response_format=REGEX).candidates[0].token_ids
        yield d
    finally:
        assert d.stop() == 0, d.log()


@pytest.fixture(scope="module")
def baseline(daemon) -> dict[int, int]:
    """Resident memory of the frontend and the engine process before any bomb."""
    return {pid: rss_bytes(pid) for pid in (daemon.process.pid, daemon.engine_pid())}


def send_bombs(client: Client, tags: list[str]) -> tuple[list[threading.Thread], list[CbdError | str]]:
    """Each bomb in its own thread; its outcome (the error, or "answered") is appended when it ends."""
    ended: list[CbdError | str] = []

    def bomb(tag: str) -> None:
        try:
            fmt = {"type": "json_schema", "json_schema": schema_bomb(tag)}
            client.generate(ASK, max_tokens=4, response_format=fmt)
            ended.append("answered")
        except CbdError as exc:
            ended.append(exc)

    threads = [threading.Thread(target=bomb, args=(tag,)) for tag in tags]
    for t in threads:
        t.start()
    return threads, ended


def assert_documented_errors(ended: list[CbdError | str], count: int) -> None:
    assert len(ended) == count
    for exc in ended:
        assert isinstance(exc, CbdError), exc
        assert exc.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED), exc
        assert "grammar_compile_timeout" in exc.details or "grammar_compile_memory_mib" in exc.details, exc.details


def test_both_grammar_caches_show_in_the_metrics(daemon, metrics_port) -> None:
    # The fixture compiled one regex: the frontend keeps its outcome, the engine its loaded grammar.
    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).read().decode()
    found = dict(re.findall(r'^cbd_grammar_cache_bytes\{process="(\w+)"\} (\S+)$', body, re.M))
    assert set(found) == {"frontend", "engine"} and all(float(v) > 0 for v in found.values()), found
    assert re.search(r"^cbd_chat_transcripts 0\.0$", body, re.M)


def test_six_compile_bombs_at_once_leave_other_requests_and_health_alone(daemon, baseline) -> None:
    with Client(daemon.address, timeout=300) as client:
        stream = BackgroundStream(daemon.address)
        threads, ended = send_bombs(client, [f"six-{i}" for i in range(6)])
        health: list[str | None] = []
        workers: list[int] = []
        while not daemon.grammar_worker_pids():  # the first bombs have reached their workers
            time.sleep(0.01)
        at_start = stream.tokens
        plain = client.generate("Hello", max_tokens=4, temperature=0.0, ignore_eos=True).candidates[0]
        regex = client.generate(ASK, max_tokens=4, temperature=0.0, response_format=REGEX).candidates[0]  # cached
        bombs_ended_by_then = len(ended)
        while any(t.is_alive() for t in threads):
            health.append(daemon.health(timeout=1.0))
            seen = len(daemon.grammar_worker_pids())
            if seen > WORKERS:  # a killed worker may take a moment to go; a running compile stays for seconds
                time.sleep(0.2)
                seen = len(daemon.grammar_worker_pids())
            workers.append(seen)
            time.sleep(0.1)
        at_end = stream.tokens
        fresh = client.generate(
            ASK, max_tokens=4, temperature=0.0, response_format={"type": "regex", "regex": "[0-9]+"}
        )
        stream.stop()
    assert_documented_errors(ended, 6)
    assert plain.finish_reason == "length" and len(plain.token_ids) == 4
    assert regex.finish_reason in ("length", "stop") and regex.token_ids
    assert bombs_ended_by_then < 6  # both were answered while bombs still compiled or waited
    assert at_end > at_start  # the greedy stream advanced while the bombs ran
    assert health and all(h == "SERVING" for h in health), health  # every check answered within its deadline
    assert max(workers) <= WORKERS, workers
    assert fresh.candidates[0].text.isdigit()


def test_memory_returns_within_its_bound_after_compile_and_mask_bombs(daemon, baseline) -> None:
    with Client(daemon.address, timeout=300) as client:
        threads, ended = send_bombs(client, ["memory-0", "memory-1"])
        with pytest.raises(CbdError, match="grammar too expensive") as info:
            fmt = {"type": "grammar", "grammar": MASK_BOMB}
            client.generate(ASK, max_tokens=1000, temperature=0.0, response_format=fmt)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        for t in threads:
            t.join()
        assert_documented_errors(ended, 2)
        stats = client.stats()
        assert (stats.running, stats.waiting, stats.kv_blocks_used) == (0, 0, 0)
    grown = {pid: rss_bytes(pid) - before for pid, before in baseline.items()}
    assert all(g < MEMORY_BOUND for g in grown.values()), {pid: g // 2**20 for pid, g in grown.items()}


def test_a_cancelled_compile_is_stopped_and_frees_its_slot(tmp_path) -> None:
    # One worker, and a budget far longer than the test: only the cancel can end the compile.
    d = DaemonProcess(tmp_path / "cbd.sock", "--grammar-compile-workers", "1", "--grammar-compile-timeout", "600")
    try:
        d.wait_serving()
        request = pb.GenerateRequest()
        request.chat.messages.add(role="user", content="Write something.")
        request.response_format.json_schema = schema_bomb("cancelled")
        request.sampling.max_tokens = 4
        with grpc.insecure_channel(d.address) as channel:
            call = CbdStub(channel).Generate(request, timeout=300)
            deadline = time.monotonic() + 120
            while not d.grammar_worker_pids() and time.monotonic() < deadline:
                time.sleep(0.01)
            (worker,) = d.grammar_worker_pids()
            call.cancel()
            deadline = time.monotonic() + 60  # far below the compile budget (600 s)
            while alive(worker) and time.monotonic() < deadline:
                time.sleep(0.05)
        assert not alive(worker)
        with Client(d.address, timeout=120) as client:  # the only slot is free again: a fresh compile runs
            reply = client.generate(
                ASK, max_tokens=4, temperature=0.0, response_format={"type": "regex", "regex": "[0-9]+"}
            )
        assert reply.candidates[0].text.isdigit()
    finally:
        assert d.stop() == 0, d.log()
