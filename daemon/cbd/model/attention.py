"""Reference paged attention in plain torch: the CPU path and the oracle for faster kernels.

The KV pool of one layer is a flat tensor of slots `[num_blocks * block_size, 2, num_kv_heads, head_dim]`
(K and V side by side, so one gather fetches both);
slot `block * block_size + offset` holds position `block_index * block_size + offset` of the sequence
whose block table maps `block_index` to `block`. One step packs the new tokens of every scheduled
sequence into `T` rows; a sequence contributes `query_len` new tokens at the end of its
`context_len` tokens (prefill, a prefill chunk over a cached prefix, or a single decode token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttentionMetadata:
    """Where each new token's K/V goes and which keys each query sees; built once a step, shared by all layers."""

    slot_mapping: torch.Tensor  # [T] int64: KV slot each new token is written to
    query_index: torch.Tensor  # [B, Qmax] int64: packed row of each padded query (padding repeats a valid row)
    output_index: torch.Tensor  # [T] int64: flat padded index b * Qmax + i of each packed row
    key_slots: torch.Tensor  # [B, Kmax] int64: KV slot of each context position (padding -> slot 0)
    mask: torch.Tensor  # [B, 1, Qmax, Kmax] bool: True where the query may attend the key

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]


def build_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    sliding_window: int | None = None,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Vectorised construction from per-sequence lists (host side); the result lives on `device`."""
    num_seqs = len(query_lens)
    q_lens = torch.tensor(query_lens, dtype=torch.int64)
    ctx_lens = torch.tensor(context_lens, dtype=torch.int64)
    if bool((q_lens < 1).any()) or bool((q_lens > ctx_lens).any()):
        raise ValueError("every sequence needs 1 <= query_len <= context_len")
    q_max, k_max = int(q_lens.max()), int(ctx_lens.max())
    width = max(len(t) for t in block_tables)
    if width * block_size < k_max:
        raise ValueError("block tables do not cover the context")
    tables = torch.zeros(num_seqs, width, dtype=torch.int64)
    for row, table in enumerate(block_tables):
        tables[row, : len(table)] = torch.tensor(table, dtype=torch.int64)

    key_pos = torch.arange(k_max)  # [Kmax]
    key_slots = tables[:, key_pos // block_size] * block_size + key_pos % block_size  # [B, Kmax]
    key_slots = torch.where(key_pos[None, :] < ctx_lens[:, None], key_slots, 0)

    q_off = torch.arange(q_max)  # [Qmax]
    q_valid = q_off[None, :] < q_lens[:, None]  # [B, Qmax]
    q_pos = (ctx_lens - q_lens)[:, None] + torch.minimum(q_off[None, :], q_lens[:, None] - 1)  # [B, Qmax]
    mask = key_pos[None, None, :] <= q_pos[:, :, None]  # [B, Qmax, Kmax]; implies key < context_len
    if sliding_window is not None:
        mask &= key_pos[None, None, :] > q_pos[:, :, None] - sliding_window

    starts = torch.cumsum(q_lens, 0) - q_lens  # [B]
    query_index = starts[:, None] + torch.minimum(q_off[None, :], q_lens[:, None] - 1)
    output_index = (torch.arange(num_seqs)[:, None] * q_max + q_off[None, :])[q_valid]  # [T]
    new_slots = tables.gather(1, q_pos // block_size) * block_size + q_pos % block_size
    slot_mapping = new_slots[q_valid]

    return AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        query_index=query_index.to(device),
        output_index=output_index.to(device),
        key_slots=key_slots.to(device),
        mask=mask[:, None].to(device),
    )


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv_cache: [S, 2, Hkv, D]; k, v: [T, Hkv, D] -> their slots in the layer's pool."""
    kv_cache.index_copy_(0, slot_mapping, torch.stack((k, v), dim=1))


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    kv_cache: torch.Tensor,  # [S, 2, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    num_seqs, q_max = meta.query_index.shape
    num_heads, head_dim = q.shape[1], q.shape[2]
    k_max = meta.key_slots.shape[1]
    # index_select on a 2-D view is several times faster than advanced indexing on CPU.
    kv = kv_cache.view(kv_cache.shape[0], -1).index_select(0, meta.key_slots.view(-1))
    kv = kv.view(num_seqs, k_max, *kv_cache.shape[1:])  # [B, Kmax, 2, Hkv, D]: one gather for K and V
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)  # [B, Hkv, Kmax, D]
    if q_max == 1:
        qp = q[:, :, None, :]  # [B, H, 1, D]
    else:
        qp = q.index_select(0, meta.query_index.view(-1)).view(num_seqs, q_max, num_heads, head_dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(qp, k, v, attn_mask=meta.mask, scale=scale, enable_gqa=True)
    if q_max == 1:
        return out[:, :, 0, :]
    out = out.transpose(1, 2).reshape(num_seqs * q_max, num_heads, head_dim)
    return out.index_select(0, meta.output_index)
