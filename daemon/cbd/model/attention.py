"""Reference paged attention in plain torch: the CPU path and the oracle for faster kernels.

The KV pool of one layer is a flat tensor of slots `[num_blocks * block_size, 2, num_kv_heads, head_dim]`
(K and V side by side, so one gather fetches both; FP8 slots are bytes, see kv_format.py);
slot `block * block_size + offset` holds position `block_index * block_size + offset` of the sequence
whose block table maps `block_index` to `block`. One step packs the new tokens of every scheduled
sequence into `T` rows; a sequence contributes `query_len` new tokens at the end of its
`context_len` tokens (prefill, a prefill chunk over a cached prefix, or a single decode token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cbd.model import kv_format


@dataclass(slots=True)
class BatchLayout:
    """One step's attention work, independent of the kernel that does it (tensors on the KV device).

    Sequence b owns packed query rows `query_start[b]:query_start[b + 1]`, the last tokens of its
    `context_lens[b]` positions. `max_query_len`/`max_context_len` are host-side bounds (kernels size
    grids and padded shapes with them without a device sync). A CUDA graph's step may end in padding:
    sequences with no rows, and rows past `query_start[B]` (their output is undefined).
    """

    slot_mapping: torch.Tensor  # [T] int64: KV slot each new token is written to
    query_start: torch.Tensor  # [B + 1] int64
    context_lens: torch.Tensor  # [B] int64
    block_tables: torch.Tensor  # [B, W] int64 (unused tail entries are arbitrary)
    max_query_len: int
    max_context_len: int
    # Host-side: the first num_decodes sequences have one new token each (row b is sequence b's), so a
    # backend may serve them with a decode kernel; 0 when not known.
    num_decodes: int = 0
    # A CUDA graph's verifying step: each row's sequence, -1 past the last (`row_sequences`), when its
    # caller already has it (else a backend that needs it derives it).
    seq_of_row: torch.Tensor | None = None


def row_sequences(query_start: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The sequence of each of num_tokens packed rows, -1 past `query_start`'s last (padding), on the
    device with no host read (a CUDA graph captures it)."""
    ends = query_start[1:]
    seq = torch.searchsorted(ends, torch.arange(num_tokens, device=ends.device), right=True)
    return torch.where(seq < ends.shape[0], seq, -1)


def slot_mapping(
    block_tables: torch.Tensor, positions: torch.Tensor, block_size: int, seq_of_row: torch.Tensor | None = None
) -> torch.Tensor:
    """The KV slot of each new token: `block_tables[seq, pos // block_size] * block_size + pos % block_size`.

    block_tables [B, W]; positions [T]; seq_of_row [T], the sequence of each row, or None when row b
    is sequence b's single new token (decode: a gather, no index tensor needed, so CUDA graphs
    capture it from their static inputs alone). The one helper for eager steps, graphs and tests."""
    blocks = positions // block_size
    if seq_of_row is None:
        block_ids = block_tables.gather(1, blocks[:, None])[:, 0]
    else:
        block_ids = block_tables[seq_of_row, blocks]
    return block_ids * block_size + positions % block_size


def sampled_layout(layout: BatchLayout, seq_of_row: torch.Tensor, rows: torch.Tensor) -> BatchLayout:
    """The layout of only `rows`, the sampled rows of a step that samples at most one row per sequence (each a
    sequence's last): one query per sampling sequence over its whole context, as in a decode step. What the last
    layer's attention reads when only the sampled rows go on past it (llama.py); no host read."""
    seqs = seq_of_row.index_select(0, rows)
    num_rows = rows.shape[0]
    return BatchLayout(
        layout.slot_mapping.index_select(0, rows), torch.arange(num_rows + 1, device=rows.device),
        layout.context_lens.index_select(0, seqs), layout.block_tables.index_select(0, seqs), 1,
        layout.max_context_len, num_rows,
    )  # fmt: skip


def key_slots(layout: BatchLayout, block_size: int) -> torch.Tensor:
    """[B, C] int64: the KV slot of each sequence's positions 0..C-1 (C = max_context_len), 0 past its own
    context (a reader takes only each sequence's context; the 0 keeps a gather's index in range)."""
    positions = torch.arange(layout.max_context_len, device=layout.block_tables.device)
    slots = layout.block_tables[:, positions // block_size] * block_size + positions % block_size
    return torch.where(positions[None, :] < layout.context_lens[:, None], slots, 0)


def layout_from_lists(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> BatchLayout:
    """Build a layout from per-sequence lists (tests and tools; the runner stages its own)."""
    if any(q < 1 or q > c for q, c in zip(query_lens, context_lens)):
        raise ValueError("every sequence needs 1 <= query_len <= context_len")
    if any(len(t) * block_size < c for t, c in zip(block_tables, context_lens)):
        raise ValueError("block tables do not cover the context")
    width = max(len(t) for t in block_tables)
    tables = torch.zeros(len(block_tables), width, dtype=torch.int64)
    for row, table in enumerate(block_tables):
        tables[row, : len(table)] = torch.tensor(table, dtype=torch.int64)
    q_lens = torch.tensor(query_lens, dtype=torch.int64)
    ctx = torch.tensor(context_lens, dtype=torch.int64)
    starts = torch.zeros(len(query_lens) + 1, dtype=torch.int64)
    starts[1:] = torch.cumsum(q_lens, 0)
    seq_of_row = torch.repeat_interleave(torch.arange(len(query_lens)), q_lens)
    pos = torch.arange(int(starts[-1])) - starts[seq_of_row] + (ctx - q_lens)[seq_of_row]
    return BatchLayout(
        slot_mapping=slot_mapping(tables, pos, block_size, seq_of_row).to(device),
        query_start=starts.to(device),
        context_lens=ctx.to(device),
        block_tables=tables.to(device),
        max_query_len=max(query_lens),
        max_context_len=max(context_lens),
        num_decodes=next((i for i, q in enumerate(query_lens) if q != 1), len(query_lens)),
    )


@dataclass(slots=True)
class AttentionMetadata:
    """The torch reference's view of a step: padded query/key index grids and a boolean mask."""

    slot_mapping: torch.Tensor  # [T] int64: KV slot each new token is written to
    query_index: torch.Tensor  # [B, Qmax] int64: packed row of each padded query (padding repeats a valid row)
    output_index: torch.Tensor  # [T] int64: flat padded index b * Qmax + i of each packed row
    key_slots: torch.Tensor  # [B, Kmax] int64: KV slot of each context position (padding -> slot 0)
    mask: torch.Tensor  # [B, 1, Qmax, Kmax] bool: True where the query may attend the key

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, scale: float) -> torch.Tensor:
        return paged_attention(q, kv_cache, self, scale)


def reference_metadata(layout: BatchLayout, block_size: int, sliding_window: int | None = None) -> AttentionMetadata:
    """Vectorised on the layout's device (no host sync: the bounds come from the layout)."""
    device = layout.context_lens.device
    starts = layout.query_start
    q_lens, ctx_lens = starts[1:] - starts[:-1], layout.context_lens
    q_max, k_max = layout.max_query_len, layout.max_context_len
    num_seqs = ctx_lens.shape[0]

    key_pos = torch.arange(k_max, device=device)  # [Kmax]

    q_off = torch.arange(q_max, device=device)  # [Qmax]
    last = (q_lens - 1).clamp(min=0)  # a padding sequence (no rows) repeats a row, its output unused
    q_pos = (ctx_lens - q_lens)[:, None] + torch.minimum(q_off[None, :], last[:, None])  # [B, Qmax]
    mask = key_pos[None, None, :] <= q_pos[:, :, None]  # [B, Qmax, Kmax]; implies key < context_len
    if sliding_window is not None:
        mask &= key_pos[None, None, :] > q_pos[:, :, None] - sliding_window

    num_tokens = layout.slot_mapping.shape[0]
    query_index = (starts[:-1, None] + torch.minimum(q_off[None, :], last[:, None])).clamp(max=num_tokens - 1)
    rows = torch.arange(num_tokens, device=device)
    seq_of_row = layout.seq_of_row if layout.seq_of_row is not None else row_sequences(starts, num_tokens)
    seq_of_row = torch.where(seq_of_row < 0, num_seqs - 1, seq_of_row)  # padding rows: the last sequence's
    output_index = seq_of_row * q_max + (rows - starts[seq_of_row]).clamp(max=q_max - 1)  # [T]
    return AttentionMetadata(
        layout.slot_mapping, query_index, output_index, key_slots(layout, block_size), mask[:, None]
    )


@dataclass(slots=True)
class GroupedMetadata:
    """A step whose sequences differ a lot in shape, attended group by group (see `grouped_metadata`)."""

    slot_mapping: torch.Tensor  # [T] int64
    groups: list[tuple[torch.Tensor, AttentionMetadata]]  # (the group's packed rows, its metadata)

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, scale: float) -> torch.Tensor:
        out = torch.zeros_like(q)  # a CUDA graph's padding rows (none of the groups') stay zero
        for rows, meta in self.groups:
            out.index_copy_(0, rows, paged_attention(q.index_select(0, rows), kv_cache, meta, scale))
        return out


# A group may pad its (query x key) grid to at most this many times its sequences' real work.
PADDING_LIMIT = 2.0


def grouped_metadata(
    layout: BatchLayout, block_size: int, sliding_window: int | None = None
) -> AttentionMetadata | GroupedMetadata:
    """The reference metadata, split into groups of similar shape when padding would dominate.

    The reference pads every sequence to the step's longest query and context: a step that mixes one
    long prefill chunk with many decodes would compute (and mask) B x Qmax x Kmax scores instead of the
    sum of q x k. Sequences sorted by (query, context) length are grouped greedily so that each group's
    padded grid stays within PADDING_LIMIT x its real one. Reads the lengths on the host: for the CPU.
    """
    q_lens = (layout.query_start[1:] - layout.query_start[:-1]).tolist()
    ctx_lens = layout.context_lens.tolist()
    real = sum(q * k for q, k in zip(q_lens, ctx_lens))
    if len(q_lens) * layout.max_query_len * layout.max_context_len <= PADDING_LIMIT * real:
        return reference_metadata(layout, block_size, sliding_window)
    order = sorted((b for b in range(len(q_lens)) if q_lens[b]), key=lambda b: (q_lens[b], ctx_lens[b]))
    groups: list[list[int]] = []
    area = q_max = k_max = 0
    for b in order:
        q, k = q_lens[b], ctx_lens[b]
        grown_q, grown_k = max(q_max, q), max(k_max, k)
        if groups and (len(groups[-1]) + 1) * grown_q * grown_k > PADDING_LIMIT * (area + q * k):
            groups.append([])
            area = q_max = k_max = 0
            grown_q, grown_k = q, k
        if not groups:
            groups.append([])
        groups[-1].append(b)
        area, q_max, k_max = area + q * k, grown_q, grown_k
    starts = layout.query_start.tolist()
    out: list[tuple[torch.Tensor, AttentionMetadata]] = []
    for members in groups:
        rows = torch.cat([torch.arange(starts[b], starts[b + 1]) for b in members]).to(layout.slot_mapping.device)
        index = torch.tensor(members, device=layout.context_lens.device)
        sub_q = [q_lens[b] for b in members]
        sub_start = torch.zeros(len(members) + 1, dtype=torch.int64)
        sub_start[1:] = torch.cumsum(torch.tensor(sub_q, dtype=torch.int64), 0)
        sub = BatchLayout(
            slot_mapping=layout.slot_mapping.index_select(0, rows),
            query_start=sub_start.to(layout.query_start.device),
            context_lens=layout.context_lens.index_select(0, index),
            block_tables=layout.block_tables.index_select(0, index),
            max_query_len=max(sub_q),
            max_context_len=max(ctx_lens[b] for b in members),
        )
        out.append((rows, reference_metadata(sub, block_size, sliding_window)))
    return GroupedMetadata(layout.slot_mapping, out)


def build_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    sliding_window: int | None = None,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Reference metadata straight from per-sequence lists."""
    layout = layout_from_lists(query_lens, context_lens, block_tables, block_size, device)
    return reference_metadata(layout, block_size, sliding_window)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv_cache: one layer's pool (either format of kv_format.py); k, v: [T, Hkv, D] -> their slots."""
    kv_format.store(kv_cache, slot_mapping, torch.stack((k, v), dim=1))


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    kv_cache: torch.Tensor,  # one layer's pool, either format of kv_format.py
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    num_seqs, q_max = meta.query_index.shape
    num_heads, head_dim = q.shape[1], q.shape[2]
    k_max = meta.key_slots.shape[1]
    kv = kv_format.gather(kv_cache, meta.key_slots.view(-1), head_dim, q.dtype)
    kv = kv.view(num_seqs, k_max, *kv.shape[1:])  # [B, Kmax, 2, Hkv, D]: one gather for K and V
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
