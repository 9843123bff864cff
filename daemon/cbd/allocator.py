"""The C allocator's settings that let a long-running process give memory back after bursts.

Why: with glibc's defaults a daemon process's RSS grows burst after burst and is never returned, although
every request's objects are freed (bench/soak.py, docs/BENCHMARKS.md). Two glibc behaviours cause most of
it: the mmap threshold is dynamic (after a large block is freed the threshold rises to its size, so later
buffers of that size come from the heap, where a long-lived small allocation above them pins the pages),
and every thread that allocates may get its own arena (each with its own fragmentation). A trim once the
process goes idle gives the heap's free pages back; a small arena count bounds the copies. A fixed mmap
threshold sends large buffers to mmap, which unmaps on free, but costs a page fault per page of each (a
third of CPU decode throughput at 128 KiB), so the daemon leaves it off by default. Elsewhere than glibc
these are no-ops.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time

log = logging.getLogger(__name__)

_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


_LIBC = _libc()


def configure(arena_max: int, mmap_threshold_kib: int) -> bool:
    """Apply the settings to this process (0 leaves glibc's default); False where not glibc."""
    if _LIBC is None:
        return False
    ok = True
    if mmap_threshold_kib > 0:
        ok &= bool(_LIBC.mallopt(_M_MMAP_THRESHOLD, mmap_threshold_kib * 1024))
    if arena_max > 0:
        ok &= bool(_LIBC.mallopt(_M_ARENA_MAX, arena_max))
    if not ok:
        log.warning("mallopt refused arena_max=%d mmap_threshold=%d KiB", arena_max, mmap_threshold_kib)
    return ok


def trim() -> bool:
    """Return the heap's free pages to the system (all arenas); True if some memory was released."""
    return bool(_LIBC.malloc_trim(0)) if _LIBC is not None else False


class IdleTrim:
    """When to trim: once per idle period, `delay` seconds after the last work (delay 0: never).

    The owner calls `busy()` whenever it works; `wait()` says how long until a trim is due (0: now; None:
    none pending); `trimmed()` records one. `poll()` does all of it for an owner that may trim in place.
    """

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self._last_busy: float | None = None
        self.trims = 0

    def busy(self, now: float | None = None) -> None:
        if self.delay > 0:
            self._last_busy = time.monotonic() if now is None else now

    def wait(self, now: float | None = None) -> float | None:
        if self._last_busy is None:
            return None
        now = time.monotonic() if now is None else now
        return max(0.0, self._last_busy + self.delay - now)

    def trimmed(self) -> None:
        self._last_busy = None
        self.trims += 1

    def poll(self, now: float | None = None) -> float | None:
        """Trim if due; the seconds until the next call is useful (None: not before the next `busy`)."""
        wait = self.wait(now)
        if wait != 0:
            return wait
        trim()
        self.trimmed()
        return None
