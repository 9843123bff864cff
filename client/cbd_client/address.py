"""Where the daemon listens by default; shared by the daemon and the client."""

from __future__ import annotations

import os


def default_address() -> str:
    """$CBD_ADDRESS, else a unix socket in $XDG_RUNTIME_DIR, else /tmp/cbd-<uid>.sock."""
    env = os.environ.get("CBD_ADDRESS")
    if env:
        return env
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return f"unix:{runtime}/cbd.sock"
    return f"unix:/tmp/cbd-{os.getuid()}.sock"
