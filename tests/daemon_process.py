"""Start a real `cbd serve` process on a temporary unix socket and watch its health and its processes.

`serving()` is the one way a fixture starts a daemon it shares (module or session scope): it waits until the
daemon serves and, at the end, asserts that it stopped cleanly. Tests that kill, drain or signal their daemon
start their own through conftest's `tiny_daemon` factory, which only stops what is still running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat after the command name: [0] the state, [1] the parent, [6] the flags, [11:13] CPU ticks."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int(stat_fields(int(entry.name))[1])
            except OSError:
                continue
            if parent == pid:
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        os.kill(pid, 0)
        state = stat_fields(pid)[0]
    except (ProcessLookupError, FileNotFoundError):
        return False
    return state != "Z"


PF_EXITING = 0x4  # a process's flag (/proc/PID/stat, field 9) from the moment it begins to exit


def exiting(pid: int) -> bool:
    """The process has begun to exit (killed, say) or is gone: it runs no more code of its own."""
    try:
        fields = stat_fields(pid)
    except (FileNotFoundError, ProcessLookupError):  # gone (reaped before or while it was read)
        return True
    return fields[0] in ("Z", "X") or bool(int(fields[6]) & PF_EXITING)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process, all its threads (from /proc)."""
    fields = stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    """A process's resident memory (VmRSS), from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS line for {pid}")


def _children_running(pid: int, module: str) -> list[int]:
    found = []
    for child in children(pid):
        try:
            if module in Path(f"/proc/{child}/cmdline").read_text() and alive(child):
                found.append(child)
        except FileNotFoundError:
            continue
    return found


class DaemonProcess:
    def __init__(self, socket_path: Path, *flags: str, env: dict[str, str] | None = None) -> None:
        self.address = f"unix:{socket_path}"
        self.log_path = socket_path.with_suffix(".log")
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "cbd.server.app", "serve", "--listen", self.address, *flags],
            stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
        )  # fmt: skip
        self.health_seen: list[str] = []

    def health(self, timeout: float = 1.0) -> str | None:
        with grpc.insecure_channel(self.address) as channel:
            try:
                response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            except grpc.RpcError:
                return None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def wait_serving(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.process.returncode}:\n{self.log()}")
            status = self.health()
            if status is not None and (not self.health_seen or self.health_seen[-1] != status):
                self.health_seen.append(status)
            if status == "SERVING":
                return
            time.sleep(0.05)
        raise TimeoutError(f"daemon not serving after {timeout}s:\n{self.log()}")

    def stop(self, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.terminate()
        try:
            return self.process.wait(timeout)
        finally:
            self._log.close()

    def engine_pid(self) -> int:
        (pid,) = _children_running(self.process.pid, "cbd.server.engine_main")
        return pid

    @contextmanager
    def engine_paused(self) -> Iterator[int]:
        """The engine process stopped (SIGSTOP) for the block, continued at its end: the frontend admits and
        counts calls but no step runs, so a test holds as many calls live as it needs without racing the
        engine (a tiny model's 450 tokens take a tenth of a second)."""
        pid = self.engine_pid()
        os.kill(pid, signal.SIGSTOP)
        try:
            yield pid
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def grammar_worker_pids(self) -> list[int]:
        """The frontend's live grammar compile workers: the children of its workers' fork server
        (ipc/grammar_pool.py)."""
        servers = _children_running(self.process.pid, "cbd.ipc.grammar_worker")
        workers = [pid for server in servers for pid in _children_running(server, "cbd.ipc.grammar_worker")]
        return [pid for pid in workers if not exiting(pid)]  # a killed one tearing its memory down runs nothing

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()


class DaemonFactory:
    """Starts real daemons (`cbd serve`) serving one checkpoint, each on its own socket in one directory, and
    stops every one still running at the end: the one factory behind every test that needs a daemon of its
    own (one that changes flags, kills, drains, signals or restarts it)."""

    def __init__(self, directory: Path, model: str | None) -> None:
        self.directory, self.model = directory, model
        self.started: list[DaemonProcess] = []

    def __call__(self, *flags: str, env: dict[str, str] | None = None, socket_name: str = "cbd.sock") -> DaemonProcess:
        model = ("--model", self.model) if self.model else ()
        d = DaemonProcess(self.directory / socket_name, *model, *flags, env=env)
        self.started.append(d)
        d.wait_serving(120 if self.model else 300)
        return d

    def stop_all(self) -> None:
        for d in self.started:
            d.stop()


@contextmanager
def serving(
    directory: Path, *flags: str, model: str | None = None, env: dict[str, str] | None = None, timeout: float = 300.0
) -> Iterator[DaemonProcess]:
    """A daemon on `directory`/cbd.sock (`model`: a checkpoint; None: the embedded default model), serving
    until the block ends; it must then exit 0 (a shared daemon that crashed fails its fixture's last user)."""
    d = DaemonProcess(directory / "cbd.sock", *(("--model", model) if model else ()), *flags, env=env)
    try:
        d.wait_serving(timeout)
        yield d
    finally:
        assert d.stop() == 0, d.log()[-4000:]


class CallInThread(threading.Thread):
    """One streaming call (the client's `stream`) read to its end on a thread of its own; `ended` holds what
    ended it: the client's error, or None for an end without one."""

    def __init__(self, address: str, prompt: list[int], **options: object) -> None:
        super().__init__(daemon=True)
        self.address, self.prompt, self.options = address, prompt, options
        self.ended: list[BaseException | None] = []

    def run(self) -> None:
        from cbd_client import CbdError, Client

        with Client(self.address, timeout=120) as client:
            try:
                for _ in client.stream(self.prompt, **self.options):
                    pass
            except CbdError as exc:
                self.ended.append(exc)
            else:
                self.ended.append(None)


class BackgroundStream:
    """A long greedy Generate stream read on its own thread; `tokens` counts what has arrived, so a test
    can tell whether the engine kept advancing it while something else went on."""

    def __init__(self, address: str, prompt: str = "Tell me a long story.", max_tokens: int = 4000) -> None:
        from cbd_client.v1 import cbd_pb2 as pb
        from cbd_client.v1.cbd_pb2_grpc import CbdStub

        request = pb.GenerateRequest(text=prompt)
        request.sampling.max_tokens, request.sampling.temperature, request.sampling.ignore_eos = max_tokens, 0.0, True
        self._channel = grpc.insecure_channel(address)
        self._call = CbdStub(self._channel).Generate(request, timeout=600)
        self.tokens = 0
        self.error: grpc.RpcError | None = None
        self._first = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        assert self._first.wait(300), "the stream sent nothing"

    def _read(self) -> None:
        try:
            for response in self._call:
                self.tokens += sum(len(c.token_ids) for c in response.candidates)
                self._first.set()
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self._first.set()

    def stop(self) -> None:
        """Cancel the rest; the stream must not have failed before."""
        self._call.cancel()
        self._thread.join(60)
        self._channel.close()
        if self.error is not None and self.error.code() != grpc.StatusCode.CANCELLED:
            raise AssertionError(f"the background stream failed: {self.error.code()} {self.error.details()}")
