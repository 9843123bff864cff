"""Paged attention for several queries per sequence at the end of its context, in Triton (CUDA).

Prefill, a prefill chunk over a cached prefix, or either mixed with decodes and drafts: flash-attention
style tiles with the causal mask; a tile packs queries x the query heads of one GQA group, so K/V are read
once per group. KV layout, FP8 handling and the online-softmax step are `triton_attention`'s (shared, so
a change to `triton_attention.FP8_WIDEN` applies to both). Honours a sliding window; the plain-torch
`attention.paged_attention` is the oracle.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from cbd.model import kv_format
from cbd.model.triton_attention import fp8_widening, online_softmax_block


@triton.jit(do_not_specialize=["sbt_b"])
def _extend_kernel(
    Q, KV, KVS, BT, QSTART, CTX, OUT, scale,
    sq_t, sq_h, skv_s, skv_kv, skv_h, ss_s, ss_kv, sbt_b, so_t, so_h,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr,
    SELECT: tl.constexpr, SHORT: tl.constexpr, FP8: tl.constexpr, WIDEN: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    # One program: BLOCK_Q queries of one sequence x the GROUP query heads of one KV head, packed as
    # BLOCK_Q * GROUP_PAD rows (row r: query r // GROUP_PAD, head r % GROUP_PAD), so that each K/V
    # tile is loaded once for the whole GQA group. SELECT 1: only sequences of at most SHORT queries;
    # 2: only longer ones; 0: all.
    m_block = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    kv_head = tl.program_id(2)
    q_start = tl.load(QSTART + b).to(tl.int32)
    q_len = tl.load(QSTART + b + 1).to(tl.int32) - q_start
    if m_block * BLOCK_Q >= q_len:
        return
    if SELECT == 1 and q_len > SHORT:
        return
    if SELECT == 2 and q_len <= SHORT:
        return
    ctx = tl.load(CTX + b).to(tl.int32)
    prefix = ctx - q_len
    r = tl.arange(0, BLOCK_Q * GROUP_PAD)
    m = m_block * BLOCK_Q + r // GROUP_PAD
    g = r % GROUP_PAD
    row_mask = (m < q_len) & (g < GROUP)
    heads = kv_head * GROUP + g
    q_pos = prefix + m
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    rows = (q_start + m).to(tl.int64)
    io_mask = row_mask[:, None] & d_mask[None, :]
    q = tl.load(Q + rows[:, None] * sq_t + heads[:, None] * sq_h + d[None, :], mask=io_mask, other=0.0)
    kv_base = KV + kv_head * skv_h
    qk_scale = scale * 1.4426950408889634
    if FP8 and WIDEN > 0:
        q = (q.to(tl.float32) * qk_scale).to(tl.float16)
        qk_scale = 1.0
    m_i = tl.full([BLOCK_Q * GROUP_PAD], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, BLOCK_D], tl.float32)
    hi = tl.minimum(ctx, prefix + (m_block + 1) * BLOCK_Q)
    lo = 0
    if WINDOW > 0:
        lo = tl.maximum(prefix + m_block * BLOCK_Q - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < hi
        page = tl.load(BT + b * sbt_b + n // PAGE, mask=n_mask, other=0)
        slot = page.to(tl.int64) * PAGE + n % PAGE
        ptr = kv_base + slot[:, None] * skv_s + d[None, :]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        allowed = n_mask[None, :] & (n[None, :] <= q_pos[:, None])
        if WINDOW > 0:
            allowed = allowed & (n[None, :] > q_pos[:, None] - WINDOW)
        m_i, l_i, acc = online_softmax_block(
            q, ptr, kv_mask, allowed, skv_kv, qk_scale, m_i, l_i, acc, KVS + slot * ss_s + kv_head, n_mask, ss_kv,
            FP8, WIDEN, IEEE,
        )  # fmt: skip
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(OUT + rows[:, None] * so_t + heads[:, None] * so_h + d[None, :], out.to(OUT.dtype.element_ty),
             mask=io_mask)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Tile:
    """An extend launch's tile: rows (queries x the GQA group's heads), keys per step, warps, pipeline stages."""

    rows: int
    block_n: int
    warps: int
    stages: int


SHORT_TILE = Tile(16, 64, 4, 2)  # decodes and drafts beside a prefill
LONG_TILE = Tile(128, 64, 4, 3)  # prefills and prefill chunks (~130 KB of shared memory at head_dim 128)
LONG_TILE_FP8 = Tile(64, 128, 4, 2)
SMALL_TILE = Tile(64, 64, 4, 2)  # both, on GPUs with less shared memory per block (sm_86 / sm_89: ~100 KB)
LARGE_SHARED_MEMORY = 160 * 1024


@functools.cache
def _large_shared_memory(device_index: int) -> bool:
    props = torch.cuda.get_device_properties(device_index)
    optin = getattr(props, "shared_memory_per_block_optin", None)
    if optin is None:  # older torch: A100 (8.0) and Hopper have it, the 8.6 / 8.9 parts do not
        return (props.major, props.minor) == (8, 0) or props.major >= 9
    return int(optin) >= LARGE_SHARED_MEMORY


def _queries_per_tile(rows: int, group_pad: int) -> int:
    return max(1, rows // group_pad)


def extend(
    q: torch.Tensor,  # [T, H, D]
    kv_cache: torch.Tensor,  # [S, 2, Hkv, D]
    block_tables: torch.Tensor,  # [B, W]
    query_start: torch.Tensor,  # [B + 1]
    context_lens: torch.Tensor,  # [B]
    max_query_len: int,
    page_size: int,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Tiles of 64 rows (queries x the heads of a GQA group) for long query runs; a batch that also
    holds short ones (decodes and drafts beside a prefill) gets a second launch with 16-row tiles
    for those, so a decode's K/V is read once per group and its tile is not mostly padding."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = context_lens.shape[0]
    kv, kvs, fp8 = kv_format.kernel_views(kv_cache, head_dim)
    num_kv_heads = kv.shape[2]
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    out = torch.empty_like(q)
    block_d = triton.next_power_of_2(head_dim)
    short_q = _queries_per_tile(SHORT_TILE.rows, group_pad)
    if max_query_len <= short_q:
        launches = [(0, short_q, SHORT_TILE)]
    else:
        long_tile = LONG_TILE_FP8 if fp8 else LONG_TILE
        if q.is_cuda and not _large_shared_memory(q.device.index if q.device.index is not None else 0):
            long_tile = SMALL_TILE
        if block_d > 128:  # the accumulator of a 128-row tile would not fit in registers
            long_tile = Tile(min(long_tile.rows, 64), long_tile.block_n, long_tile.warps, long_tile.stages)
        launches = [(1, short_q, SHORT_TILE), (2, _queries_per_tile(long_tile.rows, group_pad), long_tile)]
    for select, block_q, tile in launches:
        tiles = 1 if select == 1 else triton.cdiv(max_query_len, block_q)  # a short run fits one tile
        block_n = tile.block_n if block_d <= 128 else tile.block_n // 2
        _extend_kernel[(tiles, num_seqs, num_kv_heads)](
            q, kv, kvs, block_tables, query_start, context_lens, out, scale,
            q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), kv.stride(2), kvs.stride(0), kvs.stride(1),
            block_tables.stride(0), out.stride(0), out.stride(1),
            GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, BLOCK_D=block_d, PAGE=page_size,
            BLOCK_Q=block_q, BLOCK_N=block_n, WINDOW=sliding_window or 0, SELECT=select, SHORT=short_q,
            FP8=fp8, WIDEN=fp8_widening(fp8, q.dtype), IEEE=q.dtype == torch.float32,
            num_warps=tile.warps, num_stages=tile.stages,
        )  # fmt: skip
    return out
