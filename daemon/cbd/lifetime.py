"""Linux process and thread lifetime helpers shared by every layer (no-ops where unsupported)."""

from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def _prctl(option: int, value: int | bytes) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):
        return


def die_with_parent() -> None:
    """This process gets SIGKILL when the thread that started it exits (so it is never orphaned)."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def name_os_thread(name: str) -> None:
    """The name `top -H`, /proc and profilers show for the calling thread (at most 15 bytes)."""
    _prctl(_PR_SET_NAME, name.encode()[:15])
