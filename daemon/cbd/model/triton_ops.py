"""Fused elementwise kernels for CUDA (Triton): one launch where the torch form needs several.

Each kernel rounds intermediates to the activation dtype where the unfused bf16/fp16 torch form
that transformers runs rounds them, so fused and unfused agree to within one unit in the last
place; `ops.py` falls back to torch where Triton is absent.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cbd.model import kv_format


@triton.jit
def _rms_norm_kernel(
    X, R, W, OUT, RES_OUT,
    stride_x, stride_r, stride_o, stride_ro,
    N, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the residual add rounds, as in torch
        tl.store(RES_OUT + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    h = (xf * inv).to(x.dtype).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + row * stride_o + cols, (w * h).to(OUT.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """x (+ residual) -> (norm(s) * weight, s); with no residual the second value is x itself."""
    rows, n = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    if rows == 0:
        return out, res_out
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out, res_out,
        x.stride(0), (residual if residual is not None else x).stride(0), out.stride(0), res_out.stride(0),
        n, eps, HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
    )  # fmt: skip
    return out, res_out


@triton.jit
def _round(x, DTYPE: tl.constexpr, ROUND: tl.constexpr):
    if ROUND:
        return x.to(DTYPE).to(tl.float32)
    return x


@triton.jit
def _store_kv_row(dst, scale_ptr, x1, x2, offs, mask, HALF: tl.constexpr, FP8: tl.constexpr):
    """One head's row of K or V (two halves, fp32) into its slot: as is, or FP8 with its scale."""
    if FP8:
        amax = tl.maximum(tl.max(tl.where(mask, tl.abs(x1), 0.0), 0), tl.max(tl.where(mask, tl.abs(x2), 0.0), 0))
        row_scale = amax / 448.0
        inv = tl.where(row_scale > 0.0, 1.0 / tl.where(row_scale > 0.0, row_scale, 1.0), 1.0)
        tl.store(dst + offs, tl.clamp(x1 * inv, -448.0, 448.0).to(dst.dtype.element_ty), mask=mask)
        tl.store(dst + HALF + offs, tl.clamp(x2 * inv, -448.0, 448.0).to(dst.dtype.element_ty), mask=mask)
        tl.store(scale_ptr, row_scale)
    else:
        tl.store(dst + offs, x1.to(dst.dtype.element_ty), mask=mask)
        tl.store(dst + HALF + offs, x2.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kv_kernel(
    Q, K, V, Q_OUT, KV, KVS, POS, SLOT, COS, SIN,
    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sqo_t, sqo_h, skv_s, skv_kv, skv_h, ss_s, ss_kv, s_cos,
    NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, ROUND: tl.constexpr,
    FP8: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK_HALF)
    mask = offs < HALF
    pos = tl.load(POS + t)
    dtype = Q_OUT.dtype.element_ty
    # The tables hold [f, f] halves; transformers casts them to the activation dtype first.
    c = _round(tl.load(COS + pos * s_cos + offs, mask=mask, other=0.0), dtype, ROUND)
    s = _round(tl.load(SIN + pos * s_cos + offs, mask=mask, other=0.0), dtype, ROUND)
    if head < NUM_HEADS:
        src = Q + t * sq_t + head * sq_h
    else:
        src = K + t * sk_t + (head - NUM_HEADS) * sk_h
    x1 = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, each product and the sum rounded like the unfused form.
    o1 = _round(_round(x1 * c, dtype, ROUND) + _round(-x2 * s, dtype, ROUND), dtype, ROUND)
    o2 = _round(_round(x2 * c, dtype, ROUND) + _round(x1 * s, dtype, ROUND), dtype, ROUND)
    if head < NUM_HEADS:
        dst = Q_OUT + t * sqo_t + head * sqo_h
        tl.store(dst + offs, o1.to(dtype), mask=mask)
        tl.store(dst + HALF + offs, o2.to(dtype), mask=mask)
    else:
        kv_head = head - NUM_HEADS
        slot = tl.load(SLOT + t).to(tl.int64)
        kv_dst = KV + slot * skv_s + kv_head * skv_h
        scale_ptr = KVS + slot * ss_s + kv_head
        _store_kv_row(kv_dst, scale_ptr, o1, o2, offs, mask, HALF, FP8)
        vsrc = V + t * sv_t + kv_head * sv_h
        v1 = tl.load(vsrc + offs, mask=mask, other=0.0).to(tl.float32)
        v2 = tl.load(vsrc + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        _store_kv_row(kv_dst + skv_kv, scale_ptr + ss_kv, v1, v2, offs, mask, HALF, FP8)


def rope_and_write_kv(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T]
    cos_table: torch.Tensor,  # [P, D] fp32
    sin_table: torch.Tensor,
    kv_cache: torch.Tensor,  # one layer's pool (kv_format.py)
    slot_mapping: torch.Tensor,  # [T]
) -> torch.Tensor:
    """Rotate q and k, write k and v into their KV slots (quantized, with their scales, in an FP8
    pool); returns the rotated q (new tensor)."""
    num_tokens, num_heads, head_dim = q.shape
    q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return q_out
    half = head_dim // 2
    kv, kvs, fp8 = kv_format.kernel_views(kv_cache, head_dim)
    _rope_kv_kernel[(num_tokens, num_heads + k.shape[1])](
        q, k, v, q_out, kv, kvs, positions, slot_mapping, cos_table, sin_table,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1), kv.stride(0), kv.stride(1), kv.stride(2), kvs.stride(0), kvs.stride(1),
        cos_table.stride(0),
        NUM_HEADS=num_heads, HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
        ROUND=q.dtype != torch.float32, FP8=fp8, num_warps=1,
    )  # fmt: skip
    return q_out


@triton.jit
def _silu_mul_kernel(X, OUT, stride_x, stride_o, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(X + row * stride_x + N + cols, mask=mask, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(OUT + row * stride_o + cols, (act * up).to(gate.dtype), mask=mask)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] holding gate | up -> silu(gate) * up, [T, I]."""
    rows, width = x.shape
    n = width // 2
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(n, block))](x, out, x.stride(0), out.stride(0), n, BLOCK=block, num_warps=4)
    return out
