"""The host side of the device's token table (engine/device/token_rows.py): which known tokens a row is
sent, at which flat positions."""

from __future__ import annotations

from cbd.engine.device.token_rows import COLUMNS, SPAN, TokenRows
from cbd.engine.sampling_params import SamplingParams
from cbd.engine.sequence import Request, Sequence


def _seq(seq_id: int, tokens: list[int], prompt: int) -> Sequence:
    return Sequence(seq_id, Request(f"r{seq_id}", tokens[:prompt], SamplingParams(), 0), 0, list(tokens), prompt)


def _sync(rows: TokenRows, row: int, seq: Sequence) -> dict[int, int]:
    index: list[int] = []
    values: list[int] = []
    rows.sync(row, seq, index, values)
    return dict(zip(index, values, strict=True))


def test_a_row_is_sent_its_known_tokens_once() -> None:
    rows = TokenRows(4)
    seq = _seq(7, list(range(100, 120)), 10)
    assert _sync(rows, 2, seq) == {2 * COLUMNS + i: 100 + i for i in range(20)}
    assert _sync(rows, 2, seq) == {}  # nothing new
    seq.token_ids += [500, 501, 0]  # two known, then a placeholder in flight
    seq.num_placeholders = 1
    assert _sync(rows, 2, seq) == {2 * COLUMNS + 20: 500, 2 * COLUMNS + 21: 501}
    seq.token_ids += [9, 9]  # drafts in flight are not known
    seq.num_draft = 2
    assert _sync(rows, 2, seq) == {}


def test_a_row_that_held_another_sequence_is_written_whole() -> None:
    rows = TokenRows(4)
    first, second = _seq(1, [1, 2, 3, 4], 2), _seq(2, [5, 6, 7], 2)
    _sync(rows, 1, first)
    assert _sync(rows, 1, second) == {COLUMNS + i: t for i, t in enumerate([5, 6, 7])}
    rows.written(1, first)  # the device wrote first's drafts there: second's row must be written again
    assert len(_sync(rows, 1, second)) == 3
    rows.invalidate()  # a step failed before its launch: every row is written whole again
    assert len(_sync(rows, 1, second)) == 3


def test_a_long_sequence_is_sent_its_last_span_tokens_around_the_ring() -> None:
    rows = TokenRows(2)
    length = COLUMNS + 100
    seq = _seq(3, [i % 50000 for i in range(length)], 10)
    sent = _sync(rows, 1, seq)
    assert len(sent) == SPAN
    assert sent == {COLUMNS + p % COLUMNS: p % 50000 for p in range(length - SPAN, length)}
