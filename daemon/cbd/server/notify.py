"""systemd's sd_notify protocol (Type=notify units), without a libsystemd dependency."""

from __future__ import annotations

import os
import socket


def sd_notify(state: str) -> bool:
    """Send e.g. "READY=1" to $NOTIFY_SOCKET; False when not run by systemd."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # abstract namespace
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.connect(address)
        sock.sendall(state.encode())
    return True
