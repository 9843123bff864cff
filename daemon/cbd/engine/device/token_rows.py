"""The sequences' tokens on the device, where a step's drafts are looked up (device/draft_lookup.py): host side.

In the overlap loop a step is planned while the step before it is on the device: a sequence's newest token,
and how many of its drafts in flight that step keeps, are not known on the host yet. Its drafts are then
looked up again on the device, just before the forward, in its real context. For that the device keeps one
table of `num_rows` x `COLUMNS` token ids; a sequence's row is the one its block table has
(block_tables.py), and its position i is at column i mod `COLUMNS` (a ring: lookups read the last `SPAN`
positions). Who writes what:
- the host (`sync`), when it packs a step in which the device drafts for a sequence: the sequence's known
  tokens not yet written to its row (at first, or after the row held another sequence, its last `SPAN`
  known tokens; then what became known since). Known: everything before its tokens in flight;
- the device, in every verifying step: each group's first token (carried over from the step before) and its
  drafts, at their positions, before the forward. So the row holds the kept drafts and the token after
  them by the time the next step looks up, although the host learns them a step later.
A row's contents only ever propose drafts, and every draft is verified: an entry that is stale or wrong costs
kept drafts, never a token. Rows are `BlockTableRows`' (a row taken by another sequence is written whole
before the device drafts from it again: `written` records who wrote it last).
"""

from __future__ import annotations

from cbd.engine.sequence import Sequence

SPAN = 16384  # positions a lookup reads back from a sequence's newest token (the host drafter's window too)
COLUMNS = SPAN + 64  # the drafts a step writes past its newest token never reach the positions it reads


class TokenRows:
    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self._owner = [-1] * num_rows  # the sequence whose tokens a row holds (-1: none known)
        self._synced = [0] * num_rows  # ... its known tokens written there, from the start

    def sync(self, row: int, seq: Sequence, index: list[int], values: list[int]) -> None:
        """Before the device drafts for seq in row `row`: append the writes that bring the row's known
        tokens up to date (flat positions into the table, token ids) to index and values."""
        known = seq.num_known_tokens
        start = self._synced[row] if self._owner[row] == seq.seq_id else -1
        if start < 0 or start > known:  # another sequence's row, or cut back: its last SPAN tokens, whole
            start = max(0, known - SPAN)
        if start < known:
            base = row * COLUMNS
            index += [base + p % COLUMNS for p in range(start, known)]
            values += seq.token_ids[start:known]
        self._owner[row], self._synced[row] = seq.seq_id, known

    def written(self, row: int, seq: Sequence) -> None:
        """The device writes seq's drafts into `row` in this step (a verifying group it does not draft for)."""
        if self._owner[row] != seq.seq_id:
            self._owner[row], self._synced[row] = seq.seq_id, -1

    def invalidate(self) -> None:
        """A step failed between packing and launch: its writes may not have reached the device."""
        self._owner = [-1] * self.num_rows
