"""Who is considered first: priority classes (with aging) and fair share of seats between tenants.

A sequence's class is its request's priority, or interactive once it has been queued `aging_seconds`
(for admission and for preemption alike), so under any interactive load a batch request runs within that
time plus the wait of the interactive requests queued before that moment. `AdmissionOrder` is the order
in which one step considers waiting sequences: by class, then the tenant with the fewest seats running or
admitted so far this step, then queue order; with one class and one tenant it is the queue's order.
Pure Python.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from cbd.engine.sampling_params import PRIORITY_INTERACTIVE
from cbd.engine.sequence import Sequence


def urgency(seq: Sequence, now: float, aging_seconds: float) -> int:
    """The class seq is scheduled in: its request's priority, or interactive once it has aged."""
    request = seq.request
    if request.priority == PRIORITY_INTERACTIVE:
        return PRIORITY_INTERACTIVE
    if request.queued_at is not None and now - request.queued_at >= aging_seconds:
        return PRIORITY_INTERACTIVE
    return request.priority


class AdmissionOrder:
    """One step's order of the waiting sequences. `next()` shows the next one; `take` (admitted) and
    `skip` (deferred: stays queued) move past it."""

    def __init__(self, waiting: Iterable[Sequence], running: list[Sequence], now: float, aging_seconds: float) -> None:
        waiting = list(waiting)
        self.groups: dict[tuple[int, str], deque[Sequence]] = {}
        for seq in waiting:
            self.groups.setdefault((urgency(seq, now, aging_seconds), seq.request.tenant), deque()).append(seq)
        self.position = {id(s): i for i, s in enumerate(waiting)} if len(self.groups) > 1 else {}
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
