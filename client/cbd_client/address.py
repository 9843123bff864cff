"""Where the daemon listens by default; shared by the daemon and the client (and a free TCP port for tools)."""

from __future__ import annotations

import os
import socket


def default_address() -> str:
    """$CBD_ADDRESS, else a unix socket in $XDG_RUNTIME_DIR, else /tmp/cbd-<uid>.sock."""
    env = os.environ.get("CBD_ADDRESS")
    if env:
        return env
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return f"unix:{runtime}/cbd.sock"
    return f"unix:/tmp/cbd-{os.getuid()}.sock"


def tls_credentials(ca: str, cert: str | None = None, key: str | None = None):
    """Channel credentials from PEM files: the CA that signed the daemon, and optionally our own cert/key."""
    import grpc

    def read(path: str | None) -> bytes | None:
        if path is None:
            return None
        with open(path, "rb") as f:
            return f.read()

    return grpc.ssl_channel_credentials(read(ca), read(key), read(cert))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for tests, benchmarks and deploy/cluster.py)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
