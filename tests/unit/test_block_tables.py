"""The device's persistent block table: after each step's writes, every row a step reads holds exactly its
sequence's table followed by scratch entries (what packing each whole table gave), whatever the tables did
between steps: grow, copy-on-write in place, cut, replaced by another list, freed and re-admitted, rows reused."""

from __future__ import annotations

import itertools
import random

import pytest

from cbd.engine.device.block_tables import PADDING_ROW, BlockTableRows
from cbd.engine.sampling_params import SamplingParams
from cbd.engine.sequence import Request, Sequence

SCRATCH = 999
COLUMNS = 12
_ids = itertools.count()


def seq() -> Sequence:
    request = Request(f"r{next(_ids)}", [1], SamplingParams(), seed=0)
    return Sequence(next(_ids), request, 0, [1], 1)


class DeviceTable:
    """A plain-list stand-in for the device tensor: the writes applied, rows read back."""

    def __init__(self, rows: int) -> None:
        self.flat = [SCRATCH] * (rows * COLUMNS)

    def step(self, tables: BlockTableRows, seqs: list[Sequence]) -> list[list[int]]:
        index: list[int] = []
        values: list[int] = []
        rows = tables.sync(seqs, index, values)
        assert len(index) == len(values) == len(set(index))
        for i, v in zip(index, values, strict=True):
            self.flat[i] = v
        return [self.flat[r * COLUMNS : (r + 1) * COLUMNS] for r in rows]


def expected(s: Sequence) -> list[int]:
    return s.block_table + [SCRATCH] * (COLUMNS - len(s.block_table))


def test_a_decode_writes_only_its_new_block() -> None:
    tables = BlockTableRows(5, COLUMNS, SCRATCH)
    device = DeviceTable(5)
    a, b = seq(), seq()
    a.block_table, b.block_table = [3, 4], [7]
    assert device.step(tables, [a, b]) == [expected(a), expected(b)]
    index: list[int] = []
    tables.sync([a, b], index, [])
    assert index == []  # nothing changed: nothing written
    a.block_table.append(5)
    values: list[int] = []
    tables.sync([a, b], index, values)
    assert values == [5] and len(index) == 1


def test_rows_follow_every_kind_of_table_change() -> None:
    rng = random.Random(0)
    num_rows = 6  # at most 4 sequences a step: the padding row, and one row to spare
    tables = BlockTableRows(num_rows, COLUMNS, SCRATCH)
    device = DeviceTable(num_rows)
    pool = [seq() for _ in range(10)]
    for _ in range(3000):
        for s in pool:
            op = rng.random()
            if op < 0.4 and len(s.block_table) < COLUMNS:
                s.block_table.append(rng.randrange(100))  # grow
            elif op < 0.5 and s.block_table:
                s.block_table[rng.randrange(len(s.block_table))] = rng.randrange(100)  # copy-on-write in place
            elif op < 0.6:
                del s.block_table[rng.randrange(len(s.block_table) + 1) :]  # drafts or a restore cut
            elif op < 0.65:
                s.block_table = [rng.randrange(100) for _ in range(rng.randrange(COLUMNS + 1))]  # a new list
            elif op < 0.7:
                s.block_table = []  # freed (preempted), re-admitted later
        step = rng.sample(pool, rng.randrange(1, 5))
        assert device.step(tables, step) == [expected(s) for s in step]
        assert all(r != PADDING_ROW for r in tables.sync(step, [], []))
    assert device.flat[PADDING_ROW * COLUMNS : COLUMNS] == [SCRATCH] * COLUMNS


def test_a_failed_step_makes_the_next_rewrite_whole_rows() -> None:
    tables = BlockTableRows(4, COLUMNS, SCRATCH)
    device = DeviceTable(4)
    a, b = seq(), seq()
    a.block_table, b.block_table = [1, 2, 3, 4, 5], [6]
    device.step(tables, [a, b])
    a.block_table = [7]
    tables.sync([a, b], [], [])  # packed, never launched: its writes are lost
    tables.invalidate()
    c = seq()
    c.block_table = [8]
    assert device.step(tables, [c, b]) == [expected(c), expected(b)]
    assert device.step(tables, [a]) == [expected(a)]


def test_a_step_never_shares_a_row() -> None:
    tables = BlockTableRows(6, COLUMNS, SCRATCH)
    pool = [seq() for _ in range(20)]
    for start in range(0, 60, 3):
        step = [pool[(start + i) % 20] for i in range(4)]
        rows = tables.sync(step, [], [])
        assert len(set(rows)) == 4
    with pytest.raises(AssertionError):
        tables.sync(pool[:5], [], [])  # more sequences than the rows allow
