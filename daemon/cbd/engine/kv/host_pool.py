"""Host KV blocks: the host tier's accounting (ref counts and a free list; no tensors), and
`HostCopy`, the one record of a prefix's KV held on the host.

A host block holds one GPU block's KV (every layer) in host memory; the copies themselves are the
copier's (kv/copier.py). Sessions offloaded under GPU memory pressure hold references on their
host blocks, and a turn being restored from them holds one more until its copy is enqueued.
Blocks are handed out lowest id first, so the blocks of one offload are mostly contiguous and
the copier moves them in few large copies. A full block is known by its prefix-cache hash (and
tokens): offloading a block whose content the host holds already takes a reference on that copy
instead of copying again (`place`), so a system prompt many sessions share is on the host once.
Engine-thread only.
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass


@dataclass(slots=True)
class HostCopy:
    """The KV of a token prefix on the host: `block_ids[i]` holds tokens [i * block_size, (i + 1) *
    block_size) of the first `num_tokens`. A record holds one reference on each of its blocks; whoever
    holds it (a session's branch, a sequence, a restore) gives it back through `HostTier.release`."""

    block_ids: list[int]
    num_tokens: int


class HostPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts: dict[int, int] = {}  # blocks in use only
        self._free = list(range(num_blocks))  # a heap: the lowest id first
        heapq.heapify(self._free)
        self._by_hash: dict[tuple[int, tuple[int, ...]], int] = {}  # (hash, tokens) -> host block
        self._key: dict[int, tuple[int, tuple[int, ...]]] = {}  # host block -> its (hash, tokens)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def _allocate(self, count: int) -> list[int] | None:
        """`count` blocks with one reference each, in ascending id order; None (and nothing taken) if
        the pool has fewer free."""
        if count > len(self._free):
            return None
        ids = [heapq.heappop(self._free) for _ in range(count)]
        for i in ids:
            self.ref_counts[i] = 1
        return ids

    def place(self, keys: list[tuple[int, tuple[int, ...]] | None]) -> tuple[list[int], list[int]] | None:
        """Host blocks for a run of GPU blocks with these content keys ((hash, tokens) of a full block,
        None for a private one): the copy the host holds already, or a new block. Returns (host ids, the
        indices of the blocks to copy), or None (nothing taken) if the pool lacks room for the new ones."""
        found = [self._by_hash.get(k) if k is not None else None for k in keys]
        fresh = self._allocate(sum(1 for f in found if f is None))
        if fresh is None:
            return None
        ids: list[int] = []
        copy: list[int] = []
        it = iter(fresh)
        for index, (key, host_id) in enumerate(zip(keys, found, strict=True)):
            if host_id is None:
                host_id = next(it)
                copy.append(index)
                if key is not None and key not in self._by_hash:
                    self._by_hash[key], self._key[host_id] = host_id, key
            else:
                self.ref_counts[host_id] += 1
            ids.append(host_id)
        return ids, copy

    def missing(self, keys: list[tuple[int, tuple[int, ...]] | None]) -> int:
        """How many new blocks `place(keys)` would take."""
        return sum(1 for k in keys if k is None or k not in self._by_hash)

    def share(self, ids: list[int]) -> list[int]:
        for i in ids:
            assert i in self.ref_counts, f"host block {i} is free"
            self.ref_counts[i] += 1
        return list(ids)

    def release(self, ids: list[int]) -> None:
        for i in ids:
            refs = self.ref_counts.get(i, 0)
            assert refs > 0, f"host block {i} is released twice"
            if refs == 1:
                del self.ref_counts[i]
                key = self._key.pop(i, None)
                if key is not None:
                    del self._by_hash[key]
                heapq.heappush(self._free, i)
            else:
                self.ref_counts[i] = refs - 1

    def check_integrity(self, holders: list[list[int]]) -> None:
        """Each block's ref count equals its number of holders; free blocks are exactly those with none."""
        counts = Counter(i for table in holders for i in table)
        wrong = {i: (self.ref_counts.get(i, 0), counts[i]) for i in set(counts) | set(self.ref_counts)
                 if self.ref_counts.get(i, 0) != counts[i]}  # fmt: skip
        assert not wrong, f"host ref counts differ from their holders (block: (refs, holders)): {wrong}"
        assert len(set(self._free)) == len(self._free), "a host block is on the free list twice"
        assert not set(self._free) & set(self.ref_counts), "a host block is both free and in use"
        assert len(self._free) + len(self.ref_counts) == self.num_blocks, "host blocks lost"
