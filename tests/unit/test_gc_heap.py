"""cbd/gc_heap.py: start-up's garbage is collected, what is alive is frozen, later garbage still goes."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from cbd import gc_heap


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> _Node:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return a


@pytest.fixture
def unfrozen() -> Iterator[None]:
    """No automatic collection during the test (the only ones are those it makes); thawed, and the
    thresholds as they were, after."""
    thresholds = gc.get_threshold()
    gc.disable()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
        gc.enable()


def test_freeze_collects_start_up_garbage_first_and_keeps_the_living_out_of_collections(unfrozen: None) -> None:
    garbage = weakref.ref(_cycle())  # unreachable, but alive until a collection finds the cycle
    living = _cycle()
    assert garbage() is not None
    frozen = gc_heap.freeze()
    assert garbage() is None  # collected, not frozen for the process's life
    # What it froze, less the few frozen objects another thread (the test runner's) may have freed since.
    assert frozen > 1000 and frozen - 1000 < gc.get_freeze_count() <= frozen
    assert all(living is not o for o in gc.get_objects())  # in the permanent generation, never walked


def test_cycles_made_after_the_freeze_are_still_collected(unfrozen: None) -> None:
    gc_heap.freeze()
    later = weakref.ref(_cycle())
    gc.collect()
    assert later() is None


def test_after_the_freeze_young_cycles_are_collected_automatically_past_the_raised_threshold(unfrozen: None) -> None:
    gc_heap.freeze()
    assert gc.get_threshold() == gc_heap.THRESHOLDS
    gc.enable()
    later = weakref.ref(_cycle())
    kept = [_Node() for _ in range(2 * gc_heap.THRESHOLDS[0])]  # past the young generation's threshold
    assert later() is None  # no explicit collection: the automatic one found it
    del kept


def test_paused_collects_first_then_none_until_the_block_ends() -> None:
    garbage = weakref.ref(_cycle())
    assert gc.isenabled()
    with gc_heap.paused():
        assert garbage() is None  # collected on entry
        assert not gc.isenabled()
        inside = weakref.ref(_cycle())
        kept = [_Node() for _ in range(100_000)]  # far past the first generation's threshold
        assert inside() is not None  # yet no collection ran
        del kept
    assert gc.isenabled()
    gc.collect()
    assert inside() is None
