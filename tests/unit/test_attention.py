"""Reference paged attention equals dense causal attention on random inputs."""

from __future__ import annotations

import random

import pytest
import torch

from cbd.model.attention import build_metadata, paged_attention, write_kv


def dense_causal(q, k, v, scale, window=None):  # q [L,H,D], k/v [L,Hkv,D] -> [L,H,D]
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    length = q.shape[0]
    pos = torch.arange(length)
    mask = pos[None, :] <= pos[:, None]
    if window is not None:
        mask &= pos[None, :] > pos[:, None] - window
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (9, 3)])
@pytest.mark.parametrize("window", [None, 5])
def test_chunked_paged_attention_equals_dense(block_size: int, heads: tuple[int, int], window) -> None:
    """Several sequences, each fed in random chunks (first chunk = cached prefix or prefill; 1 = decode)."""
    rng = random.Random(block_size * 100 + heads[0])
    torch.manual_seed(rng.randrange(1000))
    num_heads, num_kv_heads, head_dim = heads[0], heads[1], 16
    lengths = [rng.randrange(1, 40) for _ in range(5)]
    num_blocks = sum(-(-n // block_size) for n in lengths) + 3
    kv_cache = torch.zeros(num_blocks * block_size, 2, num_kv_heads, head_dim)
    free = list(range(num_blocks))
    rng.shuffle(free)  # block tables are not contiguous
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lengths]
    q = [torch.randn(n, num_heads, head_dim) for n in lengths]
    k = [torch.randn(n, num_kv_heads, head_dim) for n in lengths]
    v = [torch.randn(n, num_kv_heads, head_dim) for n in lengths]
    outputs = [torch.empty(n, num_heads, head_dim) for n in lengths]
    done = [0] * len(lengths)
    scale = head_dim**-0.5
    while any(d < n for d, n in zip(done, lengths)):
        live = [i for i in range(len(lengths)) if done[i] < lengths[i]]
        chunk = {i: min(lengths[i] - done[i], rng.choice([1, 1, 3, 7, 40])) for i in live}
        meta = build_metadata(
            [chunk[i] for i in live], [done[i] + chunk[i] for i in live], [tables[i] for i in live],
            block_size, window,
        )  # fmt: skip
        new_k, new_v, new_q = (torch.cat([xs[i][done[i] : done[i] + chunk[i]] for i in live]) for xs in (k, v, q))
        write_kv(kv_cache, new_k, new_v, meta.slot_mapping)
        out = paged_attention(new_q, kv_cache, meta, scale)
        offset = 0
        for i in live:
            outputs[i][done[i] : done[i] + chunk[i]] = out[offset : offset + chunk[i]]
            offset += chunk[i]
            done[i] += chunk[i]
    for i in range(len(lengths)):
        expected = dense_causal(q[i], k[i], v[i], scale, window)
        torch.testing.assert_close(outputs[i], expected, atol=1e-5, rtol=1e-5)


def test_metadata_rejects_tables_that_do_not_cover_the_context() -> None:
    with pytest.raises(ValueError, match="do not cover"):
        build_metadata([1], [9], [[0, 1]], block_size=4)


@pytest.mark.parametrize("window", [None, 7])
def test_grouped_reference_equals_padded_on_a_mixed_step(window) -> None:
    """One long prefill chunk among many short decodes: grouped by shape (CPU path) == padded reference."""
    from cbd.model.attention import GroupedMetadata, grouped_metadata, layout_from_lists, reference_metadata

    rng = random.Random(3)
    torch.manual_seed(3)
    block_size, num_heads, num_kv_heads, head_dim = 4, 6, 2, 8
    query_lens = [1] * 20 + [3, 90, 17]
    context_lens = [rng.randrange(1, 60) for _ in range(20)] + [5, 150, 40]
    num_blocks = sum(-(-c // block_size) for c in context_lens)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-c // block_size))] for c in context_lens]
    order = list(range(len(query_lens)))
    rng.shuffle(order)  # decodes and prefills interleaved in the packed rows
    query_lens, context_lens, tables = ([xs[i] for i in order] for xs in (query_lens, context_lens, tables))
    kv_cache = torch.randn(num_blocks * block_size, 2, num_kv_heads, head_dim)
    q = torch.randn(sum(query_lens), num_heads, head_dim)
    layout = layout_from_lists(query_lens, context_lens, tables, block_size)
    grouped = grouped_metadata(layout, block_size, window)
    assert isinstance(grouped, GroupedMetadata) and len(grouped.groups) > 1
    assert torch.equal(grouped.slot_mapping, layout.slot_mapping)
    expected = paged_attention(q, kv_cache, reference_metadata(layout, block_size, window), 0.3)
    torch.testing.assert_close(grouped.attend(q, kv_cache, 0.3), expected, atol=1e-6, rtol=1e-5)
    uniform = layout_from_lists([1] * 4, [9, 10, 11, 12], tables[:4], block_size)
    assert not isinstance(grouped_metadata(uniform, block_size), GroupedMetadata)  # nothing to gain
