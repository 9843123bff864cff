"""Grammar compile workers: one process per worker, forked from a process that has already imported the
grammar library.

`python -m cbd.ipc.grammar_worker --fork-server FD` (started by ipc/grammar_pool.py, one per pool) imports
xgrammar (and with it torch and transformers: two seconds of CPU) once, then on each request on its
control socket (a SOCK_SEQPACKET pair: `F` with the worker's socket attached, answered with the new
worker's pid; `K` with a pid) forks a worker or kills one of its own workers. It reaps its workers itself
and kills only a pid among its workers not yet reaped, so never another process (a `K` for a worker that
exited and was reaped could only reach a newer worker given the same pid, which sequential pids make a
matter of wrapping around pid_max first). Killing a worker whose compile overran therefore costs a fork to
replace, not a start.

A worker (`main`) talks to the pool over its own socket: messages are pickled by multiprocessing's
Connection: first the setup (the tokenizer's xgrammar info as JSON, the vocabulary size, the stop tokens,
the memory budget in bytes), answered with "ready"; then one `(kind, source)` per compile, answered with
`("ok", serialized)` or `("invalid", message)`. The address space it may grow by past its state after setup
is capped (RLIMIT_AS); an allocation beyond it fails (answered "memory", then the worker exits) or kills
the process, which the pool reads as the same. The pool has a worker killed when its compile runs past
its time budget or its request was cancelled. Every process here dies with its parent.
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

from cbd.lifetime import die_with_parent

_PAGE = 4096
REQUEST = struct.Struct("=cq")  # the fork server's requests: b"F" (a worker's socket attached) or b"K" and a pid
PID = struct.Struct("=q")  # its answer to b"F"
REAP_SECONDS = 1.0  # how often an idle fork server reaps its exited workers


def _address_space() -> int:
    """Bytes of address space this process maps now."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[0]) * _PAGE


def main(fd: int) -> int:
    die_with_parent()
    conn = Connection(fd)
    info_json, vocab_size, stop_token_ids, memory_bytes = conn.recv()
    import xgrammar as xgr

    from cbd.engine.grammar.matcher import GrammarCompiler, GrammarKind, GrammarSpec
    from cbd.errors import InvalidRequest

    info = xgr.TokenizerInfo.deserialize_json(info_json)
    compiler = GrammarCompiler(None, vocab_size, tuple(stop_token_ids), cache_size=1, info=info, max_threads=1)
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


def fork_server(fd: int) -> int:
    """Import the grammar library, answer b"ready", then fork and kill workers as asked (module docstring)
    until the pool closes its end."""
    die_with_parent()
    import xgrammar  # noqa: F401  (what each worker would otherwise import itself)

    from cbd.engine.grammar import matcher  # noqa: F401
    from cbd.errors import InvalidRequest  # noqa: F401

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
                        code = main(worker_fd)
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
    if sys.argv[1:2] != ["--fork-server"]:
        sys.exit("usage: python -m cbd.ipc.grammar_worker --fork-server FD (started by the frontend)")
    sys.exit(fork_server(int(sys.argv[2])))
