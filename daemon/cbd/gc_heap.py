"""The cyclic garbage collector after start-up: what start-up built is left out of every later collection.

Why: a collection of a generation walks every object tracked in it, and a full collection walks them all.
Start-up leaves hundreds of thousands of container objects that live as long as the process (the model's
modules, torch's and Triton's caches of compiled kernels and graphs, the tokenizer, gRPC's and protobuf's
descriptors), while every step allocates short-lived ones (each request's output structs and lists), and
those allocations are what set collections off. `freeze()` collects once, then moves everything alive into
the permanent generation, which the collector never walks again: later collections cost what the
requests' own objects cost. Called by each daemon process once it has started (the engine process after
its warm-up, the frontend when it starts serving); objects made later are collected as before, less often:
a step at a large batch allocates thousands of small objects (outputs, deltas, rows), nearly all freed by
their reference counts within the step, and the default thresholds (a young collection every 700
allocations) spent a quarter of the engine thread's output phase at B = 256 walking the few that live on
(bench/host_cost_cpu.py). Only the young threshold moves: a finished request is a reference cycle (the
request and its sequences) that only the collector frees, so the older generations keep their default
ratios and a full collection still comes every half a million allocations (a few hundred steps at B = 256).

`paused()` keeps the collector out of a block that must make no CUDA call but its own: a collection can
run any finalizer, and a finalizer that frees a CUDA object (an earlier engine's graphs, events or
streams, collected from a reference cycle) invalidates a CUDA graph being captured.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

# Collection thresholds after start-up: young objects, then collections of the younger generation per older one.
THRESHOLDS = (5000, 10, 10)


def freeze() -> int:
    """Collect once, then keep every object now alive out of later collections (and collect less often);
    how many were frozen."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
    return gc.get_freeze_count()


@contextmanager
def paused() -> Iterator[None]:
    """Collect once, then no automatic collection until the block ends (the collector's state restored)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
