"""The CPU thread count follows the cores other processes leave free (num_threads 0)."""

from __future__ import annotations

import os

import pytest

from cbd.engine import core_share
from cbd.engine.core_share import CoreShare


@pytest.mark.parametrize(
    ("cores", "others", "threads"),
    [(2, 0.0, 2), (2, 0.5, 2), (2, 0.65, 1), (2, 1.0, 1), (2, 3.0, 1), (8, 0.4, 8), (8, 2.5, 6), (8, 1.0, 7)],
)
def test_choose_gives_up_a_core_per_started_core_of_other_work(cores: int, others: float, threads: int) -> None:
    assert CoreShare(set(range(cores)), ()).choose(others) == threads


def test_sample_counts_only_other_processes_busy_time(monkeypatch: pytest.MonkeyPatch) -> None:
    tick = core_share._TICK
    clock = {"busy": 0, "ours": 0}
    monkeypatch.setattr(core_share, "_cpu_busy_ticks", lambda cpus: clock["busy"])
    monkeypatch.setattr(core_share, "_process_ticks", lambda pid: clock["ours"])
    share = CoreShare({0, 1}, (1,), interval=1.0)

    def second(busy: int, ours: int, now: float) -> int | None:
        clock["busy"] += busy * tick
        clock["ours"] += ours * tick
        return share.sample(now=now)

    assert share.sample(now=0.0) is None  # the first reading only starts the window
    assert second(2, 2, 1.0) is None and share.threads == 2  # both cores busy, all of it the daemon's own
    assert share.sample(now=1.5) is None  # not before the interval
    assert second(2, 1, 2.0) is None  # a neighbour took a core's worth: once is not enough
    assert second(2, 1, 3.0) == 1 and share.threads == 1  # twice in a row: one thread
    assert second(1, 1, 4.0) is None  # the neighbour is gone: once
    assert second(1, 1, 5.0) == 2 and share.threads == 2
    assert second(2, 1, 6.0) is None
    assert second(2, 0, 20.0) is None and second(2, 1, 21.0) is None  # a window across idle time only restarts
    assert second(2, 1, 22.0) == 1


def test_unreadable_proc_keeps_the_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(core_share, "_cpu_busy_ticks", lambda cpus: None)
    share = CoreShare({0, 1}, (1,), interval=1.0)
    assert share.sample(now=0.0) is None and share.sample(now=5.0) is None and share.threads == 2


def test_the_real_proc_files_are_read() -> None:
    assert core_share._cpu_busy_ticks({0}) is not None
    assert core_share._process_ticks(os.getpid()) > 0
