"""Speculation inside the overlap loop, on the device: each verifying group's kept count, and the next
step's inputs moved to where the kept drafts put them.

A step that verifies drafts leaves behind, on the device, how many drafts each of its verifying groups
kept (the leading drafts equal to the token sampled before each: the same rule as Speculator.verify on
the host, on the same tokens). The next step was planned before that count reached the host, with a
sequence's chunk booked as if every draft were kept. Before its forward, that step:
- takes the sequence's first token from row `carry_src + kept` of the previous step's samples (the token
  sampled after the last kept draft; `carry_group` names the group, 0 for an ordinary carry-over);
- moves the sequence's context length (`seq_group`) and its rows' sampling positions (`row_group`: the
  position-keyed randomness of seeded sampling) back by the drafts rejected; positions and KV slots
  follow from the context length, so the step computes exactly what it would have with the count known.
Groups are numbered 1.. in the packed arrays (0: not after a verifying group), so one gather does
every row. The host learns the count when the verifying step completes, and moves its own booking
back the same way (Speculator.verify). Pure torch on the step's stream; no host sync.
"""

from __future__ import annotations

import torch

from cbd.engine.device.step_inputs import StepTensors


class DraftCarry:
    def __init__(self) -> None:
        self._kept: torch.Tensor | None = None  # [1 + G] the last step's kept drafts per group (0 first)
        self._shift: torch.Tensor | None = None  # [1 + G] kept - drafts: how far its next chunks move back

    def after_sample(self, t: StepTensors, token_ids: torch.Tensor | None) -> None:
        """Count the kept drafts of a step that was just sampled (`token_ids`: its rows' tokens)."""
        if t.verify_k is None or token_ids is None:
            self._kept = self._shift = None
            return
        assert t.verify_ids is not None and t.verify_rows is not None
        num_drafts = t.verify_k
        groups = num_drafts.shape[0]
        drafts = t.ids.index_select(0, t.verify_ids).view(groups, -1)
        sampled = token_ids.index_select(0, t.verify_rows).view(groups, -1)
        real = torch.arange(drafts.shape[1], device=drafts.device) < num_drafts[:, None]
        kept = ((drafts == sampled) & real).to(torch.int64).cumprod(1).sum(1)
        zero = kept.new_zeros(1)
        self._kept = torch.cat([zero, kept])
        self._shift = torch.cat([zero, kept - num_drafts])

    def carry_rows(self, t: StepTensors) -> torch.Tensor:
        """The previous step's sample rows the carried-over tokens come from."""
        assert t.carry_src is not None
        if t.carry_group is None:
            return t.carry_src
        assert self._kept is not None, "a chunk after drafts, but the last step verified none"
        return t.carry_src + self._kept.index_select(0, t.carry_group)

    def move_back(self, t: StepTensors) -> None:
        """Context lengths and sampling positions of the chunks after drafts, less the drafts rejected."""
        if t.seq_group is None:
            return
        assert self._shift is not None, "a chunk after drafts, but the last step verified none"
        t.ctx.add_(self._shift.index_select(0, t.seq_group))
        if t.row_group is not None and t.position is not None:
            t.position.add_(self._shift.index_select(0, t.row_group))
