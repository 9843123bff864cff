"""The token masks of a step's constrained rows, filled on the host, each fill timed against its budget.

A mask row is filled from its sequence's grammar as it stands when the step is sampled: every token before
the row's position accepted (the caller completes the step in flight first), a verifying group's rows
after each of its drafts (`fill_drafted`, the matcher rolled back after). Rows without a grammar, or whose
sequence ended while the step was prepared, keep all ones (their logits pass unchanged). A request whose
fill exceeds `grammar_mask_budget_ms` in `grammar_mask_budget_steps` consecutive steps is handed back by
`take_over_budget` to be ended before the next step, as an abort is: a grammar whose mask costs grow with
its length (an ambiguous EBNF) would otherwise slow every sequence of the batch. A fill is timed in the
engine thread's CPU time, so a host busy with other processes does not end a request for their time.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from cbd.engine.sched.plan import StepPlan
from cbd.engine.sequence import Sequence


class GrammarMasks:
    def __init__(self, buffer: Callable[[int], torch.Tensor], budget_ms: float, budget_steps: int) -> None:
        """buffer(rows): a host bitmask with every token allowed (ModelRunner.mask_buffer)."""
        self.buffer = buffer
        self.budget_ms = budget_ms
        self.budget_steps = budget_steps
        self._over_budget: list[Sequence] = []  # ended before the next step

    def fill(self, plan: StepPlan) -> torch.Tensor:
        """[rows, ceil(vocab / 32)] int32 bitmask of each sample row's allowed tokens."""
        masks = self.buffer(len(plan.samples))
        skip = 0
        for i, row in enumerate(plan.samples):
            if skip:  # a verifying row, filled with the first of its group
                skip -= 1
                continue
            state, seq = row.target.grammar, row.target
            if row.num_draft:
                skip = row.num_draft
            if state is None or state.finished or seq.is_finished:
                continue
            started = time.thread_time()
            if row.num_draft:  # rows after the last known token and after each draft
                state.fill_drafted(masks, i, seq.token_ids[row.position : row.position + row.num_draft])
            else:
                state.fill(masks, i)
            budget = self.budget_ms / 1000 * (1 + row.num_draft)
            if state.over_budget(time.thread_time() - started, budget) == self.budget_steps:
                self._over_budget.append(seq)
        return masks

    def take_over_budget(self) -> list[Sequence]:
        """The sequences whose grammar went over budget since the last call (once each)."""
        over, self._over_budget = self._over_budget, []
        return over

    def error(self) -> str:
        """What a request ended for its grammar's cost is told."""
        return (
            f"grammar too expensive: filling its token mask took over {self.budget_ms:g} ms "
            f"in {self.budget_steps} steps in a row (grammar_mask_budget_ms)"
        )
