"""The block tables on the device: one persistent table whose rows the sequences hold, written where it changed.

Without it a step packs, converts and copies every scheduled sequence's whole block table: B x context /
block_size ids (at B = 256 and 1K-token contexts ~17K ids a step, 8x that at 8K). Instead the device keeps one
table of `num_rows` x `num_columns` block ids, a sequence the packer sees holds one of its rows, and a step
sends only which row each of its sequences reads and the entries that changed since the row was last
written: for a decoding sequence one id every `block_size` steps.

Host side (`BlockTableRows`, used by step_inputs.pack_step): per sequence id its row and a copy of what the
row holds. A step's sequence whose table still starts with that copy gets only its new tail written; any
other (a different list, or one edited in place: freed and re-admitted, forked, restored, copy-on-write of a
shared block, drafts cut) gets its row rewritten, and the entries past its new end reset to the scratch
block, so a row holds exactly its sequence's table followed by scratch entries, as the whole-table packing
did. The comparison is the rule, not a promise from the table's writers: nothing that edits a block table
has to tell this module. Rows are reused least recently used first; with one row more than a step has
sequences, a row taken for one of a step's sequences is never one another of them holds (those were used
most recently). Row 0 is never held: every entry is the scratch block, for a CUDA graph's padding
sequences. Should a step fail between its packing and its launch, `invalidate` forgets every row and
takes each as full: the next writes rewrite whole rows, so no row is read with an entry its sequence
did not put there.

Device side (ModelRunner): the writes are applied on the compute stream before the forward that reads
them (index_copy_ into the flattened table, in step order, so a step in flight has read its rows before the
next step's writes land); the step's tables are its rows' first `width` columns, gathered.
"""

from __future__ import annotations

from collections import OrderedDict

from cbd.engine.sequence import Sequence

PADDING_ROW = 0


class BlockTableRows:
    def __init__(self, num_rows: int, num_columns: int, scratch_block: int) -> None:
        """num_rows: more than a step's sequences, plus the padding row."""
        self.num_rows = num_rows
        self.num_columns = num_columns
        self.scratch_block = scratch_block
        self._free = list(range(num_rows - 1, PADDING_ROW, -1))
        self._lengths = [0] * num_rows  # leading entries of each row that are not the scratch block
        # seq_id -> (row, a copy of the ids the row holds), least recently used first.
        self._held: OrderedDict[int, tuple[int, list[int]]] = OrderedDict()

    def sync(self, seqs: list[Sequence], index: list[int], values: list[int]) -> list[int]:
        """The rows of seqs (a step's sequences, each once), appending the writes that bring them up to date
        (flat positions into the table, block ids) to index and values."""
        assert len(seqs) < self.num_rows - 1, "a step's sequences must not take each other's rows"
        held, columns = self._held, self.num_columns
        rows = []
        for seq in seqs:
            table = seq.block_table
            length = len(table)
            assert length <= columns, f"a block table of {length} blocks is wider than the device's"
            entry = held.get(seq.seq_id)
            if entry is None:
                row = self._take()
            else:
                held.move_to_end(seq.seq_id)
                row, copy = entry
            rows.append(row)
            if entry is not None:
                synced = len(copy)
                if length == synced and table == copy:  # nothing new: most steps of a decode
                    continue
                if length > synced and table[:synced] == copy:  # a new tail (a new block)
                    base = row * columns
                    index += range(base + synced, base + length)
                    new = table[synced:]
                    values += new
                    copy += new
                    self._lengths[row] = length
                    continue
            self._rewrite(seq.seq_id, row, table, index, values)
        return rows

    def _rewrite(self, seq_id: int, row: int, table: list[int], index: list[int], values: list[int]) -> None:
        """Row `row` holds seq_id's table from now on: all of it written, the old entries past it reset."""
        length, old = len(table), self._lengths[row]
        base = row * self.num_columns
        index += range(base, base + max(length, old))
        values += table
        values += [self.scratch_block] * (old - length)
        self._lengths[row] = length
        self._held[seq_id] = (row, list(table))

    def invalidate(self) -> None:
        """Forget every row (a step was packed and not launched): the next writes rewrite whole rows."""
        self._free = list(range(self.num_rows - 1, PADDING_ROW, -1))
        self._lengths = [0] + [self.num_columns] * (self.num_rows - 1)
        self._held.clear()

    def _take(self) -> int:
        """A row for a sequence that holds none: a free one, else the least recently used holder's."""
        if self._free:
            return self._free.pop()
        _, (row, _) = self._held.popitem(last=False)
        return row
