"""FlashAttention-4 for prefill and extend steps, Triton's split-KV kernel for decode and verifying steps.

FA4 (`flash-attn-4`, written in NVIDIA's CuTe DSL, compiled at run time, no nvcc) reads K/V in place from
cbd's paged pool: one layer's slot pool `[S, 2, Hkv, D]` viewed as pages `[S / PAGE, PAGE, 2, Hkv, D]`, K and
V its two strided halves (token stride 2 * Hkv * D elements); `page_table` is the step's block table,
`seqused_k` the context lengths, `cu_seqlens_q` the packed query starts. FA4's causal mask is aligned at the
end of each sequence's keys (query i of a q-long run at the end of c keys sees keys <= c - q + i): cbd's rule,
so a prefill chunk over a cached prefix, a session turn and a mixed step (prefills beside decodes) are one
varlen call with no gather copy.

Decode and verifying steps (each sequence its newest token and its own drafts; the CUDA graphs capture them) stay on Triton: FA4
has no split-KV on sm90, so a single decode's long context would be read by one program per head.

Compilation: FA4 compiles one kernel per variant at its first call (seconds). For one model the variants are
three: GQA heads packed into a tile or not (`pack_gqa`), and with packing, all of a sequence's packed rows
fitting one tile (a persistent schedule) or not; the runner's warm-up runs all three (16-, 100- and
160-query extends, and a mixed step for the Triton half). Compiled kernels are kept on disk (FA4's own
cache, under cbd's cache directory): on an H200 a cold warm-up took 11 s, one from the cache 0.2 s.

Mixed steps: the leading decodes (`BatchLayout.num_decodes`) go to Triton's extend kernel, the rest to FA4.

Long chunks (a sequence with `GATHER_MIN_QUERIES` or more queries, the copy within `GATHER_MAX_BYTES`, no
sliding window): each layer first copies the step's keys and values into one contiguous tensor in position
order (`key_slots`, one gather), and FA4 reads that instead of the pages. FA4 loads pages smaller than its
128-key tile with plain loads and a contiguous tensor by TMA; the copy costs ~2 x 4 KB per key per layer at the
8B shape, repaid many times over by a chunk of hundreds of queries.

Importing FA4 takes 3-17 s (the CuTe DSL); `load()` does it once, when the backend is chosen at start.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cbd.model import cute_packages
from cbd.model.attention import BatchLayout, key_slots
from cbd.model.attention_backends import PreparedAttention, TritonBackend

# A mixed step's leading decodes go to Triton (FA4 would give each a 128-row tile, one per query head when
# the step also holds whole tiles of queries: 5x the attention time of the priorities benchmark's mixed step).
SPLIT_DECODES = True
PACK_GQA_BELOW = 128  # queries per sequence (FA4's tile height on sm90 at head dim 128)
# Long chunks read their keys from a contiguous copy: FA4 loads paged K/V in 8-16-token pages with plain loads,
# contiguous K/V by TMA. The copy (one gather per layer, 2 x 4 KB per key at the 8B shape) is repaid once a
# sequence has GATHER_MIN_QUERIES queries; GATHER_MAX_BYTES bounds it (sequences x longest context x K and V).
GATHER_MIN_QUERIES = 512
GATHER_MAX_BYTES = 256 << 20


def installed() -> bool:
    """The package is present (cheap: imports nothing of it; `load` may still fail on a missing dependency)."""
    return cute_packages.present("flash_attn.cute")


@functools.cache
def load() -> Callable | str:
    """FA4's `flash_attn_varlen_func`, or why it cannot be imported (the exception, one line)."""
    return cute_packages.import_from("flash_attn.cute", "flash_attn_varlen_func", "flash-attn-4")


def unusable_reason(device: torch.device, dtype: torch.dtype, head_dim: int, fp8_kv: bool) -> str | None:
    """Why FA4 cannot serve this model here, or None. Imports FA4 (once) when everything else allows it."""
    reason = cute_packages.device_reason(device, dtype)
    if reason is not None:
        return reason
    if fp8_kv:
        return "kv_cache_dtype fp8 is served by the Triton kernels"
    if head_dim % 8 or not 8 <= head_dim <= 256:
        return f"it needs a head dim in [8, 256] divisible by 8 (head dim {head_dim})"
    loaded = load()
    return loaded if isinstance(loaded, str) else None


@dataclass(slots=True)
class FlashMetadata:
    """One prefill / extend / mixed step for FA4: the layout's tensors in the int32 FA4 reads (converted once
    per step, used by every layer)."""

    layout: BatchLayout
    block_size: int
    window: tuple[int | None, int | None]
    varlen: Callable
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seqused_k: torch.Tensor  # [B] int32
    page_table: torch.Tensor  # [B, W] int32, contiguous
    # [B, C] int64: the slot of each sequence's position 0..C-1 (C: the longest context; 0 past a shorter
    # one) when the step reads its keys from a gathered copy; None: from the pages in place.
    key_slots: torch.Tensor | None = None

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.layout.slot_mapping

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, scale: float) -> torch.Tensor:
        if self.key_slots is not None:  # [B, C, 2, Hkv, D]: one copy of both halves, in position order
            kv = kv_cache.index_select(0, self.key_slots.view(-1)).view(*self.key_slots.shape, *kv_cache.shape[1:])
            page_table = None
        else:
            kv = kv_cache.view(-1, self.block_size, *kv_cache.shape[1:])  # [P, PAGE, 2, Hkv, D]
            page_table = self.page_table
        out, _ = self.varlen(
            q, kv[:, :, 0], kv[:, :, 1], cu_seqlens_q=self.cu_seqlens_q, max_seqlen_q=self.layout.max_query_len,
            max_seqlen_k=self.layout.max_context_len, seqused_k=self.seqused_k, page_table=page_table,
            softmax_scale=scale, causal=True, window_size=self.window, pack_gqa=self.pack_gqa,
        )  # fmt: skip
        return out  # [T, H, D]

    @property
    def pack_gqa(self) -> bool | None:
        """FA4 packs a GQA group's heads into one tile by default; with whole tiles of queries per head, one head
        per tile measured faster on the H200 (an 8K chunk at 32K: 6.2 ms per layer against 6.6)."""
        return False if self.layout.max_query_len >= PACK_GQA_BELOW else None


@dataclass(slots=True)
class SplitMetadata:
    """A mixed step: its leading decodes on Triton's extend kernel (16-row tiles), the sequences after them on FA4."""

    slot_mapping: torch.Tensor  # [T] int64, the whole step's
    num_decodes: int
    decodes: PreparedAttention
    rest: FlashMetadata

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, scale: float) -> torch.Tensor:
        n = self.num_decodes
        return torch.cat((self.decodes.attend(q[:n], kv_cache, scale), self.rest.attend(q[n:], kv_cache, scale)))


class FlashBackend:
    """FA4 for steps with a sequence of several new tokens; Triton for decode and verifying steps."""

    name = "flash"
    supports_cuda_graphs = True  # the graphs capture decode / verifying steps: Triton's, which read no host values

    def __init__(
        self, block_size: int, sliding_window: int | None, num_kv_heads: int, varlen: Callable, head_dim: int = 128
    ) -> None:
        self.block_size = block_size
        self.key_bytes = 2 * num_kv_heads * head_dim * 2  # K and V of one position, 16-bit (FA4's dtypes)
        self.window: tuple[int | None, int | None] = (sliding_window - 1, 0) if sliding_window else (None, None)
        self.varlen = varlen
        self.decodes = TritonBackend(block_size, sliding_window, num_kv_heads)

    def decode_splits(self, num_seqs: int, max_context: int | None = None) -> int:
        return self.decodes.decode_splits(num_seqs, max_context)

    def prepare(self, layout: BatchLayout, decode_splits: int = 0) -> PreparedAttention:
        if decode_splits > 0:
            return self.decodes.prepare(layout, decode_splits)
        n, num_seqs = layout.num_decodes, layout.context_lens.shape[0]
        if n == num_seqs:  # only decodes, yet not a decode step (a sequence sampling several rows)
            return self.decodes.prepare(layout)
        if n > 0 and SPLIT_DECODES:
            head = BatchLayout(
                layout.slot_mapping[:n], layout.query_start[: n + 1], layout.context_lens[:n], layout.block_tables[:n],
                1, layout.max_context_len, n,
            )  # fmt: skip
            tail = BatchLayout(
                layout.slot_mapping[n:], layout.query_start[n:] - n, layout.context_lens[n:], layout.block_tables[n:],
                layout.max_query_len, layout.max_context_len,
            )  # fmt: skip
            # Triton's extend kernel (one variant, warmed up), not its decode kernel: that one compiles per
            # split count, which here would follow each step's decode count and context.
            return SplitMetadata(layout.slot_mapping, n, self.decodes.prepare(head), self._flash(tail))
        return self._flash(layout)

    def _flash(self, layout: BatchLayout) -> FlashMetadata:
        return FlashMetadata(
            layout, self.block_size, self.window, self.varlen, layout.query_start.to(torch.int32),
            layout.context_lens.to(torch.int32), layout.block_tables.to(torch.int32).contiguous(),
            key_slots(layout, self.block_size) if self.gathers(layout) else None,
        )  # fmt: skip

    def gathers(self, layout: BatchLayout) -> bool:
        """Whether a step's FA4 part reads its keys from a gathered copy (host-side bounds only, no device read);
        never with a sliding window (the copy would hold the whole context, FA4 reads only the window)."""
        copy = layout.context_lens.shape[0] * layout.max_context_len * self.key_bytes
        return layout.max_query_len >= GATHER_MIN_QUERIES and copy <= GATHER_MAX_BYTES and self.window == (None, None)
