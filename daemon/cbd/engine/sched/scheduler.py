"""Continuous-batching scheduler: who runs this step, and how many of their tokens.

Every sequence is handled the same way: it has `num_uncomputed` tokens without KV; a step computes
a chunk of them (a whole prompt, a prefill chunk, or the one token of a decode). When the chunk
reaches the end of the sequence, the step also samples its next token.

Policy per step, under `max_num_batched_tokens` and `max_num_seqs`:
  0. priority: if the most urgent waiting sequence cannot get a seat or the KV for its first chunk
     and less urgent sequences are running, those are preempted (least urgent first, newest first
     within a class) until it can;
  1. running sequences in admission order (decodes first in practice, since they are older);
     when the KV pool cannot grow, a sequence no more urgent than the one growing is preempted (its
     blocks freed, its tokens kept; least urgent, then most recently admitted, first; the one growing
     itself if every other is more urgent) and re-queued; with a host tier its KV is copied there and
     restored when it is admitted again, otherwise it is recomputed (`set_aside`, also used for
     the blocks of queued sequences that must make room; kv/host_tier.py keeps the host side);
  2. then waiting sequences (admit.py): in class, fair-share, warm-first and queue order (order.py), reviving
     cached prefix blocks, restoring from the host tier, until one does not fit.
Speculation (`schedule(speculate=True)`): once every running chunk and admission is planned, the
speculator (spec/speculator.py) gives decoding sequences drafts from what the step leaves over, and
verifies them in `update_from_output`. A sequence whose drafts are in flight is booked in the next
step as if all were kept (its device inputs are moved back on the device by the kept count); it is
never preempted then (the step in flight decides its length): it waits a step if it cannot grow.
The plan knows nothing about devices.

The scheduler also does the plan's accounting, in one place, on both sides of the device work:
  schedule()                          picks the chunks, then books them as launched: records each
                                      chunk's start and carry-over row, advances num_computed,
                                      commits full known blocks, makes the sample rows (creating
                                      fan-out forks, which share the parent's blocks and run right
                                      after it), and appends a PLACEHOLDER to every row's target;
  update_from_output(plan, tokens)    puts the tokens in place of the placeholders (targets that
                                      finished meanwhile are skipped), advances each constrained
                                      target's grammar by its token, and commits the blocks they fill.
So the next schedule never waits for a step's tokens (the overlap loop), and whatever later
features add per step (grammar state, accepted drafts) is booked in the same two places.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from cbd.engine.kv.blocks import BlockManager
from cbd.engine.sched.admit import admit
from cbd.engine.sched.order import urgency
from cbd.engine.sched.plan import SampleRow, ScheduledChunk, StepPlan
from cbd.engine.sequence import PLACEHOLDER, Sequence, SequenceStatus
from cbd.engine.spec.speculator import Speculator

if TYPE_CHECKING:  # the scheduler knows no devices: the tier (and its copier) is only named here
    from cbd.engine.kv.host_tier import HostTier


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        reclaim: Callable[[int, bool], int] | None = None,
        *,
        max_model_len: int,
        new_fork: Callable[[Sequence, int, list[int]], Sequence],
        host_tier: HostTier | None = None,
        aging_seconds: float = 30.0,
        warm_first_seconds: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        speculator: Speculator | None = None,
    ) -> None:
        """speculator: drafts for schedule(speculate=True) and their verification (none: never drafts)."""
        self.block_manager = block_manager
        self.speculator = speculator or Speculator(block_manager, max_model_len, None, 0)
        self.max_model_len = max_model_len
        # new_fork(parent, candidate, token_ids): a new sequence of parent's request (the core makes
        # it: sequence ids and output state are its business).
        self.new_fork = new_fork
        # reclaim(blocks_needed, include_busy): releases the KV that sessions hold (idle ones; with
        # include_busy also those whose turn is queued or running), least recently used first, until
        # blocks_needed are free; returns how many blocks it freed. Running requests win over sessions.
        self.reclaim = reclaim
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.host_tier = host_tier  # None: no host tier (set-aside and preempted KV is recomputed)
        self.aging_seconds = aging_seconds
        self.warm_first_seconds = warm_first_seconds  # see sched/order.py
        self.clock = clock
        self.num_preemptions = 0
        self.num_priority_preemptions = 0  # of num_preemptions, those made for a more urgent request

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        if seq.request.queued_at is None:
            seq.request.queued_at = self.clock()
        self.waiting.append(seq)

    def urgency(self, seq: Sequence, now: float | None = None) -> int:
        """The class seq is scheduled in (sched/order.py)."""
        return urgency(seq, now if now is not None else self.clock(), self.aging_seconds)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or (self.host_tier is not None and self.host_tier.restoring))

    def schedule(self, speculate: bool = False) -> StepPlan:
        """The next step's plan; with speculate, decoding sequences whose tokens are all known may
        verify drafts in it (then the plan must complete before the next schedule)."""
        self.speculator.step_index += 1
        plan = StepPlan()
        if self.host_tier is not None and self.host_tier.restoring:
            # Restored sequences go back to the front of the queue, in admission order. With nothing else
            # to run, wait for the oldest restore rather than spin.
            done = self.host_tier.completed_restores(wait_oldest=not self.running and not self.waiting)
            self.waiting.extendleft(reversed(done))
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        now = self.clock()
        if self.waiting and self.running:
            self._preempt_for_priority(plan, now)
        short = False
        index = 0
        running, chunks = self.running, plan.chunks
        while index < len(running) and budget > 0:
            seq = running[index]
            if seq.final_in_flight:
                index += 1  # its last token is being sampled: nothing left to compute
                continue
            num_new = len(seq.token_ids) - seq.num_computed_tokens  # num_uncomputed (this loop is per sequence)
            if num_new > budget:
                num_new = budget
            if not bm.fits(seq, num_new):  # most decodes fit: no block to add or copy
                if seq.num_draft:  # drafts in flight: it grows or waits, never preempted
                    if not self.make_room(seq, num_new):
                        index += 1
                        continue
                    plan.block_copies += bm.append(seq, num_new)
                else:
                    while not self.make_room(seq, num_new):
                        short = True
                        victim = self._memory_victim(index, now)
                        self.running.remove(victim)
                        self._preempt(victim, plan)
                        if victim is seq:
                            break
                    else:
                        plan.block_copies += bm.append(seq, num_new)
                    if seq.status is not SequenceStatus.RUNNING:  # preempted itself: running[index] is the next
                        continue
            chunks.append(ScheduledChunk(seq, num_new))
            budget -= num_new
            index += 1
        if not short and self.waiting:  # the pool is short: admitting now would only thrash
            admit(self, plan, budget, now)
        if speculate and not short:
            self.speculator.add_drafts(plan, self.max_num_batched_tokens)
        self._book(plan)
        plan.fences = bm.take_fences()
        return plan

    def issue_restores(self) -> None:
        """Start the host tier's copies of the restores this step's schedule set up (call after launching
        it). A sequence whose copy fails recomputes what it lacks: back to the queue's front."""
        if self.host_tier is not None:
            for seq in self.host_tier.issue_restores():
                self.waiting.appendleft(seq)

    def _book(self, plan: StepPlan) -> None:
        """Account for the plan as launched (see the module docstring)."""
        bm = self.block_manager
        now = None
        for chunk in plan.chunks:
            seq, request = chunk.seq, chunk.seq.request
            chunk.start = seq.num_computed_tokens  # (carry_row and carry_group are -1 in a new chunk)
            if seq.num_placeholders:  # only its newest token can be in flight: the chunk's first, then its drafts
                assert seq.num_placeholders == 1 and chunk.start + chunk.num_new_tokens == seq.num_tokens
                chunk.carry_row, chunk.carry_group = seq.pending_row, seq.pending_group
            chunk.samples = chunk.start + chunk.num_new_tokens == seq.num_tokens
            if not request.prompt_cache_recorded and seq.candidate_index == 0:
                request.num_cached_prompt_tokens = seq.num_computed_tokens
                request.prompt_cache_recorded = True
                request.first_scheduled = now = now or time.monotonic()
            seq.num_computed_tokens += chunk.num_new_tokens
        # Blocks whose tokens are all known can be shared at once: any later reader runs after this step
        # on the compute stream, so it sees their KV.
        bm.commit_all([chunk.seq for chunk in plan.chunks])
        rows = plan.samples
        groups = 0  # verifying groups so far
        for chunk in plan.chunks:
            if not chunk.samples:
                continue
            parent = chunk.seq
            first_row = len(rows)
            if chunk.num_draft:  # a row after the chunk's first token and after each draft
                self._sample_into(parent, parent, parent.num_tokens, rows)
                self.speculator.verifying_rows(chunk, rows, groups)
                groups += 1
            else:
                self._sample_with_forks(parent, rows)
            if chunk.carry_group >= 0:  # after drafts in flight: moved back by those they reject (verify)
                parent.next_rows = rows[first_row:]

    def _sample_with_forks(self, parent: Sequence, rows: list[SampleRow]) -> None:
        """The row after a chunk without drafts, and one per fork it makes (each a new candidate)."""
        position = len(parent.token_ids)
        self._sample_into(parent, parent, position, rows)
        if not parent.pending_forks:
            return
        bm = self.block_manager
        after = parent
        for candidate in range(parent.candidate_index + 1, parent.candidate_index + 1 + parent.pending_forks):
            # A sibling sharing the parent's blocks, created before its first token is known.
            fork = self.new_fork(parent, candidate, parent.token_ids[:position])
            fork.num_computed_tokens = parent.num_computed_tokens
            bm.fork(parent, fork)
            fork.status = SequenceStatus.RUNNING
            self.running.insert(self.running.index(after) + 1, fork)
            after = fork
            self._sample_into(parent, fork, position, rows)
        parent.pending_forks = 0

    def _sample_into(self, source: Sequence, target: Sequence, position: int, rows: list[SampleRow]) -> None:
        tokens = target.token_ids
        tokens.append(PLACEHOLDER)
        target.num_placeholders += 1
        target.pending_row, target.pending_group = len(rows), -1
        target.final_in_flight = target.length_limit_reached(len(tokens), self.max_model_len)
        rows.append(SampleRow(source, target, position))

    def update_from_output(self, plan: StepPlan, token_ids: list[int], drafts: list[int] | None = None) -> list[int]:
        """Put a completed step's tokens (one per sample row) in place of their placeholders; returns
        the indices of the rows whose target is still live (one that finished or was aborted while
        the step was in flight drops its token). drafts: the drafts it verified where the device drafted
        some (device/draft_lookup.py), D per verifying group in the plan's order."""
        live = []
        skip = 0
        finished = SequenceStatus.FINISHED
        group, depth = 0, 0
        if drafts is not None:
            depth = len(drafts) // sum(1 for row in plan.samples if row.num_draft)
        for i, row in enumerate(plan.samples):
            if skip:
                skip -= 1
                continue
            seq = row.target
            if row.num_draft:
                skip = row.num_draft
                if seq.status is not finished:
                    verified = drafts[group * depth : group * depth + skip] if drafts is not None else None
                    live += self.speculator.verify(seq, row, i, token_ids, verified)
                group += 1
                continue
            if seq.status is finished:
                continue
            seq.token_ids[row.position] = token_ids[i]
            seq.num_placeholders -= 1
            if seq.grammar is not None:  # the token was sampled under this grammar's mask
                seq.grammar.accept(token_ids[i])
            live.append(i)
        self.block_manager.commit_all([c.seq for c in plan.chunks if c.seq.status is not finished])
        return live

    def _preempt_for_priority(self, plan: StepPlan, now: float) -> None:
        """If the most urgent waiting sequence has no seat or no KV for its first chunk, preempt less
        urgent running sequences (least urgent first, newest first within a class) until it has."""
        best = min(self.waiting, key=lambda s: (self.urgency(s, now), s.request.queued_at or 0.0))
        level = self.urgency(best, now)
        victims = [
            s for s in self.running if self.urgency(s, now) > level and not s.final_in_flight and not s.num_draft
        ]
        if not victims or best.num_placeholders:
            return
        bm = self.block_manager
        need = bm.blocks_needed(min(best.num_tokens, self.max_num_batched_tokens)) - len(best.block_table)
        seats = sum(s.seats for s in self.running)
        if bm.num_free_blocks < need and self.reclaim is not None:
            self.reclaim(need, False)
        victims.sort(key=lambda s: (self.urgency(s, now), self.running.index(s)))
        while victims and (seats + best.seats > self.max_num_seqs or bm.num_free_blocks < need):
            victim = victims.pop()
            self.running.remove(victim)
            seats -= victim.seats
            self._preempt(victim, plan)
            self.num_priority_preemptions += 1

    def _memory_victim(self, index: int, now: float) -> Sequence:
        """Whom to preempt so that running[index] can grow: among the running sequences not yet scheduled
        this step and without drafts in flight, the least urgent one no more urgent than it, newest
        first; else itself."""
        seq = self.running[index]
        level = self.urgency(seq, now)
        tail = [(self.urgency(s, now), i) for i, s in enumerate(self.running) if i > index and not s.num_draft]
        eligible = [(u, i) for u, i in tail if u >= level]
        return self.running[max(eligible)[1]] if eligible else seq

    def make_room(self, seq: Sequence, num_new: int) -> bool:
        """(Also admission's and the host tier's.) Whether seq can grow by num_new tokens, after freeing what no running sequence needs:
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
                self.set_aside(other)
        if self.reclaim is not None:
            self.reclaim(needed, True)
        return bm.can_append(seq, num_new)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence wherever it is and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        if self.host_tier is not None:  # its restore, if it is being restored, and its host copies
            self.host_tier.drop(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    def set_aside(self, seq: Sequence) -> None:
        """(Also admission's.) Free seq's GPU blocks; with a host tier that has room, their KV is copied there first and
        restored when seq is admitted again (otherwise it is recomputed then)."""
        if self.host_tier is not None:
            self.host_tier.set_aside(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self.set_aside(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)  # queued first (order.py may still put turns that bring their KV before it)
        plan.preempted.append(seq)
        self.num_preemptions += 1
