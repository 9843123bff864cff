"""Drafts looked up on the device, in a verifying step's real context (the overlap loop's speculation).

When step N+1 is planned, step N is still on the device: a sequence's newest token is a placeholder and,
if N verifies drafts, how many N keeps is unknown. The host drafts after a guess (spec/speculator.py): N's
drafts all kept, N's token the drafter's first proposal. Where the guess is wrong (N rejected a draft, or
sampled another token) those drafts follow a context the sequence does not have, and are rejected. So the
device looks them up again before N+1's forward, once draft_carry.py has put N's token and kept count in
place: the same n-gram lookup as the host's drafter (the latest earlier occurrence of the longest of the
last 4, 3, 2 tokens; what followed it, within the known context), over the sequence's row of the token
table (device/token_rows.py) ending at its real newest token. A group whose context has a match gets
those tokens in its first draft rows (the host chose how many rows, the step's shape; where the match
has fewer tokens than the group has rows, the rest keep the host's drafts); one without keeps the host's.
The host learns the drafts the step verified with its sampled tokens (`step_drafts`). Every verifying
step also writes its groups' newest token and drafts into the table, so the next lookup sees the drafts
kept. Pure torch on the step's stream, no host sync; only verifying steps
do any of it.
"""

from __future__ import annotations

import torch

from cbd.engine.device.step_inputs import StepMeta, StepTensors
from cbd.engine.device.token_rows import COLUMNS, SPAN

NGRAMS = 4  # the longest n-gram matched (then 3, then 2), as the host drafter's NGRAM_SIZES


class DraftLookup:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._table: torch.Tensor | None = None  # [rows, COLUMNS] int32 token ids, made at first use
        # (table, rows, newest, newest token, depth, span) -> (drafts, found): `lookup`; a benchmark may replay.
        self.find = lookup

    def before_forward(self, t: StepTensors, meta: StepMeta) -> None:
        """A verifying step, its carried-over tokens and context lengths in place (draft_carry.py): apply
        the host's writes, look up the groups marked for drafting on the device, put their drafts in
        `t.ids`, and write every group's newest token and drafts into the table."""
        if t.verify_k is None or t.verify_seq is None or not meta.token_rows:
            return
        if self._table is None:
            self._table = torch.zeros(meta.token_rows, COLUMNS, dtype=torch.int32, device=self.device)
        table = self._table
        if t.token_index is not None and t.token_values is not None:
            table.view(-1).index_copy_(0, t.token_index, t.token_values.to(torch.int32))
        assert t.verify_ids is not None
        k = t.verify_k
        groups = k.shape[0]
        slots = t.verify_ids.view(groups, -1)  # [G, D] where each draft is in ids (padding: 0)
        depth = slots.shape[1]
        rows = t.table_rows.index_select(0, t.verify_seq)
        newest = t.ctx.index_select(0, t.verify_seq) - 1 - k  # each group's newest token's position
        # Each group's newest token (the one before its first draft), then its drafts: [G, 1 + D].
        tokens = t.ids[torch.cat([slots[:, :1] - 1, slots], 1)]
        columns = torch.arange(1 + depth, device=k.device)
        if t.redraft is not None:
            drafts, found = self.find(table, rows, newest, tokens[:, 0], depth, min(SPAN, meta.max_context_len))
            use = (columns[1:] <= torch.minimum(found, k)[:, None]) & (t.redraft[:, None] > 0)
            tokens[:, 1:] = torch.where(use, drafts, tokens[:, 1:])
            # Padding slots write ids[0] back to itself: a group's first token, never a draft.
            t.ids.index_copy_(0, slots.reshape(-1), tokens[:, 1:].reshape(-1))
        # Slots past a group's drafts write to the padding row (0), which no sequence holds.
        mine = torch.where(columns <= k[:, None], rows[:, None], 0)
        table[mine, (newest[:, None] + columns) % COLUMNS] = tokens.to(torch.int32)

    @staticmethod
    def step_drafts(t: StepTensors) -> torch.Tensor | None:
        """The drafts a step verified, [G * D] as `verify_ids` lays them out, when the device drafted some."""
        if t.redraft is None or t.verify_ids is None:
            return None
        return t.ids.index_select(0, t.verify_ids)


def lookup(
    table: torch.Tensor, rows: torch.Tensor, newest: torch.Tensor, token: torch.Tensor, depth: int, span: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """For each row's context ending at position `newest` with the token `token` there, over its last `span`
    positions: the `depth` tokens after the latest earlier occurrence of its longest matching last n-gram
    (n = 4, 3, 2), and how many of them lie within the context ([G, depth] int64, [G]; 0 found: no match)."""
    span = max(span, 2)
    device = newest.device
    offsets = torch.arange(span, device=device)
    positions = newest[:, None] - (span - 1) + offsets  # [G, span], the last column the newest token
    # int32 throughout ([G, 4, span] temporaries: a 16K context at batch 32 is 8 MB each)
    window = torch.where(positions >= 0, table[rows[:, None], positions % COLUMNS], -1)
    window[:, -1] = token.to(torch.int32)
    # Where an earlier occurrence may end (its follower is known: any position before the newest).
    ends = torch.arange(span - 1, device=device, dtype=torch.int32)
    back = torch.arange(NGRAMS, device=device)
    earlier = ends[None, :] - back[:, None]  # [n, span - 1] the i-th token back from each end
    tail = window[:, span - 1 - back]  # [G, n] the i-th token back from the newest
    same = (window[:, earlier.clamp(min=0)] == tail[:, :, None]) & (earlier >= 0) & (tail >= 0)[:, :, None]
    matches = same.to(torch.int8).cumprod(1).bool()  # [G, n, span - 1]: the last i + 1 tokens all match
    latest = torch.where(matches, ends, -1).amax(2)  # [G, n] the latest such end per n-gram size (-1: none)
    end = torch.where(latest[:, 3] >= 0, latest[:, 3], torch.where(latest[:, 2] >= 0, latest[:, 2], latest[:, 1]))
    found = torch.where(end >= 0, (span - 1 - end).clamp(max=depth), 0)
    follow = (end[:, None].to(torch.int64) + 1 + torch.arange(depth, device=device)).clamp(max=span - 1)
    return window.gather(1, follow).to(torch.int64), found.to(torch.int64)
