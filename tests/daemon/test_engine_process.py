"""The daemon's two processes: the engine process's failure, the frontend's death, and slow readers."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest

from cbd_client import CbdError, Client
from cbd_client.v1 import cbd_pb2 as pb
from cbd_client.v1 import cbd_pb2_grpc
from daemon_process import CallInThread, DaemonProcess, alive, children, serving
from helpers import poll_until

PROMPT = list(range(2, 40))


def wait_gone(pid: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def test_killing_the_engine_process_fails_every_live_call_with_internal_and_the_daemon_exits(tmp_path: Path) -> None:
    # The embedded model: 4000 tokens take it minutes on a CPU, so each call is still streaming when it dies.
    d = DaemonProcess(tmp_path / "cbd.sock")
    try:
        d.wait_serving()
        engine = d.engine_pid()
        codes: list[grpc.StatusCode | None] = []
        got_tokens = threading.Barrier(5)

        def one_stream(i: int) -> None:
            with Client(d.address, timeout=60) as client:
                try:
                    for n, _ in enumerate(client.stream(PROMPT, max_tokens=4000, ignore_eos=True, seed=i)):
                        if n == 0:
                            got_tokens.wait(30)
                except CbdError as exc:
                    codes.append(exc.code)
                else:
                    codes.append(None)

        threads = [threading.Thread(target=one_stream, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        got_tokens.wait(30)  # every stream has its first token: all four are live in the engine
        os.kill(engine, signal.SIGKILL)
        for t in threads:
            t.join(60)
        assert codes == [grpc.StatusCode.INTERNAL] * 4
        assert d.process.wait(30) != 0  # so that systemd restarts it
        assert not alive(engine) and children(d.process.pid) == []
        assert "the engine process exited unexpectedly (signal 9)" in d.log()
        assert not Path(d.address.removeprefix("unix:")).exists()  # the daemon cleaned up its socket
    finally:
        d.stop()


def test_the_engine_process_dies_with_the_daemon(tiny_daemon) -> None:
    d = tiny_daemon()
    engine = d.engine_pid()
    call = CallInThread(d.address, PROMPT, max_tokens=4000, ignore_eos=True)
    with Client(d.address, timeout=10) as probe, d.engine_paused():  # the call is live when the daemon dies
        call.start()
        poll_until(lambda: probe.stats().live_requests == 1, 30, what="a live call")
        d.process.kill()  # no drain, no Stop: the engine process must not outlive it
        assert wait_gone(engine), "the engine process outlived the daemon"
    call.join(60)
    assert len(call.ended) == 1 and isinstance(call.ended[0], CbdError), call.ended


def test_a_sigkilled_daemon_leaves_neither_its_engine_process_nor_its_socket_directory(tiny_daemon) -> None:
    d = tiny_daemon()
    engine = d.engine_pid()
    argv = Path(f"/proc/{engine}/cmdline").read_bytes().split(b"\0")
    sockets = Path(argv[argv.index(b"--commands") + 1].decode().removeprefix("ipc://")).parent
    assert sockets.name.startswith("cbd-engine-")
    assert "libtorch" not in Path(f"/proc/{d.process.pid}/maps").read_text()  # the frontend has no torch loaded
    d.process.kill()
    deadline = time.monotonic() + 30
    while (alive(engine) or sockets.exists()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(engine), "the engine process outlived the daemon"
    assert not sockets.exists(), f"{sockets} was left behind"


def test_sigterm_stops_both_processes_cleanly(tiny_daemon) -> None:
    d = tiny_daemon()
    engine = d.engine_pid()
    with Client(d.address, timeout=60) as client:
        assert len(client.generate(PROMPT, max_tokens=5, ignore_eos=True).candidates[0].token_ids) == 5
    assert d.stop() == 0
    assert wait_gone(engine)
    leftovers = [p for p in Path(os.environ.get("TMPDIR", "/tmp")).glob("cbd-engine-*") if str(engine) in p.name]
    assert leftovers == []


def test_a_client_that_reads_slowly_neither_stalls_the_engine_nor_loses_tokens(
    shared_tiny_daemon: DaemonProcess,
) -> None:
    """A stream whose reader stops reading: while it reads nothing, another client's request runs to the
    end and the engine finishes the slow request too (its outputs wait in the frontend); once it reads
    again it gets every token, the same as a fast reader's, several per message (merged)."""
    d = shared_tiny_daemon
    new_tokens = 400  # the tiny model holds 512 positions
    release = threading.Event()

    def read(slow: bool, into: list[pb.GenerateResponse]) -> None:
        # A small HTTP/2 window: the daemon's writes to this stream block soon after it stops reading.
        options = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
        with grpc.insecure_channel(d.address, options=options) as channel:
            request = pb.GenerateRequest(
                tokens=pb.TokenIds(ids=PROMPT),
                sampling=pb.SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True),
            )
            responses = cbd_pb2_grpc.CbdStub(channel).Generate(request, timeout=300)
            if slow:
                assert release.wait(240)
            into.extend(responses)

    fast_replies: list[pb.GenerateResponse] = []
    slow_replies: list[pb.GenerateResponse] = []
    read(False, fast_replies)
    slow = threading.Thread(target=read, args=(True, slow_replies))
    try:
        with Client(d.address, timeout=120) as client:
            with d.engine_paused():  # the slow request is in before it can run
                slow.start()
                poll_until(lambda: client.stats().live_requests == 1, 30, what="the slow request admitted")
            other = client.generate(PROMPT, max_tokens=300, ignore_eos=True, seed=1)
            assert len(other.candidates[0].token_ids) == 300
            deadline = time.monotonic() + 120
            while (stats := client.stats()).running > 0 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert stats.running == 0, stats  # the engine finished the unread request
            assert not slow_replies
    finally:
        release.set()
        slow.join(120)
    tokens = [
        [t for r in replies for c in r.candidates for t in c.token_ids] for replies in (fast_replies, slow_replies)
    ]
    assert len(tokens[1]) == new_tokens and tokens[1] == tokens[0]  # greedy: the same tokens, none lost
    assert len(slow_replies) < new_tokens  # what piled up came merged, several tokens per message


@pytest.mark.slow
def test_serving_the_embedded_model_the_frontend_has_no_torch_loaded(tmp_path: Path) -> None:
    """Its tokenizer (the generic fast class) is loaded without AutoTokenizer's torch import, and a grammar
    is compiled without the grammar library (which imports torch) in the frontend: the workers' fork server
    holds it. A daemon of its own, whose first grammar is this test's."""
    with serving(tmp_path) as d, Client(d.address, timeout=60) as client:
        assert client.generate([{"role": "user", "content": "Hi"}], max_tokens=2).candidates[0].token_ids
        assert "libtorch" not in Path(f"/proc/{d.process.pid}/maps").read_text()
        number = {"type": "regex", "regex": "[0-9]+"}
        reply = client.generate([{"role": "user", "content": "A number?"}], max_tokens=4, response_format=number)
        assert reply.candidates[0].text.isdigit()
        assert "libtorch" not in Path(f"/proc/{d.process.pid}/maps").read_text()
