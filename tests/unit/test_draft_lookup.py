"""The device's draft lookup (engine/device/draft_lookup.py) against the host drafter's n-gram index (the
oracle): the same tokens after the same context, over the ring of the token table."""

from __future__ import annotations

import random

import torch

from cbd.engine.device.draft_lookup import lookup
from cbd.engine.device.token_rows import COLUMNS, SPAN
from cbd.engine.spec.drafter import NgramIndex


def _host(tokens: list[int], end: int, depth: int) -> list[int]:
    """What the host drafter proposes after tokens[:end + 1], all of them known."""
    index = NgramIndex()
    index.extend(tokens, end + 1)
    return index.lookup(tokens, end + 1, depth, known=end + 1)


def test_the_device_lookup_proposes_what_the_host_index_does() -> None:
    rng = random.Random(0)
    depth = 8
    for trial in range(40):
        length = rng.randrange(1, 300)
        vocab = rng.choice([3, 5, 20, 1000])  # few symbols: many matches of every size
        tokens = [rng.randrange(vocab) for _ in range(length)]
        if trial % 3 == 0 and length > 40:  # a copy of an earlier stretch, as agents make
            start = rng.randrange(length // 2)
            tokens[length - 20 :] = tokens[start : start + 20]
        rows = torch.tensor([1, 2])
        table = torch.zeros(3, COLUMNS, dtype=torch.int32)
        ends = [rng.randrange(length), length - 1]
        for row, end in zip(rows.tolist(), ends):
            table[row, : end + 1] = torch.tensor(tokens[: end + 1], dtype=torch.int32)
            table[row, end + 1 : end + 30] = 7  # beyond the context: never read
        newest = torch.tensor([tokens[end] for end in ends])
        for row, end in zip(rows.tolist(), ends):
            table[row, end] = 12345  # the newest token is passed in, whatever the table holds there
        drafts, found = lookup(table, rows, torch.tensor(ends), newest, depth, min(SPAN, length))
        for g, end in enumerate(ends):
            expected = _host(tokens, end, depth)
            assert drafts[g, : found[g]].tolist() == expected, (trial, g, end)


def test_the_lookup_reads_positions_through_the_ring() -> None:
    """A context longer than the table's columns: position i at column i mod COLUMNS, the last SPAN read."""
    rng = random.Random(1)
    length = COLUMNS + 500
    tokens = [rng.randrange(50000) for _ in range(length)]
    tokens[-4:] = tokens[COLUMNS + 100 : COLUMNS + 104]  # its last 4-gram occurred 400 tokens back
    table = torch.zeros(2, COLUMNS, dtype=torch.int32)
    for i in range(length - SPAN, length):
        table[1, i % COLUMNS] = tokens[i]
    last = torch.tensor([tokens[-1]])
    drafts, found = lookup(table, torch.tensor([1]), torch.tensor([length - 1]), last, 6, SPAN)
    assert found.tolist() == [6]
    assert drafts[0].tolist() == tokens[COLUMNS + 104 : COLUMNS + 110]
    # No match: nothing found.
    assert lookup(table, torch.tensor([1]), torch.tensor([length - 1]), torch.tensor([99999]), 6, SPAN)[1].tolist() == [
        0
    ]
