"""Speculation in a step: which sequences may try drafts, their drafts, the backoff after misses, and
the verification of a completed step's drafts.

A decoding sequence whose tokens are all known gets up to `num_speculative_tokens` draft tokens from the
drafter (drafter.py), within the token budget and free blocks that every running chunk and admission left
over (drafts never preempt, evict or delay anything: `add_drafts`); its chunk is its last token plus the
drafts, and the step samples a token after each of them (`verifying_rows`: one `SampleRow` per position,
the same position-keyed randomness as without drafts). `verify` keeps the drafts up to the first one that
differs from the token sampled before it, then that sampled token: exactly the tokens the sequence would
have got one step at a time, greedy or seeded. The KV of the rejected positions is left behind the
sequence's end (overwritten when those positions are computed again) and the blocks that only they used
are freed; drafts are never committed to the prefix cache. A plan with drafts must complete before the
next is scheduled (the next step's positions depend on how many were kept): the core runs it synchronously.

Per-sequence draft state lives on the Sequence (`draft_len`, `draft_misses`, `draft_retry_step`,
`draft_index`, `num_draft`); the step counter of the backoff and the counts live here. Pure Python.
"""

from __future__ import annotations

from cbd.engine.kv.blocks import BlockManager
from cbd.engine.sched.plan import SampleRow, ScheduledChunk, StepPlan
from cbd.engine.sequence import Sequence
from cbd.engine.spec.drafter import Drafter


class Speculator:
    def __init__(
        self, block_manager: BlockManager, max_model_len: int, drafter: Drafter | None, num_speculative_tokens: int,
        max_batch: int | None = None,
    ) -> None:  # fmt: skip
        """drafter None: speculation off. max_batch: no speculation with more running sequences ("auto")."""
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.drafter = drafter
        self.num_speculative_tokens = num_speculative_tokens if drafter is not None else 0
        self.max_batch = max_batch
        self.backoff = False  # overlap mode: after finding no draft, a sequence waits before drafting again
        self.step_index = 0  # steps scheduled so far (the backoff's clock; the scheduler advances it)
        self.num_draft_tokens = 0  # proposed and verified
        self.num_accepted_tokens = 0  # of those, kept
        self.num_speculative_steps = 0

    def worth_trying(self, running: list[Sequence], overlap: bool) -> bool:
        """Whether the next step may verify drafts: speculation on, the batch small enough and, in overlap
        mode (where it costs a synchronous step), some running sequence due to try."""
        if self.drafter is None or not running:
            return False
        if self.max_batch is not None and len(running) > self.max_batch:
            return False
        return not overlap or any(self.can_speculate(seq) for seq in running)

    def can_speculate(self, seq: Sequence) -> bool:
        """Whether seq may get drafts when its tokens are known: a plain decode, not due to stop by length."""
        return (
            not seq.pending_forks
            and not seq.final_in_flight
            and seq.num_computed_tokens > 0
            and seq.num_tokens > seq.num_prompt_tokens
            and seq.draft_retry_step <= self.step_index
        )

    def add_drafts(self, plan: StepPlan, max_num_batched_tokens: int) -> None:
        """Give the plan's decode chunks drafts, with what the step leaves over: the token budget and free
        blocks that no chunk and no admission took (drafts never preempt or delay anything)."""
        bm = self.block_manager
        budget = max_num_batched_tokens - plan.num_tokens
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

    def verifying_rows(self, chunk: ScheduledChunk, rows: list[SampleRow]) -> None:
        """Booking a chunk with drafts, whose one sample row (its newest placeholder's) was just appended:
        that row becomes a group of 1 + num_draft rows, after the last known token and after each draft."""
        seq, k = chunk.seq, chunk.num_draft
        first = seq.num_tokens - 1 - k  # position of the first draft
        seq.final_in_flight = False  # how many are kept is not known yet: decided when it completes
        rows[-1:] = [SampleRow(seq, seq, first + i) for i in range(k + 1)]
        rows[-k - 1].num_draft = k
        seq.pending_row = -1  # a plan with drafts completes before the next is scheduled
        self.num_draft_tokens += k
        self.num_speculative_steps += 1

    def verify(self, seq: Sequence, row: SampleRow, i: int, token_ids: list[int]) -> list[int]:
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
            seq.num_committed_blocks = min(seq.num_committed_blocks, keep_blocks)
        self.num_accepted_tokens += kept
        # The draft length follows the copying: doubled after a run kept whole (up to the limit), else
        # just past what was kept.
        seq.draft_len = min(2 * k, self.num_speculative_tokens) if kept == k else max(2, kept + 1)
        if kept:
            seq.draft_misses = 0
        else:
            self._missed(seq, verified=True)
        return list(range(i, i + kept + 1))

    def _missed(self, seq: Sequence, verified: bool) -> None:
        """After drafts none of which was kept (verified), or in overlap mode after finding no draft,
        seq waits 2, 4, ... 32 steps before drafting again (a kept draft resets it): verifying costs
        compute, and in overlap mode a step that speculates is synchronous."""
        if verified or self.backoff:
            seq.draft_misses += 1
            seq.draft_retry_step = self.step_index + (1 << min(seq.draft_misses, 5))
