"""Fused elementwise kernels for CUDA (Triton): one launch where the torch form needs several.

Each kernel rounds intermediates to the activation dtype where the unfused bf16/fp16 torch form
that transformers runs rounds them, so fused and unfused agree to within one unit in the last
place; `ops.py` falls back to torch where Triton is absent.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
def _rope_kv_kernel(
    Q, K, V, Q_OUT, KV, POS, SLOT, COS, SIN,
    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sqo_t, sqo_h, skv_s, skv_kv, skv_h, s_cos,
    NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, ROUND: tl.constexpr,
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
        dst = KV + slot * skv_s + kv_head * skv_h
        tl.store(dst + offs, o1.to(dtype), mask=mask)
        tl.store(dst + HALF + offs, o2.to(dtype), mask=mask)
        vsrc = V + t * sv_t + kv_head * sv_h
        v1 = tl.load(vsrc + offs, mask=mask, other=0.0)
        v2 = tl.load(vsrc + HALF + offs, mask=mask, other=0.0)
        tl.store(dst + skv_kv + offs, v1, mask=mask)
        tl.store(dst + skv_kv + HALF + offs, v2, mask=mask)


def rope_and_write_kv(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T]
    cos_table: torch.Tensor,  # [P, D] fp32
    sin_table: torch.Tensor,
    kv_cache: torch.Tensor,  # [S, 2, Hkv, D]
    slot_mapping: torch.Tensor,  # [T]
) -> torch.Tensor:
    """Rotate q and k, write k and v into their KV slots; returns the rotated q (new tensor)."""
    num_tokens, num_heads, head_dim = q.shape
    q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return q_out
    half = head_dim // 2
    _rope_kv_kernel[(num_tokens, num_heads + k.shape[1])](
        q, k, v, q_out, kv_cache, positions, slot_mapping, cos_table, sin_table,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        cos_table.stride(0),
        NUM_HEADS=num_heads, HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
        ROUND=q.dtype != torch.float32, num_warps=1,
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
