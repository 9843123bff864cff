"""Speculation in a step: which sequences may try drafts, their drafts, the backoff after misses, and
the verification of a completed step's drafts.

A decoding sequence gets up to `num_speculative_tokens` draft tokens from the drafter (drafter.py),
within the token budget and free blocks that every running chunk and admission left over (drafts never
preempt, evict or delay anything: `add_drafts`); its chunk is its last token plus the drafts, and the
step samples a token after each of them (`verifying_rows`: one `SampleRow` per position, the same
position-keyed randomness as without drafts). `verify` keeps the drafts up to the first one that
differs from the token sampled before it, then that sampled token: exactly the tokens the sequence
would have got one step at a time, greedy or seeded. The KV of the rejected positions is left behind
the sequence's end (overwritten when those positions are computed again) and the blocks that only they
used are freed; drafts are never committed to the prefix cache.

In the overlap loop the step in flight has not said its tokens yet when the next is planned, so drafts
follow a guess: the drafter reads the context up to the token in flight (with the drafts in flight
taken as kept) and proposes one more token than asked, the first standing for the token in flight and
dropped. A wrong guess costs only compute: verification compares with what the model samples after
the real tokens, which the device puts in place (device/draft_carry.py); and with `device_drafts` the
device looks the drafts up again in the real context before the step's forward (device/draft_lookup.py),
so the guess decides only how many drafts a sequence verifies. `verify` takes the drafts the step
verified. A constrained sequence drafts only when its tokens are all known (its grammar checks drafts):
a step that gives it drafts completes the step in flight first (`needs_known_tokens`).

Per-sequence draft state lives on the Sequence (`draft_len`, `draft_misses`, `draft_retry_step`,
`draft_accept`, `draft_index`, `num_draft`, `pending_group`, `next_rows`); the step counter of the
backoff, the acceptance prior (`prior`), the tenant-wide donors (`agents`) and the counts live here.
Pure Python.
"""

from __future__ import annotations

from cbd.engine.kv.blocks import BlockManager
from cbd.engine.sched.plan import SampleRow, ScheduledChunk, StepPlan
from cbd.engine.sequence import Sequence
from cbd.engine.spec.agent_index import AgentIndex
from cbd.engine.spec.drafter import Drafter
from cbd.engine.spec.policy import START_ACCEPT, StepCosts, observed_accept

STALE_STEPS = 128  # steps without a verification after which the prior is one half again
NEWCOMER = 0.5  # in a step of several sequences, one without an estimate of its own is weighed at this x prior
NO_DRAFT_WAIT = 2  # overlap mode: steps a sequence waits after it found no draft or its drafts were declined


class Speculator:
    def __init__(
        self, block_manager: BlockManager, max_model_len: int, drafter: Drafter | None, num_speculative_tokens: int,
        max_batch: int | None = None, agents: AgentIndex | None = None,
    ) -> None:  # fmt: skip
        """drafter None: speculation off. max_batch: no speculation with more running sequences ("auto").
        agents: the finished sequences the drafter also searches (agent_index.py), fed by `finished`."""
        self.block_manager = block_manager
        self.agents = agents
        self.max_model_len = max_model_len
        self.drafter = drafter
        self.num_speculative_tokens = num_speculative_tokens if drafter is not None else 0
        self.max_batch = max_batch
        # "auto" with verifying CUDA graphs: their measured costs decide whether a decode step drafts (policy.py)
        self.costs: StepCosts | None = None
        self.backoff = False  # overlap mode: after finding no draft, a sequence waits before drafting again
        # Overlap mode: the device drafts again, after the step in flight, for a sequence whose newest token is
        # in flight (device/draft_lookup.py), so its drafts follow its real tokens rather than the guess.
        self.device_drafts = False
        self.step_index = 0  # steps scheduled so far (the backoff's clock; the scheduler advances it)
        self.num_draft_tokens = 0  # proposed and verified
        self.num_accepted_tokens = 0  # of those, kept
        self.num_speculative_steps = 0
        self.num_device_drafted = 0  # verifying groups whose drafts the device looked up anew (not the host's)
        self.accept_prior = START_ACCEPT  # drafts kept over drafts tried, recent verifications (see prior)
        self.newcomer = NEWCOMER
        self.last_verified_step = 0

    def worth_trying(self, running: list[Sequence], overlap: bool) -> bool:
        """Whether the next step may verify drafts: speculation on, the batch small enough and, in overlap
        mode (where drafting after a miss waits), some running sequence due to try."""
        if self.drafter is None or not running:
            return False
        if self.max_batch is not None and len(running) > self.max_batch:
            return False
        return not overlap or any(self.can_speculate(seq) for seq in running)

    def needs_known_tokens(self, running: list[Sequence]) -> bool:
        """Overlap mode: whether a step with drafts should first complete the step in flight, because a
        constrained sequence is due to try (its grammar checks drafts against known tokens)."""
        return any(seq.grammar is not None and self.can_speculate(seq) for seq in running)

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
        blocks that no chunk and no admission took (drafts never preempt or delay anything). A chunk whose
        token is still in flight drafts after a guess of it (see the module docstring). The drafts found
        are weighed first (`_draft_caps`): the step may take fewer per sequence, or none."""
        if self.agents is not None:
            self.agents.new_step()
        proposals = []
        for chunk in plan.chunks:
            if self._may_draft(chunk):
                drafts = self._propose(chunk.seq)
                if drafts:
                    proposals.append((chunk, drafts))
                elif not chunk.seq.num_draft:  # (after drafts in flight, it followed a guess of them)
                    self._missed(chunk.seq, verified=False)
        caps = self._draft_caps(plan, proposals)
        bm = self.block_manager
        budget = max_num_batched_tokens - plan.num_tokens
        for (chunk, drafts), cap in zip(proposals, caps, strict=True):
            seq = chunk.seq
            drafts = drafts[: min(cap, budget)]
            if not drafts or not bm.can_append(seq, 1 + len(drafts)):  # declined: those found wait as after a miss
                self._missed(seq, verified=False)
                continue
            seq.token_ids += drafts
            seq.num_draft += len(drafts)
            chunk.num_draft = len(drafts)
            plan.block_copies += bm.append(seq, 1 + len(drafts))
            chunk.num_new_tokens += len(drafts)
            budget -= len(drafts)

    def _propose(self, seq: Sequence) -> list[int]:
        """The drafts seq would verify now: as many as it asks for, within its max_tokens and the context."""
        room = min(
            self._draft_len(seq),
            seq.request.params.max_tokens - seq.num_output_tokens - 1,  # all kept + the token after them: the last one at most
            self.max_model_len - seq.num_tokens - 1,
        )  # fmt: skip
        if room <= 0 or self.drafter is None:
            return []
        if seq.num_placeholders:  # its token (and maybe drafts) still in flight: the first proposed stands for it
            drafts = self.drafter.propose(seq, room + 1, seq.num_tokens - 1)[1:]
        else:
            drafts = self.drafter.propose(seq, room)
        if drafts and seq.grammar is not None:  # only what the grammar allows next (checked, then undone)
            drafts = drafts[: seq.grammar.valid_prefix(drafts)]
        return drafts

    def _may_draft(self, chunk: ScheduledChunk) -> bool:
        """A decode chunk of a sequence due to try; a constrained one only with its tokens known."""
        seq = chunk.seq
        if chunk.num_new_tokens != 1 or seq.num_uncomputed != 1:
            return False
        return not (seq.num_placeholders and seq.grammar is not None) and self.can_speculate(seq)

    def _draft_len(self, seq: Sequence) -> int:
        """The drafts seq asks for next: 4 at first, then as its verifications set (see verify)."""
        return seq.draft_len or min(4, self.num_speculative_tokens)

    def _draft_caps(self, plan: StepPlan, proposals: list[tuple[ScheduledChunk, list[int]]]) -> list[int]:
        """The drafts each proposal's sequence may verify in this step (0: none). With measured step costs
        ("auto" on a GPU), those expected to make the most tokens per millisecond, if they beat the step
        without drafts (policy.py); a step that also prefills runs eagerly and takes its drafts."""
        if self.costs is None or any(c.num_new_tokens != 1 for c in plan.chunks):
            return [self.num_speculative_tokens] * len(proposals)
        # A sequence without an estimate of its own is weighed skeptically where others share the step: the
        # engine's acceptance is held up by the sequences that copy (they verify most), and a step verifying on
        # it costs every sequence in the batch. It earns its own estimate by keeping drafts.
        prior = self.prior() * (self.newcomer if len(plan.chunks) > 1 else 1.0)
        drafting = []
        for chunk, drafts in proposals:
            seq = chunk.seq
            accept = prior if seq.draft_accept is None else seq.draft_accept
            # Drafts made after drafts still in flight (the overlap loop) count only if those are all kept,
            # unless the device drafts for them again once the step in flight has said what it kept.
            after = 1.0 if self.device_drafts and seq.grammar is None else accept**seq.num_draft
            drafting.append((accept, len(drafts), after))
        return self.costs.plan_drafts(len(plan.chunks), drafting)

    def verifying_rows(self, chunk: ScheduledChunk, rows: list[SampleRow], group: int) -> None:
        """Booking a chunk with drafts, whose one sample row (its newest placeholder's) was just appended:
        that row becomes a group of 1 + num_draft rows, after the chunk's first token and after each draft.
        group: its number among the plan's verifying groups (the device's kept counts are in that order)."""
        seq, k = chunk.seq, chunk.num_draft
        first = seq.num_tokens - 1 - k  # position of the first draft
        rows[-1:] = [SampleRow(seq, seq, first + i) for i in range(k + 1)]
        rows[-k - 1].num_draft = k
        seq.pending_row, seq.pending_group = len(rows) - k - 1, group
        # If all are kept, the token after them may be the last; verify decides again with the kept count.
        seq.final_in_flight = seq.length_limit_reached(seq.num_tokens, self.max_model_len)
        self.num_draft_tokens += k
        self.num_speculative_steps += 1

    def verify(
        self, seq: Sequence, row: SampleRow, i: int, token_ids: list[int], drafts: list[int] | None = None
    ) -> list[int]:
        """Keep seq's drafts up to the first that differs from the token sampled before it, then that
        sampled token; cut the rest and free the blocks only they used. What was booked after them (the
        next step's rows, in the overlap loop) moves back by the drafts cut. drafts: those the step verified,
        where the device may have drafted them (device/draft_lookup.py). Returns the rows kept."""
        first, k = row.position, row.num_draft
        if drafts is not None and drafts != seq.token_ids[first : first + k]:
            seq.token_ids[first : first + k] = drafts
            self.num_device_drafted += 1
        kept = 0
        while kept < k and token_ids[i + kept] == seq.token_ids[first + kept]:
            kept += 1
        end = first + kept  # the token sampled after the kept drafts goes here; its KV is not computed yet
        seq.token_ids[end] = token_ids[i + kept]
        cut = k - kept
        del seq.token_ids[end + 1 : end + 1 + cut]  # the rejected drafts (the placeholder is now `end`)
        if seq.grammar is not None:  # each sampled under its row's mask: the grammar after the drafts before it
            for token in seq.token_ids[first : end + 1]:
                seq.grammar.accept(token)
        seq.num_draft -= k
        seq.num_placeholders -= 1
        seq.num_computed_tokens = max(0, seq.num_computed_tokens - cut)
        if seq.next_rows is not None:  # booked as if all were kept: the device has placed them `cut` earlier
            for later in seq.next_rows:
                later.position -= cut
            seq.next_rows = None
        seq.final_in_flight = seq.length_limit_reached(seq.num_tokens, self.max_model_len)
        bm = self.block_manager
        keep_blocks = bm.blocks_needed(seq.num_computed_tokens)
        if len(seq.block_table) > keep_blocks:
            bm.release(seq.block_table[keep_blocks:])
            del seq.block_table[keep_blocks:]
            seq.num_committed_blocks = min(seq.num_committed_blocks, keep_blocks)
        self.num_accepted_tokens += kept
        # The estimates the cost policy weighs: the engine's recent acceptance, the prior of a sequence that has
        # not verified yet or missed last (its retry is delayed by the backoff below), and the sequence's own.
        observed = observed_accept(kept, k)
        last = seq.draft_accept if seq.draft_accept is not None else self.prior()
        if self._quiet():  # nothing verified lately: start again
            self.accept_prior = START_ACCEPT
        self.accept_prior = 0.9 * self.accept_prior + 0.1 * observed
        self.last_verified_step = self.step_index
        seq.draft_accept = 0.5 * last + 0.5 * observed if kept else None
        # The draft length follows the copying: doubled after a run kept whole (up to the limit), else
        # just past what was kept.
        # A run kept whole that the step's cap (or budget) cut short does not shorten what the sequence asks for.
        if kept == k:
            seq.draft_len = max(self._draft_len(seq), min(2 * k, self.num_speculative_tokens))
        else:
            seq.draft_len = max(2, kept + 1)
        if kept:
            seq.draft_misses = 0
        else:
            self._missed(seq, verified=True)
        return list(range(i, i + kept + 1))

    def finished(self, seq: Sequence) -> None:
        """seq stopped (or reached its length): its tokens become a donor of drafts for its tenant's
        other sequences (a session turn's replaces that session's last)."""
        if self.agents is not None:
            self.agents.add(seq.request.tenant, seq.request.session, seq.token_ids, seq.draft_index)

    def prior(self) -> float:
        """A sequence's chance that a draft is kept before it has verified any (or after a miss): the engine's
        recent acceptance, or one half when nothing was verified for `STALE_STEPS` steps (so a workload that
        turned to copying is noticed again)."""
        return START_ACCEPT if self._quiet() else self.accept_prior

    def _quiet(self) -> bool:
        """Nothing was verified for `STALE_STEPS` steps."""
        return self.step_index - self.last_verified_step > STALE_STEPS

    def _missed(self, seq: Sequence, verified: bool) -> None:
        """After drafts none of which was kept (verified), seq waits 2, 4, ... 32 steps before drafting again
        (a kept draft resets it): verifying costs compute. In overlap mode, after finding no draft (with no
        drafts of its own in flight) or a step that declined its drafts, it waits `NO_DRAFT_WAIT` steps:
        looking for drafts and weighing them cost host time, which the overlap loop hides only while it is
        shorter than the device's step, and a constrained sequence that asks for drafts makes the step
        synchronous (needs_known_tokens); but a copy can start at any token, so the wait does not grow."""
        if verified:
            seq.draft_misses += 1
            seq.draft_retry_step = self.step_index + (1 << min(seq.draft_misses, 5))
        elif self.backoff:
            seq.draft_retry_step = self.step_index + NO_DRAFT_WAIT
