"""Block manager: prefix hits and misses, ref counts, copy-on-write, LRU eviction, nothing leaked."""

from __future__ import annotations

import itertools

from cbd.engine.kv.blocks import BlockManager
from cbd.engine.sampling_params import SamplingParams
from cbd.engine.sequence import Request, Sequence

_ids = itertools.count()


def seq(tokens: list[int]) -> Sequence:
    request = Request(f"r{next(_ids)}", list(tokens), SamplingParams(), seed=0)
    return Sequence(next(_ids), request, 0, list(tokens), len(tokens))


def compute(bm: BlockManager, s: Sequence, n: int | None = None) -> list[tuple[int, int]]:
    """Allocate and 'compute' the next n tokens (all uncomputed by default), as a step would."""
    n = s.num_uncomputed if n is None else n
    assert bm.can_append(s, n)
    copies = bm.append(s, n)
    s.num_computed_tokens += n
    bm.commit_all([s])
    return copies


def test_prefix_hit_reuses_full_blocks_and_never_the_last_token() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq(list(range(10)))  # blocks [0-3] [4-7] [8-9]
    assert bm.allocate_prefix(a) == 0
    compute(bm, a)
    b = seq(list(range(10)) + [99])
    assert bm.allocate_prefix(b) == 8  # two full blocks shared
    assert b.block_table == a.block_table[:2]
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    c = seq(list(range(8)))  # exactly two full blocks: the one holding the last token is recomputed
    assert bm.allocate_prefix(c) == 4
    d = seq([5] + list(range(1, 10)))  # first block differs: chained hashes miss everything after it
    assert bm.allocate_prefix(d) == 0


def test_free_keeps_hashed_blocks_cached_and_they_revive() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(list(range(9)))
    bm.allocate_prefix(a)
    compute(bm, a)
    bm.free(a)
    assert bm.num_used_blocks == 0
    assert bm.num_cached_free_blocks == 2  # the two full blocks; the partial one is plainly free
    b = seq(list(range(9)))
    assert bm.allocate_prefix(b) == 8
    assert bm.num_cached_free_blocks == 0 and bm.num_used_blocks == 2


def test_lru_evicts_oldest_freed_and_tail_first() -> None:
    bm = BlockManager(num_blocks=6, block_size=2)
    a, b = seq([1, 2, 3, 4, 0]), seq([5, 6, 0])  # a: 2 full + 1 partial block; b: 1 full + 1 partial
    for s in (a, b):
        bm.allocate_prefix(s)
        compute(bm, s)
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    bm.free(a)  # a's tail block enters the LRU before its head
    bm.free(b)
    assert list(bm.cached_free) == [a_blocks[1], a_blocks[0], b_blocks[0]]
    c = seq([9] * 9)  # needs 5 blocks: the 3 plainly free ones, then the 2 least recently freed
    bm.allocate_prefix(c)
    compute(bm, c)
    assert list(bm.cached_free) == [b_blocks[0]]
    bm.free(c)
    assert bm.allocate_prefix(seq([1, 2, 3, 4, 0])) == 0  # a's prefix was evicted
    assert bm.allocate_prefix(seq([5, 6, 0])) == 2  # b's survived


def test_fork_shares_blocks_and_copy_on_write_splits_the_partial_block() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = seq(list(range(6)))  # one full block + one partial
    bm.allocate_prefix(parent)
    compute(bm, parent)
    child = seq([])
    child.token_ids, child.num_prompt_tokens = list(parent.token_ids), 6
    child.num_computed_tokens = parent.num_computed_tokens
    bm.fork(parent, child)
    full, partial = parent.block_table
    assert bm.blocks[full].ref_count == 2 and bm.blocks[partial].ref_count == 2
    for s, tok in ((parent, 100), (child, 200)):
        s.token_ids.append(tok)
    copies = compute(bm, child, 1)
    assert len(copies) == 1 and copies[0][0] == partial
    assert child.block_table[0] == full and child.block_table[1] == copies[0][1] != partial
    assert bm.blocks[partial].ref_count == 1
    assert compute(bm, parent, 1) == []  # now sole owner: writes in place
    bm.free(parent)
    bm.free(child)
    assert bm.num_used_blocks == 0


def test_can_append_counts_the_copy_on_write_block() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    parent = seq([1, 2, 3])
    bm.allocate_prefix(parent)
    compute(bm, parent)
    child = seq([1, 2, 3])
    child.num_computed_tokens = 3
    bm.fork(parent, child)
    child.token_ids.append(7)
    assert bm.can_append(child, 1)  # one free block for the copy
    compute(bm, child, 1)
    parent.token_ids.append(8)
    assert bm.can_append(parent, 1)  # sole owner again: no new block needed
    assert not bm.can_append(parent, 2)  # crossing into a new block with none free


def test_prefix_caching_off_never_shares() -> None:
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = seq([1, 2, 3, 4, 5])
    compute(bm, a)
    b = seq([1, 2, 3, 4, 5])
    assert bm.allocate_prefix(b) == 0
    bm.free(a)
    assert bm.num_cached_free_blocks == 0 and bm.num_used_blocks == 0


def test_reset_prefix_cache_forgets_only_free_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    live, gone = seq([1, 2, 3, 4, 5]), seq([7, 8, 9])
    for s in (live, gone):
        compute(bm, s)
    bm.free(gone)
    assert bm.reset_prefix_cache() == 1
    assert bm.allocate_prefix(seq([7, 8, 9])) == 0  # forgotten
    assert bm.allocate_prefix(seq([1, 2, 3, 4, 5])) == 4  # still held by a live sequence


def test_commit_looks_only_at_blocks_it_has_not_seen_and_rolled_back_blocks_again() -> None:
    bm = BlockManager(num_blocks=32, block_size=2)
    a = seq([1, 2, 3, 4])
    bm.allocate_prefix(a)
    compute(bm, a)
    twin = seq([1, 2, 3, 4])  # the same tokens computed privately (no prefix taken): copies of a's blocks
    bm.append(twin, 4)
    twin.num_computed_tokens = 4
    looked: list[int] = []
    hash_block = bm._block_hash
    bm._block_hash = lambda s, i: looked.append(i) or hash_block(s, i)  # type: ignore[method-assign]
    bm.commit_all([twin])
    assert looked == [0, 1] and all(bm.blocks[b].hash is None for b in twin.block_table)  # kept private
    for token in (5, 6, 7, 8):  # decode steps: each commit looks at the newly full block alone
        twin.token_ids.append(token)
        compute(bm, twin, 1)
    assert looked == [0, 1, 2, 3]
    # A rollback (drafts rejected) cuts blocks: the ones appended again in their place are registered.
    del twin.token_ids[6:]
    twin.num_computed_tokens = 6
    bm.release(twin.block_table[3:])
    del twin.block_table[3:]
    twin.num_committed_blocks = min(twin.num_committed_blocks, 3)
    del twin.block_hashes[3:]
    twin.token_ids += [9, 10]
    compute(bm, twin)
    assert looked[-1] == 3 and bm.blocks[twin.block_table[3]].hash is not None
    b = seq([1, 2, 3, 4, 5, 6, 9, 10, 11])
    assert bm.allocate_prefix(b) == 8  # a's two blocks, then the twin's two registered ones
    bm.free(twin)
    assert twin.num_committed_blocks == 0
