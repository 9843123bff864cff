"""One daemon per address: claim a unix socket path or a TCP port before binding it, release it on exit.

A unix socket is claimed by an exclusive `flock` on `<path>.lock`, held for the life of the process (the
kernel drops it when the process dies, however it dies). With the lock held, a socket file that nothing
answers on is stale and is removed; one that answers belongs to some other program and is left alone. On
exit the socket file is removed only if it is still the one this process bound (same inode). TCP ports are
bound without SO_REUSEPORT, so a second daemon on a port fails to bind instead of sharing it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
import struct
from pathlib import Path


class AddressInUse(Exception):
    """Another process serves this address."""


def unix_path(address: str) -> Path | None:
    if not address.startswith("unix:"):
        return None
    return Path(address.removeprefix("unix:").removeprefix("//"))


def peer_pid(path: Path, timeout: float = 1.0) -> int | None:
    """The pid of the process listening on a unix socket (SO_PEERCRED), or None when nothing answers."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect(str(path))
        except OSError:
            return None
        pid, _uid, _gid = struct.unpack(
            "3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        )
        return pid


class UnixSocketClaim:
    def __init__(self, address: str) -> None:
        path = unix_path(address)
        if path is None:
            raise ValueError(f"not a unix address: {address}")
        self.address = address
        self.path = path
        self.lock_path = path.with_name(path.name + ".lock")
        self._lock_fd: int | None = None
        self._inode: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise
            raise AddressInUse(self._in_use("another cbd daemon")) from None
        self._lock_fd = fd
        try:
            mode = self.path.lstat().st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(mode):
            self.release()
            raise AddressInUse(f"{self.path} exists and is not a socket; remove it or listen elsewhere")
        if peer_pid(self.path) is not None:
            self.release()
            raise AddressInUse(self._in_use("another process"))
        self.path.unlink()  # stale: left by a process that died without removing it

    def bound(self) -> None:
        """Call once the server has created the socket: only this inode is removed on release."""
        self._inode = self.path.stat().st_ino

    def release(self) -> None:
        if self._inode is not None:
            try:
                if self.path.stat().st_ino == self._inode:
                    self.path.unlink()
            except FileNotFoundError:
                pass
            self._inode = None
        if self._lock_fd is not None:
            self.lock_path.unlink(missing_ok=True)
            os.close(self._lock_fd)
            self._lock_fd = None

    def _in_use(self, who: str) -> str:
        pid = peer_pid(self.path)
        owner = f" (pid {pid})" if pid is not None else ""
        return (
            f"{who}{owner} already serves {self.address}; stop it first (`cbd stop {self.address}`) or listen elsewhere"
        )


def tcp_port_taken(address: str) -> bool:
    """Whether a TCP address (HOST:PORT) is already listened on here: a bind of it (SO_REUSEADDR, as gRPC
    binds, so that closing connections do not count) fails with EADDRINUSE. Checked before gRPC binds, whose
    own refusal also logs a line of its own; a port taken between the two is still refused by gRPC."""
    name, _, port = address.rpartition(":")
    host = name.strip("[]") or None  # no host: every address, as gRPC takes ":PORT"
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, ValueError):
        return False  # not resolvable or not a port: gRPC says what is wrong
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return True
    return False


def describe_bind_failure(address: str, error: Exception | None) -> str:
    if unix_path(address) is not None:
        return f"cannot listen on {address}: {error}"
    return f"cannot listen on {address}: the port is in use (another cbd daemon or another program), or the host is not an address of this machine"
