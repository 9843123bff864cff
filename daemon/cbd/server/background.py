"""`cbd serve --detach` and `cbd stop`: run the daemon in the background and stop exactly that daemon.

Detach forks before any thread exists (before gRPC or the engine start): the parent waits on a pipe until
the child listens (or fails to), prints the child's pid and exits with the child's start-up status; the
child leaves the terminal's session and logs to a file. `cbd stop` finds the daemon behind a unix socket by
the socket's peer credentials (the kernel's record of who listens there), or reads a pid file, and signals
only that process: never another user's daemon, never another socket's.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from cbd.server.sockets import peer_pid, unix_path

Report = Callable[[int, str], None]  # (exit status, message): 0 once listening, else the start-up failure


def detach(log_file: str) -> Report:
    """Fork. The parent never returns (it exits with the child's report); the child gets the reporter."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid:
        os.close(write_fd)
        with os.fdopen(read_fd, "r") as pipe:
            line = pipe.read()
        status, _, message = line.partition(" ")
        if not status.isdigit():  # the child died before reporting
            print(f"cbd: the daemon exited during start-up; see {log_file}", file=sys.stderr)
            raise SystemExit(1)
        if int(status) == 0:
            print(pid)
            print(f"cbd: serving in the background (pid {pid}) on {message}; logs: {log_file}; "
                  f"stop it with {_stop_command(message.split(', '), pid)}", file=sys.stderr)  # fmt: skip
        else:
            print(f"cbd: {message}", file=sys.stderr)
        raise SystemExit(int(status))
    os.close(read_fd)
    os.setsid()  # no controlling terminal: closing it sends no SIGHUP
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    reported = False

    def report(status: int, message: str) -> None:
        nonlocal reported
        if reported:
            return
        reported = True
        os.write(write_fd, f"{status} {message}".encode())
        os.close(write_fd)

    return report


def _stop_command(addresses: list[str], pid: int) -> str:
    """How to stop the daemon that listens on `addresses`: `cbd stop` names its unix socket unless it is
    the default one; a daemon on TCP alone is stopped by its pid."""
    from cbd.server.settings import default_listen

    unix = [a for a in addresses if a.startswith("unix:")]
    if not unix:
        return f"`kill {pid}` (or start it with --pid-file and use `cbd stop --pid-file FILE`)"
    return "`cbd stop`" if unix[0] == default_listen() else f"`cbd stop {unix[0]}`"


def stop(address: str, pid_file: str | None, timeout: float) -> int:
    """Send SIGTERM to the daemon behind `address` (or in `pid_file`) and wait for it to exit."""
    if pid_file:
        try:
            pid = int(Path(pid_file).read_text().strip())
        except (OSError, ValueError) as exc:
            print(f"cbd stop: cannot read a pid from {pid_file}: {exc}", file=sys.stderr)
            return 1
        where = f"pid file {pid_file}"
    else:
        path = unix_path(address)
        if path is None:
            print(f"cbd stop: {address} is not a unix socket; give the daemon's --pid-file", file=sys.stderr)
            return 1
        found = peer_pid(path)
        if found is None:
            print(f"cbd stop: no daemon is listening on {address}", file=sys.stderr)
            return 1
        pid, where = found, address
    if not _is_cbd(pid):
        print(f"cbd stop: process {pid} ({where}) is not a cbd daemon; not signalling it", file=sys.stderr)
        return 1
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        print(f"cbd stop: process {pid} ({where}) has already exited", file=sys.stderr)
        return 0
    except PermissionError:
        print(f"cbd stop: not allowed to signal pid {pid} ({where}): it belongs to another user", file=sys.stderr)
        return 1
    deadline = time.monotonic() + timeout
    while _alive(pid):
        if time.monotonic() > deadline:
            print(f"cbd stop: pid {pid} ({where}) still running after {timeout:.0f}s", file=sys.stderr)
            return 1
        time.sleep(0.1)
    print(f"cbd stop: stopped pid {pid} ({where})", file=sys.stderr)
    return 0


def _is_cbd(pid: int) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(part.endswith((b"cbd", b"cbd.server.app")) for part in argv) and b"serve" in argv


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited; its parent reaps it later
