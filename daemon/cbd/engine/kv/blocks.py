"""KV block accounting: ref counts, chained-hash prefix reuse, copy-on-write, LRU of cached free blocks.

Pure Python, no tensors. Block states:
  - in use: ref_count > 0 (one ref per sequence whose table holds it);
  - cached free: ref_count == 0 but its content hash is registered, so a later prefix can revive it;
    kept in LRU order and evicted oldest first when nothing plainly free is left;
  - free: ref_count == 0 and no hash.
A block gets a hash only once it is full and its KV has been computed (`commit`), so a revived
block always holds valid KV. Writes only go to positions >= num_computed_tokens, which lie in a
partial or a new block; a shared partial block is copied before the write (copy-on-write).
A block whose KV is being copied to the host tier when it is freed carries a fence (the copy's
ticket) until it is next allocated; the plan that allocates it collects the fence (`take_fences`),
and that step's writes wait for the copy (`HostTier.fence_compute`, kv/host_tier.py).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from cbd.engine.sequence import Sequence


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()  # content of a hashed block, to rule out hash collisions


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() takes the lowest id
        self.cached_free: OrderedDict[int, None] = OrderedDict()  # block ids, least recently freed first
        self.hash_to_block: dict[int, int] = {}
        self.fences: dict[int, int] = {}  # block id -> ticket of a copy that still reads it
        self._taken_fences: set[int] = set()  # tickets of fenced blocks allocated since take_fences

    # ---- queries ----------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids) + len(self.cached_free)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self.cached_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache -----------------------------------------------------------------------
    def cacheable_hashes(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Hashes of seq's full blocks within its first num_tokens tokens."""
        return [self._block_hash(seq, i) for i in range(num_tokens // self.block_size)]

    def is_cached(self, block_hash: int) -> bool:
        return block_hash in self.hash_to_block

    def allocate_prefix(self, seq: Sequence) -> int:
        """Attach cached blocks matching seq's leading full blocks; returns the tokens they cover.

        The block holding the last token is never taken from the cache so that at least one token
        is computed and yields logits.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return 0
        hits: list[int] = []
        for index in range((seq.num_tokens - 1) // self.block_size):
            block_id = self.hash_to_block.get(self._block_hash(seq, index))
            if block_id is None or self.blocks[block_id].token_ids != self._block_tokens(seq, index):
                break
            hits.append(block_id)
        for block_id in hits:
            self._take(block_id)
        seq.block_table, seq.num_committed_blocks = hits, 0
        return len(hits) * self.block_size

    def commit_all(self, seqs: Iterable[Sequence]) -> None:
        """Register hashes of each sequence's blocks that are full, computed (or being computed, in stream
        order before any later reader) and whose token ids are all known. A sequence with no block newly
        full costs one comparison (a step's decodes fill a block every `block_size` tokens)."""
        if not self.enable_prefix_caching:
            return
        block_size = self.block_size
        for seq in seqs:
            known = len(seq.token_ids) - seq.num_placeholders - seq.num_draft  # num_known_tokens, inline (hot)
            computed = seq.num_computed_tokens
            end = (computed if computed < known else known) // block_size
            if end != seq.num_committed_blocks:
                self._commit_blocks(seq, end)

    def _commit_blocks(self, seq: Sequence, end: int) -> None:
        for index in range(min(seq.num_committed_blocks, len(seq.block_table)), end):
            block = self.blocks[seq.block_table[index]]
            if block.hash is not None:
                continue
            h = self._block_hash(seq, index)
            if h in self.hash_to_block:
                continue  # an identical block exists already; keep this one private
            block.hash, block.token_ids = h, self._block_tokens(seq, index)
            self.hash_to_block[h] = block.block_id
        seq.num_committed_blocks = end  # lower than before when computed tokens were rolled back

    def reset_prefix_cache(self) -> int:
        """Forget every cached free block (blocks in use keep their hashes); returns how many."""
        count = len(self.cached_free)
        for block_id in self.cached_free:
            block = self.blocks[block_id]
            del self.hash_to_block[block.hash]  # type: ignore[arg-type]
            block.hash, block.token_ids = None, ()
            self.free_ids.append(block_id)
        self.cached_free.clear()
        return count

    # ---- growth -----------------------------------------------------------------------------
    def fits(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether seq's next num_new_tokens fit in the blocks it has, the partial one private: `append`
        would do nothing (a decode step's case for block_size - 1 of every block_size steps)."""
        start, capacity = seq.num_computed_tokens, len(seq.block_table) * self.block_size
        return (
            start < capacity
            and start + num_new_tokens <= capacity
            and (self.blocks[seq.block_table[start // self.block_size]].ref_count == 1)
        )

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed_for(seq, num_new_tokens) <= self.num_free_blocks

    def blocks_needed_for(self, seq: Sequence, num_new_tokens: int) -> int:
        """Fresh blocks `append(seq, num_new_tokens)` takes: new ones, plus a copy of a shared partial one."""
        needed = max(0, self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table))
        first = seq.num_computed_tokens // self.block_size
        if first < len(seq.block_table) and self.blocks[seq.block_table[first]].ref_count > 1:
            needed += 1
        return needed

    def append(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Make seq's table cover its next num_new_tokens positions; returns (src, dst) block copies."""
        copies: list[tuple[int, int]] = []
        first = seq.num_computed_tokens // self.block_size
        if first < len(seq.block_table) and self.blocks[seq.block_table[first]].ref_count > 1:
            shared = seq.block_table[first]
            fresh = self._allocate()
            self.blocks[shared].ref_count -= 1
            seq.block_table[first] = fresh
            copies.append((shared, fresh))
        for _ in range(self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)):
            seq.block_table.append(self._allocate())
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child shares every block of parent (the shared partial block is copied on first write)."""
        for block_id in parent.block_table:
            self.blocks[block_id].ref_count += 1
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_committed_blocks = parent.num_committed_blocks

    def share(self, block_table: list[int]) -> list[int]:
        """Take one more reference on each block (a session keeping KV, a turn starting from it)."""
        for block_id in block_table:
            self._take(block_id)
        return list(block_table)

    def free(self, seq: Sequence) -> None:
        self.release(seq.block_table)
        seq.block_table, seq.num_committed_blocks = [], 0

    def allocate_blocks(self, count: int) -> list[int]:
        """`count` fresh private blocks (callers check num_free_blocks first)."""
        return [self._allocate() for _ in range(count)]

    def fence(self, block_ids: list[int], ticket: int) -> None:
        """A copy (ticket) reads these blocks: whoever is next given one must wait for it."""
        for block_id in block_ids:
            self.fences[block_id] = ticket

    def take_fences(self) -> set[int]:
        """Tickets of the fenced blocks allocated since the last call."""
        taken, self._taken_fences = self._taken_fences, set()
        return taken

    def release(self, block_table: list[int]) -> None:
        """Drop one reference on each block."""
        # Tail blocks first, so under LRU a prefix outlives the blocks that extend it.
        for block_id in reversed(block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is not None:
                    self.cached_free[block_id] = None
                else:
                    self.free_ids.append(block_id)

    def check_integrity(self, holders: Iterable[list[int]] | None = None) -> None:
        """Raise AssertionError unless the ref counts, the free list, the cached LRU and the hash table
        agree (tests call it after every step). `holders`: every block table that holds references
        (sequences, sessions, branches); each block's ref count must equal its number of holders."""
        free, cached = set(self.free_ids), set(self.cached_free)
        assert len(free) == len(self.free_ids), "a block is on the free list twice"
        assert not free & cached, f"blocks both free and cached: {sorted(free & cached)}"
        for block in self.blocks:
            b = block.block_id
            assert block.ref_count >= 0, f"block {b} has ref count {block.ref_count}"
            if block.ref_count == 0:
                assert b in free or b in cached, f"block {b} is unreferenced but neither free nor cached"
            else:
                assert b not in free and b not in cached, f"block {b} is in use (refs {block.ref_count}) and free"
            if b in free:
                assert block.hash is None, f"free block {b} still has a hash"
            if b in cached:
                assert block.hash is not None, f"cached free block {b} has no hash"
            if block.hash is not None:
                assert self.hash_to_block.get(block.hash) == b, f"block {b}'s hash is not registered to it"
        for h, b in self.hash_to_block.items():
            assert self.blocks[b].hash == h, f"hash table entry for block {b} does not match its hash"
        if holders is not None:
            counts = Counter(b for table in holders for b in table)
            wrong = {
                b.block_id: (b.ref_count, counts[b.block_id]) for b in self.blocks if b.ref_count != counts[b.block_id]
            }
            assert not wrong, f"ref counts differ from their holders (block: (refs, holders)): {wrong}"

    # ---- internals --------------------------------------------------------------------------
    def _allocate(self) -> int:
        if self.free_ids:
            block_id = self.free_ids.pop()
        elif self.cached_free:
            block_id, _ = self.cached_free.popitem(last=False)
            block = self.blocks[block_id]
            del self.hash_to_block[block.hash]  # type: ignore[arg-type]
            block.hash, block.token_ids = None, ()
        else:
            raise RuntimeError("KV pool exhausted; callers must check can_append first")
        self.blocks[block_id].ref_count = 1
        ticket = self.fences.pop(block_id, None)
        if ticket is not None:
            self._taken_fences.add(ticket)
        return block_id

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.cached_free[block_id]
        block.ref_count += 1

    def _block_tokens(self, seq: Sequence, index: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[index * self.block_size : (index + 1) * self.block_size])

    def _block_hash(self, seq: Sequence, index: int) -> int:
        """The chained hash of seq's block `index`; the chain starts from the request's cache scope, so
        blocks are shared only within one scope (a tenant). str hashes are salted per process: no caller
        can aim for a collision with another scope's chain."""
        while len(seq.block_hashes) <= index:
            i = len(seq.block_hashes)
            scope = seq.request.params.cache_scope
            parent = seq.block_hashes[i - 1] if i else (hash(scope) if scope else 0)
            seq.block_hashes.append(hash((parent, self._block_tokens(seq, i))))
        return seq.block_hashes[index]
