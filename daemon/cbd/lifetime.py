"""Linux process and thread lifetime helpers shared by every layer (no-ops where unsupported)."""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def _libc_prctl() -> Callable[..., int] | None:
    """libc's prctl (None where there is none)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _prctl(option: int, value: int | bytes) -> None:
    prctl = _libc_prctl()
    if prctl is not None:
        prctl(option, value, 0, 0, 0)


def die_with_parent() -> None:
    """This process gets SIGKILL when the thread that started it exits (so it is never orphaned)."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def signalled_with_parent(sig: int) -> Callable[[], None]:
    """A `preexec_fn` for `subprocess.Popen` in this process: the child gets `sig` when the thread that
    starts it exits, so a parent killed outright takes its children with it (one that died before the
    child set this up is noticed there: the child's parent is then another process). libc's prctl is looked
    up here, before any fork: the child only calls it."""
    prctl = _libc_prctl()
    if prctl is None:
        return lambda: None
    parent = os.getpid()

    def in_child() -> None:
        prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return in_child


def name_os_thread(name: str) -> None:
    """The name `top -H`, /proc and profilers show for the calling thread (at most 15 bytes)."""
    _prctl(_PR_SET_NAME, name.encode()[:15])
