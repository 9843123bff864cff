"""The decoder's elementwise steps, each with a torch form and, on CUDA, a fused Triton form.

The torch forms are the reference (and the CPU path); `use_fused(x)` picks the Triton forms for
CUDA tensors when Triton is importable and fusion has not been switched off.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from cbd.model import kv_format

_fused_enabled = True
_triton_available = importlib.util.find_spec("triton") is not None


def set_fused(enabled: bool) -> None:
    """Switch the Triton forms on or off process-wide (tests compare both)."""
    global _fused_enabled
    _fused_enabled = enabled


def use_fused(x: torch.Tensor) -> bool:
    return _fused_enabled and _triton_available and x.is_cuda


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """s = x + residual (or x); returns (rms_norm(s) * weight, s)."""
    if use_fused(x):
        from cbd.model import triton_ops

        return triton_ops.rms_norm(x, weight, eps, residual)
    s = x if residual is None else x + residual
    if s.dtype == torch.float32:  # one fused kernel; bit-identical to the unfused form in fp32
        return F.rms_norm(s, weight.shape, weight, eps), s
    # Normalise in fp32 and cast back before the weight, as transformers does.
    h = s.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(s.dtype), s


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos, sin: [T, 1, D] (the half-split layout of HF checkpoints)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope_and_write_kv(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T]
    cos_table: torch.Tensor,  # [P, D] fp32
    sin_table: torch.Tensor,
    kv_cache: torch.Tensor,  # one layer's pool, either format of kv_format.py
    slot_mapping: torch.Tensor,  # [T]
) -> torch.Tensor:
    """Rotate q and k by their positions, store k and v in their KV slots (quantized in an FP8 pool);
    returns the rotated q."""
    if use_fused(q):
        from cbd.model import triton_ops

        return triton_ops.rope_and_write_kv(q, k, v, positions, cos_table, sin_table, kv_cache, slot_mapping)
    cos = cos_table[positions].to(q.dtype)[:, None, :]
    sin = sin_table[positions].to(q.dtype)[:, None, :]
    num_heads = q.shape[1]
    adjacent = (
        q.stride() == k.stride()
        and q.stride(1) == q.shape[2]
        and k.data_ptr() == q.data_ptr() + q.shape[1] * q.shape[2] * q.element_size()
    )
    if adjacent:  # q | k side by side in the fused projection's output: one view, no copy
        qk = q.as_strided((q.shape[0], num_heads + k.shape[1], q.shape[2]), q.stride())
    else:
        qk = torch.cat((q, k), dim=1)
    qk = apply_rope(qk, cos, sin)  # q and k rotated together: half the launches
    kv_format.store(kv_cache, slot_mapping, torch.stack((qk[:, num_heads:], v), dim=1))
    return qk[:, :num_heads]


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] holding gate | up -> silu(gate) * up."""
    if use_fused(x):
        from cbd.model import triton_ops

        return triton_ops.silu_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
