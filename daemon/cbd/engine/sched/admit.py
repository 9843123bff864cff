"""Admission of waiting sequences into a step, after the running ones have been planned.

Waiting sequences are considered in `AdmissionOrder` (order.py: class, then fair share between
tenants, then turns that bring their KV, then queue order) while the step's token budget, the seats
(`max_num_seqs`) and the KV pool allow; the first that does not fit stops admission for this step (a
later one never overtakes it). Each first revives its cached prefix blocks. Invariants:
- a sequence whose first full block another admission computes this step is deferred one step (it
  stays queued), so that it then revives those blocks instead of computing the same prefix again
  (agent prompts share long system prompts);
- a sequence whose newest token is still being sampled (preempted while a step was in flight) waits;
- a session turn whose history's KV is on the host tier gets fresh blocks for what the prefix cache
  lacks and leaves the queue for the tier's restores (kv/host_tier.py); no step waits for a restore;
- a sequence that cannot get its blocks gives back what it took: KV it brought is set aside (kept on
  the host tier if it has room), prefix hits stay in the cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cbd.engine.sched.order import AdmissionOrder
from cbd.engine.sched.plan import ScheduledChunk, StepPlan
from cbd.engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:  # the scheduler calls this with itself
    from cbd.engine.sched.scheduler import Scheduler


def admit(sched: Scheduler, plan: StepPlan, budget: int, now: float) -> None:
    """Admit waiting sequences into plan while budget tokens, the seats and the pool allow."""
    bm = sched.block_manager
    seats = sum(s.seats for s in sched.running)
    inflight: set[int] = set()
    order = AdmissionOrder(sched.waiting, sched.running, now, sched.aging_seconds, sched.warm_first_seconds)
    while budget > 0:
        seq = order.next()
        if seq is None:
            break
        if seats + seq.seats > sched.max_num_seqs or seq.num_placeholders:
            break  # no seat, or (preempted while a step samples its token) the token is not known yet
        if not seq.block_table and inflight:
            first = bm.cacheable_hashes(seq, min(seq.num_tokens - 1, bm.block_size))
            if first and first[0] in inflight and not bm.is_cached(first[0]):
                order.skip(seq)  # deferred: next step it shares the prefix
                continue
        held = bool(seq.block_table)  # KV it brought (restored, or its session's), not prefix hits taken now
        if not seq.block_table:
            seq.num_computed_tokens = bm.allocate_prefix(seq)
            if seq.host_prefix is not None:
                assert sched.host_tier is not None  # only a tier sets it
                started = sched.host_tier.start_restore(seq, budget, sched.make_room)
                if started is None:
                    bm.free(seq)
                    seq.num_computed_tokens = 0
                    break
                if started:
                    _unqueue(sched, order, seq)
                    continue
        num_new = min(seq.num_uncomputed, budget)
        if not sched.make_room(seq, num_new):
            if held:
                sched.set_aside(seq)
            else:  # prefix hits stay in the cache
                bm.free(seq)
                seq.num_computed_tokens = 0
            break
        _unqueue(sched, order, seq)
        if sched.host_tier is not None:
            sched.host_tier.admitted(seq)
        seq.status = SequenceStatus.RUNNING
        sched.running.append(seq)
        seats += seq.seats
        plan.block_copies += bm.append(seq, num_new)
        plan.chunks.append(ScheduledChunk(seq, num_new))
        budget -= num_new
        if bm.enable_prefix_caching:
            inflight.update(bm.cacheable_hashes(seq, seq.num_computed_tokens + num_new))


def _unqueue(sched: Scheduler, order: AdmissionOrder, seq: Sequence) -> None:
    order.take(seq)
    if sched.waiting[0] is seq:
        sched.waiting.popleft()
    else:  # by identity (a turn that brings its KV is often taken from behind the queue's head)
        del sched.waiting[next(i for i, s in enumerate(sched.waiting) if s is seq)]
