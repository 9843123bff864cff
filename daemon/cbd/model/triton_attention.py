"""Paged attention kernels for CUDA in Triton.

KV layout is the engine's: per layer a slot pool `[S, 2, Hkv, D]`; key position p of sequence b
lives in slot `block_tables[b, p // PAGE] * PAGE + p % PAGE`. Queries are packed rows `[T, H, D]`.

- `decode`: one query per sequence. Split-KV (flash-decoding): the context is cut into SPLITS
  ranges, one program per (sequence, KV head, range) handles all query heads of its GQA group
  (so K/V are read once per group); a second kernel merges the ranges by log-sum-exp. The grid
  depends only on the batch size, so it can be captured in a CUDA graph.
- `extend`: several queries per sequence at the end of its context (prefill, a prefill chunk over
  a cached prefix, mixed with decodes): flash-attention style tiles with the causal mask; a tile
  packs queries x the query heads of one GQA group, so K/V are read once per group here too.
Both honour a sliding window. The plain-torch `attention.paged_attention` is the oracle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _online_softmax_block(q, ptr, kv_mask, allowed, skv_kv, qk_scale, m_i, l_i, acc, IEEE: tl.constexpr):
    """One tile of keys for flash attention: scores, running max / sum, and the weighted values."""
    k = tl.load(ptr, mask=kv_mask, other=0.0)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(allowed, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(ptr + skv_kv, mask=kv_mask, other=0.0)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["sbt_b"])  # the table width changes from step to step
def _decode_kernel(
    Q, KV, BT, CTX, O_PART, LSE_PART, OUT, scale,
    sq_t, sq_h, skv_s, skv_kv, skv_h, sbt_b, sop_b, sop_h, sop_s, sl_b, sl_h, so_t, so_h,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, WINDOW: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(CTX + b).to(tl.int32)
    lo = 0
    if WINDOW > 0:
        lo = tl.maximum(ctx - WINDOW, 0)
    per_split = tl.cdiv(tl.cdiv(ctx - lo, SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, ctx)

    g = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(Q + b * sq_t + heads[:, None] * sq_h + d[None, :], mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    qk_scale = scale * 1.4426950408889634  # exp2 domain
    m_i = tl.full([GROUP_PAD], -1.0e30, tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    kv_base = KV + kv_head * skv_h
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        page = tl.load(BT + b * sbt_b + n // PAGE, mask=n_mask, other=0)
        slot = page.to(tl.int64) * PAGE + n % PAGE
        ptr = kv_base + slot[:, None] * skv_s + d[None, :]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        m_i, l_i, acc = _online_softmax_block(q, ptr, kv_mask, n_mask[None, :], skv_kv, qk_scale, m_i, l_i, acc, IEEE)
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    mask = g_mask[:, None] & d_mask[None, :]
    if SPLITS == 1:
        tl.store(OUT + b * so_t + heads[:, None] * so_h + d[None, :], out.to(OUT.dtype.element_ty), mask=mask)
    else:
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))  # log2 domain
        tl.store(O_PART + b * sop_b + heads[:, None] * sop_h + split * sop_s + d[None, :], out, mask=mask)
        tl.store(LSE_PART + b * sl_b + heads * sl_h + split, lse, mask=g_mask)


@triton.jit
def _merge_kernel(
    O_PART, LSE_PART, OUT, sop_b, sop_h, sop_s, sl_b, sl_h, so_t, so_h,
    SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < SPLITS
    d_mask = d < HEAD_DIM
    lse = tl.load(LSE_PART + b * sl_b + head * sl_h + s, mask=s_mask, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    w = tl.where(s_mask, w, 0.0)
    part = tl.load(
        O_PART + b * sop_b + head * sop_h + s[:, None] * sop_s + d[None, :],
        mask=s_mask[:, None] & d_mask[None, :], other=0.0,
    )  # fmt: skip
    out = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    tl.store(OUT + b * so_t + head * so_h + d, out.to(OUT.dtype.element_ty), mask=d_mask)


def decode_splits(num_seqs: int, num_kv_heads: int, max_context: int | None = None) -> int:
    """How many KV ranges per (sequence, KV head): enough programs to fill the GPU a few times over."""
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    splits = triton.cdiv(3 * sms, max(1, num_seqs * num_kv_heads))
    if max_context is not None:
        splits = min(splits, triton.cdiv(max_context, 128))
    return max(1, min(16, splits))


def decode(
    q: torch.Tensor,  # [B, H, D]
    kv_cache: torch.Tensor,  # [S, 2, Hkv, D]
    block_tables: torch.Tensor,  # [B, W]
    context_lens: torch.Tensor,  # [B]
    page_size: int,
    scale: float,
    splits: int,
    sliding_window: int | None = None,
) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    if splits > 1:
        o_part = torch.empty(num_seqs, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=q.device)
    else:
        o_part = lse = out  # unused
    block_d = triton.next_power_of_2(head_dim)
    _decode_kernel[(num_seqs, num_kv_heads, splits)](
        q, kv_cache, block_tables, context_lens, o_part, lse, out, scale,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        block_tables.stride(0), o_part.stride(0), o_part.stride(1), o_part.stride(2) if splits > 1 else 0,
        lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        PAGE=page_size, BLOCK_N=64 if block_d <= 128 else 32, SPLITS=splits, WINDOW=sliding_window or 0,
        IEEE=q.dtype == torch.float32, num_warps=4, num_stages=2,
    )  # fmt: skip
    if splits > 1:
        _merge_kernel[(num_seqs, num_heads)](
            o_part, lse, out, o_part.stride(0), o_part.stride(1), o_part.stride(2),
            lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
            SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits), HEAD_DIM=head_dim, BLOCK_D=block_d,
            num_warps=2,
        )  # fmt: skip
    return out


@triton.jit(do_not_specialize=["sbt_b"])
def _extend_kernel(
    Q, KV, BT, QSTART, CTX, OUT, scale,
    sq_t, sq_h, skv_s, skv_kv, skv_h, sbt_b, so_t, so_h,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr,
    SELECT: tl.constexpr, SHORT: tl.constexpr, IEEE: tl.constexpr,
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
        m_i, l_i, acc = _online_softmax_block(q, ptr, kv_mask, allowed, skv_kv, qk_scale, m_i, l_i, acc, IEEE)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(OUT + rows[:, None] * so_t + heads[:, None] * so_h + d[None, :], out.to(OUT.dtype.element_ty),
             mask=io_mask)  # fmt: skip


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
    num_kv_heads = kv_cache.shape[2]
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    out = torch.empty_like(q)
    block_d = triton.next_power_of_2(head_dim)
    block_n = 64 if block_d <= 128 else 32
    short_q = _queries_per_tile(16, group_pad)
    long_q = _queries_per_tile(64, group_pad)
    if max_query_len <= short_q:
        launches = [(0, short_q)]
    else:
        launches = [(1, short_q), (2, long_q)]
    for select, block_q in launches:
        tiles = 1 if select == 1 else triton.cdiv(max_query_len, block_q)  # a short run fits one tile
        _extend_kernel[(tiles, num_seqs, num_kv_heads)](
            q, kv_cache, block_tables, query_start, context_lens, out, scale,
            q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
            block_tables.stride(0), out.stride(0), out.stride(1),
            GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, BLOCK_D=block_d, PAGE=page_size,
            BLOCK_Q=block_q, BLOCK_N=block_n, WINDOW=sliding_window or 0, SELECT=select, SHORT=short_q,
            IEEE=q.dtype == torch.float32, num_warps=4, num_stages=2,
        )  # fmt: skip
    return out
