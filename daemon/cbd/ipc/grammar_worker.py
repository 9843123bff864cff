"""Grammar compile workers: one process per worker, forked from a process that has already imported the
grammar library.

`python -m cbd.ipc.grammar_worker --fork-server FD CHECKPOINT VOCAB_SIZE EOS_IDS` (started by
ipc/grammar_pool.py, one per pool) imports xgrammar (and with it torch and transformers: two seconds of
CPU) and builds the tokenizer's grammar info from the checkpoint's tokenizer once (so the frontend never
imports the grammar library, nor torch through it), then on each request on its control socket (a
SOCK_SEQPACKET pair: `F` with the worker's socket attached, answered with the new worker's pid; `K` with a
pid) forks a worker or kills one of its own workers. It reaps its workers itself and kills only a pid
among its workers not yet reaped, so never another process (a `K` for a worker that exited and was reaped
could only reach a newer worker given the same pid, which sequential pids make a matter of wrapping
around pid_max first). Killing a worker whose compile overran therefore costs a fork to replace, not a
start.

A worker (`main`) has the tokenizer's info from the server it was forked from and talks to the pool over
its own socket: messages are pickled by multiprocessing's Connection: first the memory budget in bytes,
answered with "ready"; then one `(kind, source)` per compile, answered with `("ok", serialized)` or
`("invalid", message)`. The address space it may grow by past its state after setup is capped
(RLIMIT_AS); an allocation beyond it fails (answered "memory", then the worker exits) or kills the
process, which the pool reads as the same. The pool has a worker killed when its compile runs past its
time budget or its request was cancelled. Every process here dies with its parent.
"""

from __future__ import annotations

import errno
import os
import resource
import select
import signal
import socket
import struct
import sys
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from cbd.lifetime import die_with_parent

_PAGE = 4096
REQUEST = struct.Struct("=cq")  # the fork server's requests: b"F" (a worker's socket attached) or b"K" and a pid
PID = struct.Struct("=q")  # its answer to b"F"
REAP_SECONDS = 1.0  # how often an idle fork server reaps its exited workers


def _address_space() -> int:
    """Bytes of address space this process maps now."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[0]) * _PAGE


def main(fd: int, info: Any, vocab_size: int) -> int:
    """A worker forked by the server: `info` is the tokenizer's xgrammar info the server built (its stop
    tokens included)."""
    from cbd.engine.grammar.matcher import GrammarCompiler, GrammarKind, GrammarSpec
    from cbd.errors import InvalidRequest

    conn = Connection(fd)
    memory_bytes = conn.recv()
    compiler = GrammarCompiler(None, vocab_size, (), cache_size=1, info=info, max_threads=1)
    limit = _address_space() + memory_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    conn.send("ready")
    while True:
        try:
            kind, source = conn.recv()
        except EOFError:  # the pool closed its end
            return 0
        try:
            compiled = compiler.compile(GrammarSpec(GrammarKind(kind), source))
            answer = ("ok", compiled.compiled.serialize_json())
        except InvalidRequest as exc:
            answer = ("memory", "") if "bad_alloc" in str(exc) else ("invalid", str(exc))
        except (MemoryError, RuntimeError):  # past its address space (xgrammar raises std::bad_alloc)
            answer = ("memory", "")
        conn.send(answer)
        if answer[0] == "memory":  # the library's state after a failed allocation is not trusted
            return 1


def fork_server(fd: int, checkpoint: Path, vocab_size: int, eos_token_ids: tuple[int, ...]) -> int:
    """Import the grammar library, build the tokenizer's info, answer b"ready", then fork and kill workers as
    asked (module docstring) until the pool closes its end."""
    die_with_parent()
    from cbd.engine.grammar.matcher import tokenizer_info  # the library, as each worker would import it
    from cbd.model.files import load_tokenizer

    tokenizer = load_tokenizer(checkpoint)
    if tokenizer is None:
        sys.exit(f"cbd grammar fork server: {checkpoint} has no tokenizer")
    info = tokenizer_info(tokenizer, vocab_size, eos_token_ids)
    control = socket.socket(fileno=fd)
    me = os.getpid()
    control.send(b"ready")
    workers: set[int] = set()
    while True:
        ready, _, _ = select.select([control], [], [], REAP_SECONDS)
        _reap(workers)
        if not ready:
            continue
        message, fds, _, _ = socket.recv_fds(control, REQUEST.size, 1)
        if not message:  # the pool closed its end: its workers go with this process
            return 0
        op, pid = REQUEST.unpack(message)
        if op == b"F":
            (worker_fd,) = fds
            try:
                child = os.fork()
            except OSError as exc:  # out of processes or memory: this request fails, the server goes on
                os.close(worker_fd)
                control.send(PID.pack(-(exc.errno or errno.EAGAIN)))
                continue
            if child == 0:
                code = 1
                try:
                    control.close()
                    die_with_parent()
                    if os.getppid() == me:  # else this server died before the line above: so does its worker
                        code = main(worker_fd, info, vocab_size)
                except BaseException:
                    traceback.print_exc()
                finally:
                    os._exit(code)
            os.close(worker_fd)
            workers.add(child)
            control.send(PID.pack(child))
        elif op == b"K" and pid in workers:  # not yet reaped: the pid is still this worker's
            os.kill(pid, signal.SIGKILL)


def _reap(workers: set[int]) -> None:
    for pid in list(workers):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done:
            workers.discard(pid)


if __name__ == "__main__":
    if len(sys.argv) != 6 or sys.argv[1] != "--fork-server":
        sys.exit("usage: python -m cbd.ipc.grammar_worker --fork-server FD CHECKPOINT VOCAB_SIZE EOS_IDS")
    eos = tuple(int(t) for t in sys.argv[5].split(",") if t)
    sys.exit(fork_server(int(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), eos))
