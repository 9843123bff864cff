"""How the KV pool stores keys and values: the model's dtype, or FP8 with per-token scales.

A layer's pool holds one *slot* per token position (see attention.py for slots and block tables).

- "auto": the model's dtype; a layer's pool is `[S, 2, Hkv, D]` (K and V side by side).
- "fp8": a layer's pool is bytes `[S, Hkv * (2 * D + 8)]`. A slot is `[2, Hkv, D]` float8 e4m3
  values followed by `[2, Hkv]` fp32 scales: each (K or V, KV head) row of D values has its own
  scale, `amax(|row|) / 448` (448 is e4m3's largest finite value), chosen when the token is written
  (dynamic, per token: no calibration, no outlier from another token can crush a row's precision).
  Value = fp8 * scale. The scale rides in the slot, so a block is one run of bytes: prefix-cache
  copies, forks and the host tier move it exactly as they move a bf16 block. 2 * D + 8 bytes per
  head and token against 4 * D in bf16: 1.94x the tokens in the same memory at D = 128.

Kernels read the two parts through `kernel_views` (values as float8, scales as fp32); the torch
forms here (`store`, `gather`) are the reference and the CPU path.
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "fp8")
FP8_MAX = 448.0  # largest finite float8 e4m3fn value
FP8_DTYPE = torch.float8_e4m3fn


def is_fp8(kv_cache: torch.Tensor) -> bool:
    """A layer's pool (or the whole pool) in the FP8 format."""
    return kv_cache.dtype == torch.uint8


def fp8_slot_bytes(num_kv_heads: int, head_dim: int) -> int:
    return num_kv_heads * (2 * head_dim + 8)


def pool_shape(num_slots: int, num_kv_heads: int, head_dim: int, fp8: bool) -> tuple[int, ...]:
    """One layer's pool shape (prepend the layer count for the whole pool)."""
    if fp8:
        return (num_slots, fp8_slot_bytes(num_kv_heads, head_dim))
    return (num_slots, 2, num_kv_heads, head_dim)


def bytes_per_token(num_kv_heads: int, head_dim: int, itemsize: int, fp8: bool) -> int:
    """One layer's KV bytes for one token."""
    return fp8_slot_bytes(num_kv_heads, head_dim) if fp8 else 2 * num_kv_heads * head_dim * itemsize


def fp8_views(kv_cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's FP8 pool [S, B] -> (values [S, 2, Hkv, D] float8, scales [S, 2, Hkv] fp32), both views."""
    num_slots, slot_bytes = kv_cache.shape
    num_kv_heads = slot_bytes // (2 * head_dim + 8)
    value_bytes = 2 * num_kv_heads * head_dim
    values = kv_cache[:, :value_bytes].view(FP8_DTYPE).view(num_slots, 2, num_kv_heads, head_dim)
    scales = kv_cache.view(torch.float32)[:, value_bytes // 4 :].view(num_slots, 2, num_kv_heads)
    return values, scales


def kernel_views(kv_cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """What a kernel takes of a layer's pool, either format: (values [S, 2, Hkv, D], scales [S, 2, Hkv]
    or the pool again as a stand-in the kernel does not read, fp8)."""
    if is_fp8(kv_cache):
        values, scales = fp8_views(kv_cache, head_dim)
        return values, scales, True
    return kv_cache, kv_cache, False


def quantize(kv: torch.Tensor) -> torch.Tensor:
    """[T, 2, Hkv, D] float -> the FP8 slots' bytes [T, Hkv * (2 * D + 8)]."""
    num_tokens = kv.shape[0]
    x = kv.float()
    scale = x.abs().amax(dim=-1) / FP8_MAX  # [T, 2, Hkv]
    q = (x / torch.where(scale > 0, scale, 1.0)[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return torch.cat((q.view(torch.uint8).reshape(num_tokens, -1), scale.reshape(num_tokens, -1).view(torch.uint8)), 1)


def dequantize(slots: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """FP8 slots' bytes [N, B] -> [N, 2, Hkv, D] in dtype (the values the kernels compute with)."""
    values, scales = fp8_views(slots, head_dim)
    return (values.to(torch.float32) * scales[..., None]).to(dtype)


def store(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, kv: torch.Tensor) -> None:
    """Write new tokens' K/V ([T, 2, Hkv, D]) into their slots of one layer's pool, either format."""
    kv_cache.index_copy_(0, slot_mapping, quantize(kv) if is_fp8(kv_cache) else kv.to(kv_cache.dtype))


def gather(kv_cache: torch.Tensor, slots: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """The K/V of the given slots ([N] int64) of one layer's pool as [N, 2, Hkv, D] in dtype, either format."""
    # index_select on a 2-D view is several times faster than advanced indexing on CPU.
    rows = kv_cache.view(kv_cache.shape[0], -1).index_select(0, slots)
    if is_fp8(kv_cache):
        return dequantize(rows, head_dim, dtype)
    return rows.view(slots.shape[0], *kv_cache.shape[1:])
