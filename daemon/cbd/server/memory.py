"""The frontend's side of memory that plateaus: its allocator settings, its idle trim, and the resident
memory of both daemon processes for the metrics (cbd/allocator.py says why)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

from cbd import allocator
from cbd.config import EngineConfig

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def configure(config: EngineConfig) -> None:
    allocator.configure(config.malloc_arena_max, config.malloc_mmap_threshold_kib)


def resident_bytes(pid: int) -> int | None:
    """A process's resident set size (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


async def trim_when_idle(work: Callable[[], tuple[int, int]], trim: allocator.IdleTrim, interval: float = 1.0) -> None:
    """Trim the frontend's heap once per idle period (`trim.delay` seconds without work after some), in a
    worker thread so that the event loop keeps answering; `trim.trims` counts them. work(): the live
    requests and the engine's steps so far: work was done while requests live or steps were taken (a
    burst shorter than `interval` is seen by its steps)."""
    if trim.delay <= 0:
        return
    loop = asyncio.get_running_loop()
    steps = work()[1]
    while True:
        live, now = work()
        if live or now != steps:
            trim.busy()
        steps = now
        if trim.wait() == 0:
            await loop.run_in_executor(None, allocator.trim)
            trim.trimmed()
        await asyncio.sleep(interval)
