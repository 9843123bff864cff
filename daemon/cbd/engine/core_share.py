"""The intra-op thread count on a CPU host that other processes share (`num_threads` 0).

Why: torch's OpenMP workers spin-wait between operations, so on a host whose cores are busy with other
processes every parallel region waits for a descheduled worker: beside one CPU-bound process on 2 cores
a request took 6-8x longer with both cores' threads than with one (bench/threads_cpu.py). Sleeping the
workers sooner cures that but costs an idle host's throughput. So the engine keeps spinning workers and
runs on the cores the others leave free: every `interval` seconds it reads how busy its allowed cores
were (/proc/stat) and how much of that was the daemon itself (its engine and frontend processes,
/proc/<pid>/stat), and gives up one core for each started core's worth of other work beyond 0.5 (a
CPU-bound neighbour that its spinning squeezes still shows ~0.67; a light client does not), at least one
thread left, once two working intervals in a row agree (a burst of other work does not flip it). Three
small file reads per interval, between steps. Where /proc cannot be read the count stays as configured.
"""

from __future__ import annotations

import logging
import math
import os
import time

import torch

log = logging.getLogger(__name__)

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_busy_ticks(cpus: set[int]) -> int | None:
    """Busy ticks (everything but idle and iowait) of these CPUs since boot."""
    busy = 0
    try:
        with open("/proc/stat") as f:
            for line in f:
                name, *values = line.split()
                if not name.startswith("cpu") or name == "cpu":
                    continue
                if int(name[3:]) in cpus:
                    ticks = [int(v) for v in values[:8]]
                    busy += sum(ticks) - ticks[3] - ticks[4]
    except (OSError, ValueError, IndexError):
        return None
    return busy


def _process_ticks(pid: int) -> int:
    """User + system ticks of a process (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, ValueError, IndexError):
        return 0


class CoreShare:
    """Chooses the thread count from the cores other processes left free over the last interval."""

    def __init__(self, cores: set[int], pids: tuple[int, ...], interval: float = 2.0) -> None:
        self.cores, self.pids, self.interval = cores, pids, interval
        self.threads = len(cores)
        self._next = 0.0
        self._last: tuple[float, int, int] | None = None  # (time, busy ticks, the daemon's ticks)
        self._wanted: int | None = None  # what the last interval called for

    def adapt(self, now: float | None = None) -> None:
        """Between steps: resize torch's thread pool when the free cores changed."""
        if (threads := self.sample(now)) is not None:
            torch.set_num_threads(threads)

    def sample(self, now: float | None = None) -> int | None:
        """A new thread count when two intervals in a row called for it, else None. Only intervals the
        engine spent working count (it samples only then): a window that spans an idle stretch says
        nothing about the cores while it works, so it only starts a new window."""
        now = time.monotonic() if now is None else now
        if now < self._next:
            return None
        self._next = now + self.interval
        busy = _cpu_busy_ticks(self.cores)
        if busy is None:
            return None
        ours = sum(_process_ticks(pid) for pid in self.pids)
        last, self._last = self._last, (now, busy, ours)
        if last is None or now <= last[0] or now - last[0] > 2 * self.interval:
            self._wanted = None
            return None
        others = max(0.0, ((busy - last[1]) - (ours - last[2])) / _TICK / (now - last[0]))
        threads = self.choose(others)
        wanted, self._wanted = self._wanted, threads
        if threads == self.threads or wanted != threads:
            return None
        log.info("intra-op threads %d -> %d: other processes kept %.1f of %d cores busy",
                 self.threads, threads, others, len(self.cores))  # fmt: skip
        self.threads = threads
        return threads

    def choose(self, others_busy: float) -> int:
        """One core fewer for each started core's worth of other work beyond 0.5, at least one."""
        return max(1, len(self.cores) - math.ceil(max(0.0, others_busy - 0.5)))
