"""A step's plan: the chunks the scheduler picked, the rows it samples, and what must happen before it.

The plan is made and booked by the scheduler (sched/scheduler.py) and read by the packer
(step_inputs.pack_step) and the accounting at completion. Invariants a reader relies on:
- a chunk's `start`, `carry_row`, `carry_group`, `samples` and `num_draft` are recorded when the plan is booked; the
  sequence's own counters have moved on by the time the plan is packed, so nothing else is read then;
- `samples` are in chunk order, a parent's forks right after it, and a verifying group (`num_draft`
  > 0 on its first row) is num_draft + 1 consecutive rows of one sequence, positions in order.
Knows no devices.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cbd.engine.sequence import Sequence


@dataclass(slots=True)
class ScheduledChunk:
    seq: Sequence
    num_new_tokens: int
    # Recorded when the plan is booked (the sequence moves on at once):
    start: int = 0  # num_computed_tokens before the step: the chunk is token_ids[start : start + num_new_tokens]
    carry_row: int = -1  # >= 0: its first token is in flight, sampled at this row of the previous step
    # >= 0: ... after the drafts of that step's verifying group number carry_group: the token is at row
    # carry_row + (drafts kept), and the chunk's positions are booked as if all were kept (the device moves
    # them back by the drafts rejected; see Sequence.next_rows)
    carry_group: int = -1
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
    def constrained(self) -> bool:
        """Some row samples under a grammar: its sampling waits for the rows' token masks."""
        return any(row.target.grammar is not None for row in self.samples)

    def __bool__(self) -> bool:
        return bool(self.chunks)
