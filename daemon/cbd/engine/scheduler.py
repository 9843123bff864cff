"""Continuous-batching scheduler: who runs this step, and how many of their tokens.

Every sequence is handled the same way: it has `num_uncomputed` tokens without KV; a step computes
a chunk of them (a whole prompt, a prefill chunk, or the one token of a decode). When the chunk
reaches the end of the sequence, the step also samples its next token.

Policy per step, under `max_num_batched_tokens` and `max_num_seqs`:
  1. running sequences in admission order (decodes first in practice, since they are older);
     when the KV pool cannot grow, the most recently admitted sequence is preempted (its blocks
     freed, its tokens kept) and re-queued at the front of `waiting` to be recomputed later;
  2. then waiting sequences in FIFO order, each first reviving any cached prefix blocks; one whose
     prefix another admission computes this step waits a step to share it instead.
The plan knows nothing about devices.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from cbd.engine.block_manager import BlockManager
from cbd.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledChunk:
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass(slots=True)
class StepPlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) before the forward
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    def __bool__(self) -> bool:
        return bool(self.chunks)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        reclaim: Callable[[int, bool], int] | None = None,
    ) -> None:
        self.block_manager = block_manager
        # reclaim(blocks_needed, include_busy): releases the KV that sessions hold (idle ones; with
        # include_busy also those whose turn is queued or running), least recently used first, until
        # blocks_needed are free; returns how many blocks it freed. Running requests win over sessions.
        self.reclaim = reclaim
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            if seq.final_in_flight:
                index += 1  # its last token is being sampled: nothing left to compute
                continue
            num_new = min(seq.num_uncomputed, budget)
            while not self._make_room(seq, num_new):
                victim = self.running.pop()
                self._preempt(victim, plan)
                if victim is seq:
                    break
            else:
                plan.block_copies += bm.append(seq, num_new)
                plan.chunks.append(ScheduledChunk(seq, num_new))
                budget -= num_new
                index += 1
        if plan.preempted:
            return plan  # the pool is short: admitting now would only thrash
        self._admit(plan, budget)
        return plan

    def _admit(self, plan: StepPlan, budget: int) -> None:
        """Admit waiting sequences in FIFO order while the budget, the seats and the pool allow.

        A sequence whose first full block is being computed this step by another admitted sequence
        is deferred one step, so that it then revives those blocks from the prefix cache instead of
        computing the same prefix again (agent prompts share long system prompts).
        """
        bm = self.block_manager
        seats = sum(s.seats for s in self.running)
        inflight: set[int] = set()
        deferred: list[Sequence] = []
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if seats + seq.seats > self.max_num_seqs or seq.num_placeholders:
                break  # no seat, or (preempted while a step samples its token) the token is not known yet
            if not seq.block_table and inflight:
                first = bm.cacheable_hashes(seq, min(seq.num_tokens - 1, bm.block_size))
                if first and first[0] in inflight and not bm.is_cached(first[0]):
                    deferred.append(self.waiting.popleft())
                    continue
            if not seq.block_table:
                seq.num_computed_tokens = bm.allocate_prefix(seq)
            num_new = min(seq.num_uncomputed, budget)
            if not self._make_room(seq, num_new):
                bm.free(seq)
                seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            seats += seq.seats
            plan.block_copies += bm.append(seq, num_new)
            plan.chunks.append(ScheduledChunk(seq, num_new))
            budget -= num_new
            if bm.enable_prefix_caching:
                inflight.update(bm.cacheable_hashes(seq, seq.num_computed_tokens + num_new))
        self.waiting.extendleft(reversed(deferred))

    def _make_room(self, seq: Sequence, num_new: int) -> bool:
        """Whether seq can grow by num_new tokens, after freeing what no running sequence needs:
        idle sessions' KV first; then the blocks that queued sequences merely hold (a session turn
        starts from its session's blocks) and busy sessions' references to them. Otherwise queued
        turns could pin the very blocks the head of the queue needs, and nothing would ever run.
        What is freed stays in the prefix cache until reused, so a turn often revives it."""
        bm = self.block_manager
        if bm.can_append(seq, num_new):
            return True
        needed = bm.blocks_needed_for(seq, num_new)
        if self.reclaim is not None:
            self.reclaim(needed, False)
            if bm.can_append(seq, num_new):
                return True
        for other in self.waiting:
            if other is not seq and other.block_table and not other.num_placeholders:
                bm.free(other)
                other.num_computed_tokens = 0
        if self.reclaim is not None:
            self.reclaim(needed, True)
        return bm.can_append(seq, num_new)

    def add_running(self, seq: Sequence, after: Sequence) -> None:
        """Insert a forked sequence right after its parent, keeping admission order."""
        seq.status = SequenceStatus.RUNNING
        self.running.insert(self.running.index(after) + 1, seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence wherever it is and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        plan.preempted.append(seq)
        self.num_preemptions += 1
