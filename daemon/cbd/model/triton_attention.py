"""Paged attention kernels for CUDA in Triton.

KV layout is the engine's: per layer a slot pool `[S, 2, Hkv, D]`, or FP8 values with a scale per
(slot, K/V, head) (kv_format.py: the kernels dequantize per key tile, scales applied to scores and
probabilities); key position p of sequence b lives in slot `block_tables[b, p // PAGE] * PAGE + p % PAGE`.
Queries are packed rows `[T, H, D]`.

- `decode`: one query per sequence (a decode step, row b is sequence b's), or a few each (a step
  verifying drafts: sequence b's 1 + k_b rows `query_start[b]:query_start[b + 1]`, k_b its own, at most
  `queries` - 1; causal among them, all read each K/V tile once; rows past the last sequence's are
  padding, left untouched). Split-KV (flash-decoding): each sequence's context is cut into
  up to SPLITS ranges, one per MIN_SPLIT keys (the count follows its length, on the device), one
  program per (sequence, KV head, range) handles all its queries x the query heads of its GQA group
  (so K/V are read once per group); a second kernel merges the ranges by log-sum-exp. SPLITS comes from the batch
  size (fill the GPU whatever the batch: a single 32K context gets 64 ranges), so the grid depends
  only on the batch size and a CUDA graph captures it.
- `triton_extend.extend` (its own file): several queries per sequence at the end of its context, with
  the online-softmax step and FP8 widening shared from here.
Both honour a sliding window. The plain-torch `attention.paged_attention` is the oracle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cbd.model import kv_format


@triton.jit
def online_softmax_block(
    q, ptr, kv_mask, allowed, skv_kv, qk_scale, m_i, l_i, acc, sptr, s_mask, ss_kv,
    FP8: tl.constexpr, WIDEN: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """One tile of keys for flash attention: scores, running max / sum, and the weighted values.
    FP8: K/V are float8 with a scale per key (at sptr, V's at sptr + ss_kv); the K scale multiplies
    the scores. WIDEN (FP8 only) says how the e4m3 tiles reach the tensor cores:
    0: both to q's dtype, the V scale multiplying the probabilities;
    1 / 2: K and V to fp16 (one conversion instruction per pair, where bf16 takes several; q arrives in
    fp16 with the softmax scale folded in). fp16 cannot hold every V scale (amax / 448 of a small V row
    is subnormal or 0 there), so scales are taken relative to the tile's largest, which multiplies the
    tile's product in fp32; 1 multiplies V by them, 2 the probabilities (BLOCK_N products per row
    instead of HEAD_DIM x BLOCK_N);
    3: K to fp16; V to bf16 by moving its bits (e4m3's exponent and mantissa into bf16's fields: the
    value x 2^-120, two integer operations, no reduction), the V scale x 2^120 on the probabilities
    (bf16 has fp32's range).
    The scales are per key, so every mode is the reference's math up to rounding."""
    k = tl.load(ptr, mask=kv_mask, other=0.0)
    if FP8:
        if WIDEN > 0:
            k = k.to(tl.float16)
        else:
            k = k.to(q.dtype)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if FP8:
        s = s * tl.load(sptr, mask=s_mask, other=0.0)[None, :]
    s = tl.where(allowed, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(ptr + skv_kv, mask=kv_mask, other=0.0)
    if FP8:
        v_scale = tl.load(sptr + ss_kv, mask=s_mask, other=0.0)
        if WIDEN == 1 or WIDEN == 2:
            tile_scale = tl.max(v_scale, 0)
            tile_scale = tl.where(tile_scale > 0.0, tile_scale, 1.0)
            if WIDEN == 1:
                v = v.to(tl.float16) * (v_scale / tile_scale).to(tl.float16)[:, None]
                acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v) * tile_scale
            else:
                pv = (p * (v_scale / tile_scale)[None, :]).to(tl.float16)
                acc = acc * alpha[:, None] + tl.dot(pv, v.to(tl.float16)) * tile_scale
        elif WIDEN == 3:
            bits = v.to(tl.uint8, bitcast=True).to(tl.uint16)
            v = (((bits & 0x80) << 8) | ((bits & 0x7F) << 4)).to(tl.bfloat16, bitcast=True)
            pv = (p * (v_scale * 1.329227995784916e36)[None, :]).to(tl.bfloat16)  # 2^120
            acc = acc * alpha[:, None] + tl.dot(pv, v)
        else:
            v = v.to(q.dtype)
            p = p * v_scale[None, :]
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    elif IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["sbt_b"])  # the table width changes from step to step
def _decode_kernel(
    Q, KV, KVS, BT, CTX, QSTART, O_PART, LSE_PART, OUT, scale,
    sq_t, sq_h, skv_s, skv_kv, skv_h, ss_s, ss_kv, sbt_b, sop_t, sop_h, sop_s, sl_t, sl_h, so_t, so_h,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, ROWS: tl.constexpr, QUERIES: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr, MIN_SPLIT: tl.constexpr, WINDOW: tl.constexpr, FP8: tl.constexpr, WIDEN: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    # One program: the last positions of sequence b (its one query, or its 1 + k rows of QSTART when QUERIES > 1,
    # at most QUERIES) x the GROUP query heads of one KV head, packed as ROWS rows (row r: query r // GROUP_PAD,
    # head r % GROUP_PAD), over one range of its keys.
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(CTX + b).to(tl.int32)
    first = b
    num_q = 1
    if QUERIES > 1:
        first = tl.load(QSTART + b)
        num_q = (tl.load(QSTART + b + 1) - first).to(tl.int32)
        if num_q == 0:  # a padding sequence
            return
    lo = 0
    if WINDOW > 0:
        lo = tl.maximum(ctx - num_q + 1 - WINDOW, 0)
    active = _active_splits(ctx - lo, SPLITS, MIN_SPLIT)
    if split >= active:  # this sequence's context needs fewer ranges; the merge skips this one
        return
    per_split = tl.cdiv(tl.cdiv(ctx - lo, active), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, ctx)

    r = tl.arange(0, ROWS)
    m = r // GROUP_PAD
    g = r % GROUP_PAD
    heads = kv_head * GROUP + g
    row_mask = (g < GROUP) & (m < num_q)
    tokens = first + m
    q_pos = ctx - num_q + m
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    mask = row_mask[:, None] & d_mask[None, :]
    q = tl.load(Q + tokens[:, None] * sq_t + heads[:, None] * sq_h + d[None, :], mask=mask, other=0.0)
    qk_scale = scale * 1.4426950408889634  # exp2 domain
    if FP8 and WIDEN > 0:  # the softmax scale folded into q before the fp16 cast (well inside fp16's range)
        q = (q.to(tl.float32) * qk_scale).to(tl.float16)
        qk_scale = 1.0
    m_i = tl.full([ROWS], -1.0e30, tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    kv_base = KV + kv_head * skv_h
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        page = tl.load(BT + b * sbt_b + n // PAGE, mask=n_mask, other=0)
        slot = page.to(tl.int64) * PAGE + n % PAGE
        ptr = kv_base + slot[:, None] * skv_s + d[None, :]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        allowed = n_mask[None, :]
        if QUERIES > 1:  # the causal mask among the sequence's own new tokens (its drafts)
            allowed = allowed & (n[None, :] <= q_pos[:, None])
            if WINDOW > 0:
                allowed = allowed & (n[None, :] > q_pos[:, None] - WINDOW)
        m_i, l_i, acc = online_softmax_block(
            q, ptr, kv_mask, allowed, skv_kv, qk_scale, m_i, l_i, acc, KVS + slot * ss_s + kv_head, n_mask,
            ss_kv, FP8, WIDEN, IEEE,
        )  # fmt: skip
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    if SPLITS == 1:
        tl.store(OUT + tokens[:, None] * so_t + heads[:, None] * so_h + d[None, :], out.to(OUT.dtype.element_ty),
                 mask=mask)  # fmt: skip
    else:
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))  # log2 domain
        tl.store(O_PART + tokens[:, None] * sop_t + heads[:, None] * sop_h + split * sop_s + d[None, :], out,
                 mask=mask)  # fmt: skip
        tl.store(LSE_PART + tokens * sl_t + heads * sl_h + split, lse, mask=row_mask)


@triton.jit
def _active_splits(length, SPLITS: tl.constexpr, MIN_SPLIT: tl.constexpr):
    """How many ranges a context of `length` keys is cut into: one per MIN_SPLIT keys, 1 to SPLITS. (Each
    range is then rounded up to whole key steps, so the last ones can be short or empty.)"""
    return tl.maximum(tl.minimum(SPLITS, tl.cdiv(length, MIN_SPLIT)), 1)


@triton.jit
def _merge_kernel(
    O_PART, LSE_PART, OUT, CTX, QSTART, SEQ, sop_t, sop_h, sop_s, sl_t, sl_h, so_t, so_h,
    SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, MIN_SPLIT: tl.constexpr, WINDOW: tl.constexpr,
    QUERIES: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)  # a query row: sequence t's (QUERIES 1), else sequence SEQ[t]'s
    head = tl.program_id(1)
    seq = t
    num_q = 1
    if QUERIES > 1:
        seq = tl.load(SEQ + t)
        if seq < 0:  # a padding row
            return
        num_q = (tl.load(QSTART + seq + 1) - tl.load(QSTART + seq)).to(tl.int32)
    ctx = tl.load(CTX + seq).to(tl.int32)
    length = ctx
    if WINDOW > 0:
        length = ctx - tl.maximum(ctx - num_q + 1 - WINDOW, 0)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < _active_splits(length, SPLITS, MIN_SPLIT)
    d_mask = d < HEAD_DIM
    lse = tl.load(LSE_PART + t * sl_t + head * sl_h + s, mask=s_mask, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))  # a query's range past its own position is empty: -inf, weight 0
    w = tl.where(s_mask, w, 0.0)
    part = tl.load(
        O_PART + t * sop_t + head * sop_h + s[:, None] * sop_s + d[None, :],
        mask=s_mask[:, None] & d_mask[None, :], other=0.0,
    )  # fmt: skip
    out = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    tl.store(OUT + t * so_t + head * so_h + d, out.to(OUT.dtype.element_ty), mask=d_mask)


# Keys per decode range when the batch leaves room for more ranges (shorter ones: the merge costs more than they gain).
MIN_SPLIT = 128
MAX_SPLITS = 64
PROGRAMS_PER_SM = 3
DECODE_FP8_KEYS_FACTOR = 2
DECODE_FP8_WARPS, DECODE_FP8_STAGES = 4, 2
FP8_WIDEN = 2  # how FP8 tiles reach the tensor cores (see online_softmax_block)


def fp8_widening(fp8: bool, dtype: torch.dtype) -> int:
    return FP8_WIDEN if fp8 and dtype != torch.float32 else 0


def decode_splits(num_seqs: int, num_kv_heads: int, max_context: int | None = None) -> int:
    """The most KV ranges per (sequence, KV head): enough programs to fill the GPU a few times over.
    The kernel cuts each sequence's context into at most this many ranges, one per MIN_SPLIT keys,
    on the device, so one count serves every context (a CUDA graph captures it once per batch size)."""
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    splits = triton.cdiv(PROGRAMS_PER_SM * sms, max(1, num_seqs * num_kv_heads))
    if max_context is not None:
        splits = min(splits, triton.cdiv(max_context, MIN_SPLIT))
    return max(1, min(MAX_SPLITS, splits))


def _decode_block_n(block_d: int, fp8: bool) -> int:
    """Keys per loop step: FP8 rows are half the bytes, so twice the keys move as much per step."""
    block_n = 64 if block_d <= 128 else 32
    return block_n * DECODE_FP8_KEYS_FACTOR if fp8 else block_n


def decode(
    q: torch.Tensor,  # [T, H, D]
    kv_cache: torch.Tensor,  # one layer's pool (kv_format.py)
    block_tables: torch.Tensor,  # [B, W]
    context_lens: torch.Tensor,  # [B]
    page_size: int,
    scale: float,
    splits: int,
    sliding_window: int | None = None,
    queries: int = 1,
    query_start: torch.Tensor | None = None,  # [B + 1] with queries > 1
    seq_of_row: torch.Tensor | None = None,  # [T] with queries > 1 and splits > 1: each row's sequence, -1: padding
) -> torch.Tensor:
    """Attention of the last positions of each sequence: one per sequence for a decode step (row b,
    T = B); with queries > 1, sequence b's rows query_start[b]:query_start[b + 1] (1 + k_b for a step
    verifying k_b drafts, causal among them, at most `queries`), rows past query_start[B] padding
    (their output undefined). `attention.row_sequences` gives seq_of_row."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = context_lens.shape[0]
    if queries == 1:
        assert num_tokens == num_seqs, (num_tokens, num_seqs)
        query_start = seq_of_row = context_lens  # unused
    else:
        assert query_start is not None and (splits == 1 or seq_of_row is not None)
        if seq_of_row is None:
            seq_of_row = context_lens  # unused
    kv, kvs, fp8 = kv_format.kernel_views(kv_cache, head_dim)
    num_kv_heads = kv.shape[2]
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    out = torch.empty_like(q)
    if splits > 1:
        o_part = torch.empty(num_tokens, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(num_tokens, num_heads, splits, dtype=torch.float32, device=q.device)
    else:
        o_part = lse = out  # unused
    block_d = triton.next_power_of_2(head_dim)
    window = sliding_window or 0
    rows = max(16, triton.next_power_of_2(queries * group_pad))
    warps = 8 if rows >= 128 else DECODE_FP8_WARPS if fp8 else 4  # 128 rows: spread the accumulator
    _decode_kernel[(num_seqs, num_kv_heads, splits)](
        q, kv, kvs, block_tables, context_lens, query_start, o_part, lse, out, scale,
        q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), kv.stride(2), kvs.stride(0), kvs.stride(1),
        block_tables.stride(0), o_part.stride(0), o_part.stride(1), o_part.stride(2) if splits > 1 else 0,
        lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=group_pad, ROWS=rows,
        QUERIES=queries, HEAD_DIM=head_dim, BLOCK_D=block_d, PAGE=page_size, BLOCK_N=_decode_block_n(block_d, fp8),
        SPLITS=splits, MIN_SPLIT=MIN_SPLIT, WINDOW=window, FP8=fp8, WIDEN=fp8_widening(fp8, q.dtype),
        IEEE=q.dtype == torch.float32, num_warps=warps, num_stages=DECODE_FP8_STAGES if fp8 else 2,
    )  # fmt: skip
    if splits > 1:
        _merge_kernel[(num_tokens, num_heads)](
            o_part, lse, out, context_lens, query_start, seq_of_row, o_part.stride(0), o_part.stride(1), o_part.stride(2),
            lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
            SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits), MIN_SPLIT=MIN_SPLIT, WINDOW=window,
            QUERIES=queries, HEAD_DIM=head_dim, BLOCK_D=block_d, num_warps=2,
        )  # fmt: skip
    return out
