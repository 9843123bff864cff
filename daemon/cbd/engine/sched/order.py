"""Who is considered first: priority classes (with aging), fair share of seats between tenants, and turns
that bring their KV before prompts computed from scratch.

A sequence's class is its request's priority, or interactive once it has been queued `aging_seconds`
(for admission and for preemption alike), so under any interactive load a batch request runs within that
time plus the wait of the interactive requests queued before that moment. `AdmissionOrder` is the order
in which one step considers waiting sequences: by class, then the tenant with the fewest seats running or
admitted so far this step, then, within a class and tenant, those that bring their KV first (`brings_kv`:
a session turn whose history is on the GPU or the host tier, a sequence set aside there, with at most
WARM_TOKENS left to compute), then queue order. A turn that brings its KV costs a step a few hundred
tokens where a prompt computed from scratch costs thousands, and while it waits its KV holds the pools
(or is evicted, and recomputed); a sequence that brings none is overtaken so only until it has waited
`warm_first_seconds` (`--warm-first-seconds`; 0: never). With one class and one tenant and no KV
brought it is the queue's order. Pure Python.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from cbd.engine.sampling_params import PRIORITY_INTERACTIVE
from cbd.engine.sequence import Sequence

WARM_TOKENS = 2048  # at most this many tokens left to compute beyond the KV a sequence brings: it goes first


def urgency(seq: Sequence, now: float, aging_seconds: float) -> int:
    """The class seq is scheduled in: its request's priority, or interactive once it has aged."""
    request = seq.request
    if request.priority == PRIORITY_INTERACTIVE:
        return PRIORITY_INTERACTIVE
    if request.queued_at is not None and now - request.queued_at >= aging_seconds:
        return PRIORITY_INTERACTIVE
    return request.priority


def brings_kv(seq: Sequence) -> bool:
    """seq holds its history's KV (GPU blocks, or a copy on the host tier) and computes at most WARM_TOKENS more."""
    if seq.block_table:
        held = seq.num_computed_tokens
    elif seq.host_prefix is not None:
        held = seq.host_prefix.num_tokens
    else:
        return False
    return held > 0 and seq.num_tokens - held <= WARM_TOKENS


def _warm_first(group: deque[Sequence], now: float, seconds: float) -> deque[Sequence]:
    """The group with the sequences that bring their KV, or have waited `seconds`, first (each part in queue
    order); the group itself if that is its order already."""
    first: list[Sequence] = []
    rest: list[Sequence] = []
    moved = False  # some sequence goes ahead of one queued before it
    for seq in group:
        queued = seq.request.queued_at
        if brings_kv(seq) or (queued is not None and now - queued >= seconds):
            first.append(seq)
            moved = moved or bool(rest)
        else:
            rest.append(seq)
    return deque(first + rest) if moved else group


class AdmissionOrder:
    """One step's order of the waiting sequences. `next()` shows the next one; `take` (admitted) and
    `skip` (deferred: stays queued) move past it."""

    def __init__(
        self, waiting: Iterable[Sequence], running: list[Sequence], now: float, aging_seconds: float,
        warm_first_seconds: float,
    ) -> None:  # fmt: skip
        waiting = list(waiting)
        self.groups: dict[tuple[int, str], deque[Sequence]] = {}
        for seq in waiting:
            self.groups.setdefault((urgency(seq, now, aging_seconds), seq.request.tenant), deque()).append(seq)
        self.position = {id(s): i for i, s in enumerate(waiting)} if len(self.groups) > 1 else {}
        if warm_first_seconds > 0:
            for key, group in self.groups.items():
                ordered = _warm_first(group, now, warm_first_seconds)
                if ordered is not group:
                    if self.position:  # each place keeps its queue position: tenants are picked as before
                        places = [self.position[id(s)] for s in group]
                        self.position.update((id(s), at) for s, at in zip(ordered, places))
                    self.groups[key] = ordered
        self.seats: dict[str, int] = {}
        if len(self.groups) > 1:
            for seq in running:
                self.seats[seq.request.tenant] = self.seats.get(seq.request.tenant, 0) + seq.seats

    def next(self) -> Sequence | None:
        if not self.groups:
            return None
        if len(self.groups) == 1:
            return next(iter(self.groups.values()))[0]
        key = min(self.groups, key=lambda k: (k[0], self.seats.get(k[1], 0), self.position[id(self.groups[k][0])]))
        return self.groups[key][0]

    def take(self, seq: Sequence) -> None:
        self._drop(seq)
        self.seats[seq.request.tenant] = self.seats.get(seq.request.tenant, 0) + seq.seats

    def skip(self, seq: Sequence) -> None:
        self._drop(seq)

    def _drop(self, seq: Sequence) -> None:
        for key, group in self.groups.items():
            if group and group[0] is seq:
                group.popleft()
                if not group:
                    del self.groups[key]
                return
        raise AssertionError("only the sequence next() returned can be taken or skipped")
