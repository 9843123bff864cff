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
     restored when it is admitted again, otherwise it is recomputed (`_set_aside`, also used for
     the blocks of queued sequences that must make room);
  2. then waiting sequences: most urgent class first (interactive, then batch); within a class the
     tenant with the fewest running seats first (fair share), oldest request first; each first
     reviving any cached prefix blocks; one whose prefix another admission computes this step waits
     a step to share it instead.
Speculation (`schedule(speculate=True)`): once every running chunk and admission is planned, a
decoding sequence whose tokens are all known gets up to `num_speculative_tokens` draft tokens from
the drafter (engine/drafter.py), within the token budget and free blocks left over (so drafts never
preempt, evict or delay anything: `_add_drafts`); its chunk is its last
token plus the drafts, and the step samples a token after each of them (one `SampleRow` per
position, the same position-keyed randomness as without drafts). `update_from_output` keeps the
drafts up to the first one that differs from the token sampled before it, then that sampled token:
exactly the tokens the sequence would have got one step at a time, greedy or seeded. The KV of the
rejected positions is left behind the sequence's end (overwritten when those positions are computed
again) and the blocks that only they used are freed; drafts are never committed to the prefix
cache. A plan with drafts must complete before the next is scheduled (the next step's positions
depend on how many were kept): the core runs such steps synchronously.
A batch request queued for `aging_seconds` counts as interactive from then on (for admission and
for preemption), so under any interactive load it runs within that time plus the wait of the
interactive requests queued before that moment. A session turn
     whose history's KV is on the host tier gets fresh blocks for what the prefix cache lacks, and
     their restore is started (`HostTier.restore`); it leaves the queue for `restoring` and comes
     back to its front, with its KV in place, once the copy is complete: no step waits for a restore.
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

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from cbd.engine.block_manager import BlockManager
from cbd.engine.sampling_params import PRIORITY_INTERACTIVE
from cbd.engine.sequence import PLACEHOLDER, Sequence, SequenceStatus

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledChunk:
    seq: Sequence
    num_new_tokens: int
    # Recorded when the plan is booked (the sequence moves on at once):
    start: int = 0  # num_computed_tokens before the step: the chunk is token_ids[start : start + num_new_tokens]
    carry_row: int = -1  # >= 0: its last token is in flight, sampled at this row of the previous step
    samples: bool = False  # the chunk reaches the end of the sequence: the step samples its next token
    num_draft: int = 0  # its last num_draft tokens are drafts: the step samples after each chunk token from them on


@dataclass(slots=True)
class SampleRow:
    """One token the step samples: from `source`'s logits, for `target` (source, or a fork of it)."""

    source: Sequence  # whose chunk's last logits row is sampled; its request's params and seed apply
    target: Sequence  # the candidate that receives the token
    position: int  # index of the token in target.token_ids (a PLACEHOLDER until the step completes)
    num_draft: int = 0  # > 0: the first of num_draft + 1 rows verifying target's drafts (positions in order)


@dataclass(slots=True)
class StepPlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) before the forward
    preempted: list[Sequence] = field(default_factory=list)
    samples: list[SampleRow] = field(default_factory=list)  # in chunk order, a parent's forks after it
    # Tickets of copies to the host tier that read blocks this step may overwrite: its device work waits for them.
    fences: set[int] = field(default_factory=set)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def speculative(self) -> bool:
        """Some chunk verifies drafts: the plan must complete before the next one is scheduled."""
        return any(c.num_draft for c in self.chunks)

    def __bool__(self) -> bool:
        return bool(self.chunks)


@dataclass(slots=True)
class Restore:
    """A sequence whose KV comes back from the host tier: blocks [hits, len(host_ids)) of its table are
    copied from host_ids[hits:] (host references held until the copy is issued), `tokens` in all."""

    seq: Sequence
    host_ids: list[int]
    hits: int
    tokens: int
    ticket: int | None = None  # set when the copy is issued


class Drafter(Protocol):
    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to k tokens likely to follow seq's (all known) tokens; [] when it has no guess."""
        ...


class HostTier(Protocol):
    """What the scheduler needs of the host tier (the core wires the host pool and the copier)."""

    def restore(self, host_ids: list[int], gpu_ids: list[int]) -> int:
        """Start copying host blocks to GPU blocks (pairwise); returns the copy's ticket."""
        ...

    def is_done(self, ticket: int, block: bool) -> bool: ...

    def release(self, host_ids: list[int]) -> None:
        """Drop one reference on each host block."""
        ...

    def offload(self, gpu_ids: list[int]) -> tuple[list[int], int | None] | None:
        """Copy GPU blocks to the host pool: (host ids, the copy's ticket, None if nothing needed copying),
        or None if the host pool has no room (or the copy failed)."""
        ...


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
        clock: Callable[[], float] = time.monotonic,
        drafter: Drafter | None = None,
        num_speculative_tokens: int = 0,
    ) -> None:
        self.block_manager = block_manager
        self.drafter = drafter
        self.num_speculative_tokens = num_speculative_tokens if drafter is not None else 0
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
        self.host_tier = host_tier
        self.restoring: list[Restore] = []  # admitted, waiting for their restore
        self.aging_seconds = aging_seconds
        self.clock = clock
        self.num_preemptions = 0
        self.num_priority_preemptions = 0  # of num_preemptions, those made for a more urgent request
        self.num_restored_blocks = 0
        self.num_set_aside_blocks = 0  # blocks of preempted or queued sequences copied to the host tier
        self.num_restored_tokens = 0  # prompt tokens whose KV came from the host instead of being computed
        self.num_draft_tokens = 0  # proposed and verified
        self.num_accepted_tokens = 0  # of those, kept
        self.num_speculative_steps = 0
        self.draft_backoff = False  # overlap mode: after misses, a sequence waits before drafting again
        self.step_index = 0  # schedule() calls so far (the backoff's clock)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        if seq.request.queued_at is None:
            seq.request.queued_at = self.clock()
        self.waiting.append(seq)

    def urgency(self, seq: Sequence, now: float | None = None) -> int:
        """The class seq is scheduled in: its request's priority, or interactive once it has aged."""
        request = seq.request
        if request.priority == PRIORITY_INTERACTIVE:
            return PRIORITY_INTERACTIVE
        now = now if now is not None else self.clock()
        if request.queued_at is not None and now - request.queued_at >= self.aging_seconds:
            return PRIORITY_INTERACTIVE
        return request.priority

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.restoring)

    def can_speculate(self, seq: Sequence) -> bool:
        """Whether seq may get drafts when its tokens are known: a plain decode, not due to stop by length."""
        return (
            not seq.pending_forks
            and not seq.final_in_flight
            and seq.num_computed_tokens > 0
            and seq.num_tokens > seq.num_prompt_tokens
            and seq.draft_retry_step <= self.step_index
        )

    def _add_drafts(self, plan: StepPlan) -> None:
        """Give the plan's decode chunks drafts, with what the step leaves over: the token budget and free
        blocks that no chunk and no admission took (drafts never preempt or delay anything)."""
        bm = self.block_manager
        budget = self.max_num_batched_tokens - plan.num_tokens
        for chunk in plan.chunks:
            seq = chunk.seq
            if chunk.num_new_tokens != 1 or seq.num_uncomputed != 1 or seq.num_placeholders:
                continue
            if not self.can_speculate(seq):
                continue
            params = seq.request.params
            room = min(
                seq.draft_len or min(4, self.num_speculative_tokens),
                budget,
                params.max_tokens - seq.num_output_tokens - 1,  # all kept + the token after them: the last one at most
                self.max_model_len - seq.num_tokens - 1,
            )  # fmt: skip
            drafts = self.drafter.propose(seq, room) if room > 0 and self.drafter is not None else []
            if drafts and seq.grammar is not None:  # only what the grammar allows next (checked, then undone)
                drafts = drafts[: seq.grammar.valid_prefix(drafts)]
            if not drafts or not bm.can_append(seq, 1 + len(drafts)):
                self._missed(seq, verified=False)
                continue
            seq.token_ids += drafts
            seq.num_draft = chunk.num_draft = len(drafts)
            plan.block_copies += bm.append(seq, 1 + len(drafts))
            chunk.num_new_tokens += len(drafts)
            budget -= len(drafts)

    def _missed(self, seq: Sequence, verified: bool) -> None:
        """After drafts none of which was kept (verified), or in overlap mode after finding no draft,
        seq waits 2, 4, ... 32 steps before drafting again (a kept draft resets it): verifying costs
        compute, and in overlap mode a step that speculates is synchronous."""
        if verified or self.draft_backoff:
            seq.draft_misses += 1
            seq.draft_retry_step = self.step_index + (1 << min(seq.draft_misses, 5))

    def schedule(self, speculate: bool = False) -> StepPlan:
        """The next step's plan; with speculate, decoding sequences whose tokens are all known may
        verify drafts in it (then the plan must complete before the next schedule)."""
        self.step_index += 1
        plan = StepPlan()
        if self.restoring:
            self._finish_restores()
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        now = self.clock()
        if self.waiting and self.running:
            self._preempt_for_priority(plan, now)
        short = False
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            if seq.final_in_flight:
                index += 1  # its last token is being sampled: nothing left to compute
                continue
            num_new = min(seq.num_uncomputed, budget)
            while not self._make_room(seq, num_new):
                short = True
                victim = self._memory_victim(index, now)
                self.running.remove(victim)
                self._preempt(victim, plan)
                if victim is seq:
                    break
            else:
                plan.block_copies += bm.append(seq, num_new)
                plan.chunks.append(ScheduledChunk(seq, num_new))
                budget -= num_new
                index += 1
        if not short:  # the pool is short: admitting now would only thrash
            self._admit(plan, budget, now)
        if speculate and not short:
            self._add_drafts(plan)
        self._book(plan)
        plan.fences = bm.take_fences()
        return plan

    def _finish_restores(self) -> None:
        """Sequences whose restore is complete go back to the front of the queue, in admission order.
        With nothing else to run, wait for the oldest restore rather than spin."""
        assert self.host_tier is not None
        idle = not self.running and not self.waiting
        done: list[Restore] = []
        pending: list[Restore] = []
        for i, r in enumerate(self.restoring):
            complete = r.ticket is not None and self.host_tier.is_done(r.ticket, idle and i == 0)
            (done if complete else pending).append(r)
        self.restoring = pending
        self.waiting.extendleft(r.seq for r in reversed(done))

    def _start_restore(self, seq: Sequence, budget: int) -> bool | None:
        """Give seq (its prefix-cache hits already attached) fresh blocks for the rest of its host
        prefix; their copy is issued once this step is launched (`issue_restores`: the step's own block
        copies may still read a block just freed and handed out here). True: seq goes to `restoring`;
        False: nothing to restore (the prefix cache had it all), go on admitting it; None: no room now
        (nothing changed)."""
        assert seq.host_prefix is not None and self.host_tier is not None
        bm = self.block_manager
        host_ids, tokens = seq.host_prefix
        hits = len(seq.block_table)
        if hits >= len(host_ids) or seq.num_computed_tokens >= tokens:
            self.host_tier.release(host_ids)
            seq.host_prefix = None
            return False
        # Room for the restored blocks and the first chunk after them, or the restore would be undone.
        if not self._make_room(seq, tokens - seq.num_computed_tokens + min(seq.num_tokens - tokens, budget)):
            return None
        fresh = bm.allocate_blocks(len(host_ids) - hits)
        seq.host_prefix = None
        seq.block_table += fresh
        seq.num_computed_tokens = tokens
        self.restoring.append(Restore(seq, host_ids, hits, tokens))
        return True

    def issue_restores(self) -> None:
        """Start the copies of the restores this step's schedule set up (call after launching it). A copy
        that fails leaves the sequence to recompute what it lacks (back to the queue's front)."""
        if self.host_tier is None:
            return
        bs = self.block_manager.block_size
        for r in [r for r in self.restoring if r.ticket is None]:
            fresh = r.seq.block_table[r.hits : len(r.host_ids)]
            try:
                r.ticket = self.host_tier.restore(r.host_ids[r.hits :], fresh)
            except Exception:
                log.exception("restoring %d KV blocks from the host tier failed; they are recomputed", len(fresh))
                self.restoring.remove(r)
                self.block_manager.release(fresh)
                del r.seq.block_table[r.hits :]
                r.seq.num_computed_tokens = r.hits * bs
                self.waiting.appendleft(r.seq)
            else:
                self.num_restored_blocks += len(fresh)
                self.num_restored_tokens += r.tokens - r.hits * bs
                if r.seq.host_backup is None:  # kept until it runs (see _set_aside)
                    r.seq.host_backup, r.host_ids = (r.host_ids, r.tokens), []
            if r.host_ids:
                self.host_tier.release(r.host_ids)
            r.host_ids = []

    def _book(self, plan: StepPlan) -> None:
        """Account for the plan as launched (see the module docstring)."""
        bm = self.block_manager
        now = None
        for chunk in plan.chunks:
            seq, request = chunk.seq, chunk.seq.request
            chunk.start = seq.num_computed_tokens
            chunk.carry_row = -1
            if seq.num_placeholders:  # only its newest token can be in flight, and the chunk ends at it
                assert seq.num_placeholders == 1 and chunk.start + chunk.num_new_tokens == seq.num_tokens
                chunk.carry_row = seq.pending_row
            chunk.samples = chunk.start + chunk.num_new_tokens == seq.num_tokens
            if not request.prompt_cache_recorded and seq.candidate_index == 0:
                request.num_cached_prompt_tokens = seq.num_computed_tokens
                request.prompt_cache_recorded = True
                request.first_scheduled = now = now or time.monotonic()
            seq.num_computed_tokens += chunk.num_new_tokens
            # Blocks whose tokens are all known can be shared at once: any later reader runs after
            # this step on the compute stream, so it sees their KV.
            bm.commit(seq)
        rows = plan.samples
        for chunk in plan.chunks:
            if not chunk.samples:
                continue
            parent = chunk.seq
            if chunk.num_draft:  # a row after the last known token and after each draft
                first = parent.num_tokens - chunk.num_draft
                self._sample_into(parent, parent, parent.num_tokens, rows)
                parent.final_in_flight = False  # how many are kept is not known yet: decided when it completes
                rows[-1:] = [SampleRow(parent, parent, first + i) for i in range(chunk.num_draft + 1)]
                rows[-chunk.num_draft - 1].num_draft = chunk.num_draft
                parent.pending_row = -1  # a plan with drafts completes before the next is scheduled
                self.num_draft_tokens += chunk.num_draft
                self.num_speculative_steps += 1
                continue
            position = parent.num_tokens
            self._sample_into(parent, parent, position, rows)
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
        target.token_ids.append(PLACEHOLDER)
        target.num_placeholders += 1
        target.pending_row = len(rows)
        target.final_in_flight = target.length_limit_reached(target.num_tokens, self.max_model_len)
        rows.append(SampleRow(source, target, position))

    def update_from_output(self, plan: StepPlan, token_ids: list[int]) -> list[int]:
        """Put a completed step's tokens (one per sample row) in place of their placeholders; returns
        the indices of the rows whose target is still live (one that finished or was aborted while
        the step was in flight drops its token)."""
        live = []
        skip = 0
        for i, row in enumerate(plan.samples):
            if skip:
                skip -= 1
                continue
            seq = row.target
            if row.num_draft:
                skip = row.num_draft
                if not seq.is_finished:
                    live += self._verify(seq, row, i, token_ids)
                continue
            if seq.is_finished:
                continue
            seq.token_ids[row.position] = token_ids[i]
            seq.num_placeholders -= 1
            if seq.grammar is not None:  # the token was sampled under this grammar's mask
                seq.grammar.accept(token_ids[i])
            live.append(i)
        for chunk in plan.chunks:
            if not chunk.seq.is_finished:
                self.block_manager.commit(chunk.seq)
        return live

    def _verify(self, seq: Sequence, row: SampleRow, i: int, token_ids: list[int]) -> list[int]:
        """Keep seq's drafts up to the first that differs from the token sampled before it, then that
        sampled token; cut the rest and free the blocks only they used. Returns the rows kept."""
        first, k = row.position, row.num_draft
        kept = 0
        while kept < k and token_ids[i + kept] == seq.token_ids[first + kept]:
            kept += 1
        end = first + kept  # the token sampled after the kept drafts goes here; its KV is not computed yet
        seq.token_ids[end] = token_ids[i + kept]
        del seq.token_ids[end + 1 :]
        if seq.grammar is not None:  # each sampled under its row's mask: the grammar after the drafts before it
            for token in seq.token_ids[first : end + 1]:
                seq.grammar.accept(token)
        seq.num_draft = seq.num_placeholders = 0
        seq.num_computed_tokens = end
        bm = self.block_manager
        keep_blocks = bm.blocks_needed(end)
        if len(seq.block_table) > keep_blocks:
            bm.release(seq.block_table[keep_blocks:])
            del seq.block_table[keep_blocks:]
        self.num_accepted_tokens += kept
        # The draft length follows the copying: doubled after a run kept whole (up to the limit), else
        # just past what was kept.
        seq.draft_len = min(2 * k, self.num_speculative_tokens) if kept == k else max(2, kept + 1)
        if kept:
            seq.draft_misses = 0
        else:
            self._missed(seq, verified=True)
        return list(range(i, i + kept + 1))

    def _admit(self, plan: StepPlan, budget: int, now: float) -> None:
        """Admit waiting sequences, in `_AdmissionOrder`, while the budget, the seats and the pool allow.

        A sequence whose first full block is being computed this step by another admitted sequence
        is deferred one step, so that it then revives those blocks from the prefix cache instead of
        computing the same prefix again (agent prompts share long system prompts).
        """
        bm = self.block_manager
        seats = sum(s.seats for s in self.running)
        inflight: set[int] = set()
        order = _AdmissionOrder(self, now)
        while budget > 0:
            seq = order.next()
            if seq is None:
                break
            if seats + seq.seats > self.max_num_seqs or seq.num_placeholders:
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
                    started = self._start_restore(seq, budget)
                    if started is None:
                        bm.free(seq)
                        seq.num_computed_tokens = 0
                        break
                    if started:
                        self._unqueue(order, seq)
                        continue
            num_new = min(seq.num_uncomputed, budget)
            if not self._make_room(seq, num_new):
                if held:
                    self._set_aside(seq)
                else:  # prefix hits stay in the cache
                    bm.free(seq)
                    seq.num_computed_tokens = 0
                break
            self._unqueue(order, seq)
            if seq.host_backup is not None:
                assert self.host_tier is not None
                self.host_tier.release(seq.host_backup[0])
                seq.host_backup = None
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            seats += seq.seats
            plan.block_copies += bm.append(seq, num_new)
            plan.chunks.append(ScheduledChunk(seq, num_new))
            budget -= num_new
            if bm.enable_prefix_caching:
                inflight.update(bm.cacheable_hashes(seq, seq.num_computed_tokens + num_new))

    def _unqueue(self, order: _AdmissionOrder, seq: Sequence) -> None:
        order.take(seq)
        if self.waiting[0] is seq:
            self.waiting.popleft()
        else:
            self.waiting.remove(seq)

    def _preempt_for_priority(self, plan: StepPlan, now: float) -> None:
        """If the most urgent waiting sequence has no seat or no KV for its first chunk, preempt less
        urgent running sequences (least urgent first, newest first within a class) until it has."""
        best = min(self.waiting, key=lambda s: (self.urgency(s, now), s.request.queued_at or 0.0))
        level = self.urgency(best, now)
        victims = [s for s in self.running if self.urgency(s, now) > level and not s.final_in_flight]
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
        this step, the least urgent one no more urgent than it, newest first; else itself."""
        seq = self.running[index]
        level = self.urgency(seq, now)
        tail = [(self.urgency(s, now), i) for i, s in enumerate(self.running) if i > index]
        eligible = [(u, i) for u, i in tail if u >= level]
        return self.running[max(eligible)[1]] if eligible else seq

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
                self._set_aside(other)
        if self.reclaim is not None:
            self.reclaim(needed, True)
        return bm.can_append(seq, num_new)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence wherever it is and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            for i, r in enumerate(self.restoring):
                if r.seq is seq:
                    del self.restoring[i]
                    if r.ticket is not None:  # its blocks are being written: whoever gets them next waits
                        self.block_manager.fence(seq.block_table, r.ticket)
                    elif self.host_tier is not None:  # never issued: the host references are still held
                        self.host_tier.release(r.host_ids)
                    break
        for held in (seq.host_prefix, seq.host_backup):
            if held is not None:
                assert self.host_tier is not None
                self.host_tier.release(held[0])
        seq.host_prefix = seq.host_backup = None
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    def _set_aside(self, seq: Sequence) -> None:
        """Free seq's GPU blocks; with a host tier that has room, their KV is copied there first and
        restored when seq is admitted again (otherwise it is recomputed then)."""
        bm = self.block_manager
        computed = min(seq.num_computed_tokens, seq.num_tokens - 1)
        if seq.host_backup is not None and seq.host_prefix is None and computed == seq.host_backup[1]:
            seq.host_prefix, seq.host_backup = seq.host_backup, None  # restored and not run: still on the host
        elif self.host_tier is not None and seq.host_prefix is None and computed > 0 and seq.block_table:
            table = seq.block_table[: -(-computed // bm.block_size)]
            moved = self.host_tier.offload(table)
            if moved is not None:
                host_ids, ticket = moved
                if ticket is not None:
                    bm.fence(table, ticket)
                seq.host_prefix = (host_ids, computed)
                self.num_set_aside_blocks += len(table)
        bm.free(seq)
        seq.num_computed_tokens = 0

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self._set_aside(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)  # queued first within its class and tenant (it is older than the rest)
        plan.preempted.append(seq)
        self.num_preemptions += 1


class _AdmissionOrder:
    """The order in which one step considers waiting sequences: by class (urgency), then the tenant
    with the fewest seats running or admitted so far this step, then queue order. With one class and
    one tenant this is the queue's order. `next()` shows the next one; `take` (admitted) and `skip`
    (deferred: stays queued) move past it."""

    def __init__(self, scheduler: Scheduler, now: float) -> None:
        self.groups: dict[tuple[int, str], deque[Sequence]] = {}
        for seq in scheduler.waiting:
            self.groups.setdefault((scheduler.urgency(seq, now), seq.request.tenant), deque()).append(seq)
        self.position = {id(s): i for i, s in enumerate(scheduler.waiting)} if len(self.groups) > 1 else {}
        self.seats: dict[str, int] = {}
        if len(self.groups) > 1:
            for seq in scheduler.running:
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
