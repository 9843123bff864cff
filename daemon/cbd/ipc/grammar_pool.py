"""Grammar compiles in the frontend, in a bounded pool of worker processes with a time and a memory budget.

A spec is compiled once, here, and its compiled form crosses to the engine process serialized (xgrammar's
JSON), which loads it off its command thread (ipc/endpoint.py); nothing compiles in the engine process.
Why processes: a compile is one call into xgrammar's C++ that cannot be interrupted; some specs of a
few kilobytes take minutes or gigabytes (deep schemas, wide counted repetitions). A worker process can
be killed when its request's budget runs out or its client cancels, and its memory capped (RLIMIT_AS).
Workers are forked from one fork server per pool that has imported the grammar library and built the
tokenizer's grammar info once, so a worker killed over a budget is replaced in milliseconds, not by a
two-second start, and the frontend never loads the grammar library (nor torch, which it imports).

Invariants: at most `workers` compiles run at once (others wait in order, on the event loop, while
requests without a grammar are served as usual); a worker is either idle, running exactly one compile,
or being killed; time spent starting a worker is not charged to the request. Outcomes (compiled or
refused) are cached by the spec's text, bounded by count and by the bytes of compiled forms, so a
repeated schema costs a lookup and a repeated bomb is refused at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

from cbd.engine.grammar.matcher import NO_TOKENIZER, CompiledGrammar, GrammarSpec
from cbd.errors import EngineFailure, InvalidRequest
from cbd.ipc.grammar_worker import PID, REQUEST

log = logging.getLogger(__name__)
MAX_CACHED_BYTES = 256 * 2**20  # compiled forms kept at most (besides the count bound)
FORK_TIMEOUT = 30.0  # seconds the fork server may take to answer (a fork takes milliseconds)
START_TIMEOUT = 300.0  # seconds it may take to start (importing the grammar library, building the info)


@dataclass(frozen=True, slots=True)
class GrammarSource:
    """What the workers' fork server builds the tokenizer's grammar info from."""

    checkpoint_dir: Path | None  # the checkpoint whose tokenizer the frontend loaded; None: the model has none
    vocab_size: int
    eos_token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CompileBudget:
    workers: int = 2  # compiles at once
    timeout: float = 10.0  # seconds one compile may run
    memory_mib: int = 1024  # MiB of address space one compile may add to its worker


class _ForkServer:
    """The process that forks the compile workers (ipc/grammar_worker.py), and the frontend's end of its
    control socket (one request at a time)."""

    def __init__(self, source: GrammarSource) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        eos = ",".join(str(t) for t in source.eos_token_ids)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "cbd.ipc.grammar_worker", "--fork-server", str(theirs.fileno()),
             str(source.checkpoint_dir), str(source.vocab_size), eos],
            pass_fds=[theirs.fileno()],
        )  # fmt: skip
        theirs.close()
        ours.settimeout(FORK_TIMEOUT)
        self._control = ours
        self._lock = threading.Lock()

    def wait_ready(self) -> None:
        """Until the server has imported the grammar library and built the tokenizer's info (seconds)."""
        self._control.settimeout(START_TIMEOUT)
        try:
            ready = self._control.recv(16)
        except OSError:  # a timeout among them
            ready = b""
        finally:
            self._control.settimeout(FORK_TIMEOUT)
        if ready != b"ready":
            raise EngineFailure(
                f"the grammar compile workers' fork server did not start (exit status {self.process.poll()})"
            )

    def fork(self, worker_socket: socket.socket) -> int:
        """A new worker on `worker_socket` (its end); its pid."""
        with self._lock:
            try:
                socket.send_fds(self._control, [REQUEST.pack(b"F", 0)], [worker_socket.fileno()])
                answer = self._control.recv(PID.size)
            except OSError:
                answer = b""
        if len(answer) != PID.size:
            raise EngineFailure("the grammar compile workers' fork server exited")
        (pid,) = PID.unpack(answer)
        if pid <= 0:
            raise EngineFailure(f"the grammar compile workers' fork server could not fork: {os.strerror(-pid)}")
        return int(pid)

    def kill(self, pid: int) -> None:
        """The server kills its worker `pid` if it has not reaped it yet (never another process)."""
        with self._lock:
            try:
                self._control.send(REQUEST.pack(b"K", pid))
            except OSError:  # the server is gone, and its workers with it
                pass

    def close(self) -> None:
        """Its workers die with it."""
        self.process.kill()
        self.process.wait()
        self._control.close()


class _Worker:
    """One worker process and the frontend's end of its socket pair (used by one thread at a time)."""

    def __init__(self, server: _ForkServer, memory_bytes: int) -> None:
        ours, theirs = socket.socketpair()
        try:
            self.pid = server.fork(theirs)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._server = server
        self._killed = False
        self.conn = Connection(ours.detach())
        self.conn.send(memory_bytes)

    def wait_ready(self) -> None:
        if self.conn.recv() != "ready":
            raise EngineFailure("a grammar compile worker did not start")

    def call(self, spec: GrammarSpec) -> tuple[str, str]:
        """Raises EOFError or OSError if the worker died (or was killed) meanwhile."""
        self.conn.send((spec.kind.value, spec.source))
        return self.conn.recv()

    def kill(self) -> None:
        """A thread blocked in call() then reads EOF (the socket is closed by the worker's death, never
        here: closing a descriptor another thread reads is a race)."""
        if not self._killed:
            self._killed = True
            self._server.kill(self.pid)

    def reap(self) -> None:
        """Close the frontend's end (the fork server reaps the process)."""
        self.conn.close()


class GrammarPool:
    def __init__(self, source: GrammarSource, budget: CompileBudget, cache_size: int = 256) -> None:
        self.budget = budget
        self._source = source
        self._setup_lock = asyncio.Lock()
        self._server: _ForkServer | None = None
        self._slots = asyncio.Semaphore(budget.workers)
        self._idle: list[_Worker] = []
        self._workers: set[_Worker] = set()  # every live worker, idle or busy
        self._threads = ThreadPoolExecutor(2 * budget.workers, thread_name_prefix="cbd-grammar")
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar | InvalidRequest] = OrderedDict()
        self.cached_bytes = 0  # of the cached outcomes (the metrics read it)
        self._cache_size = cache_size
        self.num_killed = 0  # workers killed over a budget or a cancel (tests read it)
        self.num_compiling = 0  # compiles running in a worker now

    async def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The spec compiled (serialized form only); InvalidRequest for a bad spec or one over a budget.
        Cancelling the caller stops its compile (the worker is killed)."""
        hit = self._cache.get(spec)
        if hit is None:
            async with self._slots:
                hit = self._cache.get(spec) or await self._run(spec)
            self._remember(spec, hit)
        else:
            self._cache.move_to_end(spec)
        if isinstance(hit, InvalidRequest):
            raise InvalidRequest(str(hit))
        return hit

    async def _run(self, spec: GrammarSpec) -> CompiledGrammar | InvalidRequest:
        loop = asyncio.get_running_loop()
        worker = self._idle.pop() if self._idle else await self._spawn()
        job = loop.run_in_executor(self._threads, worker.call, spec)
        self.num_compiling += 1
        try:
            done, _ = await asyncio.wait({job}, timeout=self.budget.timeout)
        except asyncio.CancelledError:
            self._discard(worker, job)
            raise
        finally:
            self.num_compiling -= 1
        if not done:
            self._discard(worker, job)
            return InvalidRequest(
                f"the {spec.kind.value} did not compile within the grammar compile budget of "
                f"{self.budget.timeout:g} s (grammar_compile_timeout)"
            )  # fmt: skip
        try:
            status, value = job.result()
        except (EOFError, OSError):
            if self._server is not None and self._server.process.poll() is not None:
                # The fork server died (and its workers with it): no verdict on the spec, none cached.
                self._discard(worker)
                for idle in self._idle:
                    self._discard(idle)
                self._idle.clear()
                raise EngineFailure("the grammar compile workers' fork server exited") from None
            status, value = "memory", ""
        if status == "memory":
            self._discard(worker)
            return InvalidRequest(
                f"compiling the {spec.kind.value} went over the grammar compile memory budget of "
                f"{self.budget.memory_mib} MiB (grammar_compile_memory_mib)"
            )  # fmt: skip
        self._idle.append(worker)
        if status == "invalid":
            return InvalidRequest(value)
        return CompiledGrammar(spec, None, value)

    async def _spawn(self) -> _Worker:
        loop = asyncio.get_running_loop()
        if self._source.checkpoint_dir is None:
            raise InvalidRequest(NO_TOKENIZER)
        async with self._setup_lock:
            if self._server is None or self._server.process.poll() is not None:
                if self._server is not None:
                    self._server.close()
                server = _ForkServer(self._source)  # started from the event loop's thread: dies with this process
                try:
                    await loop.run_in_executor(self._threads, server.wait_ready)
                except BaseException:
                    server.close()
                    raise
                self._server = server
        worker = _Worker(self._server, self.budget.memory_mib * 2**20)  # a fork: milliseconds, on this thread
        self._workers.add(worker)
        try:
            await loop.run_in_executor(self._threads, worker.wait_ready)
        except BaseException:
            self._discard(worker)
            raise
        return worker

    def _discard(self, worker: _Worker, job: asyncio.Future | None = None) -> None:
        """Kill the worker; its descriptor is closed once no thread reads it (after `job`, if any)."""
        self.num_killed += 1
        self._workers.discard(worker)
        worker.kill()
        if job is None:
            self._threads.submit(worker.reap)
            return

        def after(f: asyncio.Future) -> None:
            if not f.cancelled():
                f.exception()  # EOF from the killed worker: expected, retrieved so that it is not logged
            self._threads.submit(worker.reap)

        job.add_done_callback(after)

    def _remember(self, spec: GrammarSpec, outcome: CompiledGrammar | InvalidRequest) -> None:
        if spec in self._cache:
            return
        self._cache[spec] = outcome
        self.cached_bytes += _size(outcome)
        while len(self._cache) > self._cache_size or self.cached_bytes > MAX_CACHED_BYTES:
            _, old = self._cache.popitem(last=False)
            self.cached_bytes -= _size(old)

    def close(self) -> None:
        """Kill every worker with their fork server (a thread waiting on a busy one then reads EOF and ends)."""
        if self._server is not None:
            self._server.close()
        for worker in self._idle:
            worker.reap()
        self._workers.clear()
        self._idle.clear()
        self._threads.shutdown(wait=False, cancel_futures=True)


def _size(outcome: CompiledGrammar | InvalidRequest) -> int:
    return len(outcome.serialized or "") if isinstance(outcome, CompiledGrammar) else 0
