"""Attention backends behind one interface: `prepare(layout) -> metadata`, `metadata.attend(q, kv, scale)`.

- torch: the reference (`attention.py`), CPU and any device; the oracle for the others.
- triton: the paged kernels of `triton_attention.py` (CUDA): split-KV decode, extend for the rest.
- flash: flash-attn's paged APIs when the package is importable (CUDA, block sizes that are
  multiples of 256, fp16/bf16).
`select_backend` picks the fastest one available for the device, dtype and block size.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Protocol

import torch

from cbd.errors import UnsupportedModel
from cbd.model.attention import BatchLayout, grouped_metadata, reference_metadata

BACKENDS = ("auto", "torch", "triton", "flash")


class PreparedAttention(Protocol):
    """A backend's view of one step: where the new K/V go, and the attention over the pool."""

    @property
    def slot_mapping(self) -> torch.Tensor: ...  # [T] int64

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, scale: float) -> torch.Tensor: ...


class AttentionBackend(Protocol):
    """What the runner and the CUDA graphs need of a backend."""

    name: str
    supports_cuda_graphs: bool  # prepare() reads no host values that change between replays

    def decode_splits(self, num_seqs: int, max_context: int | None = None) -> int:
        """How many KV ranges a decode step's attention is split into; 0: the backend does not split."""
        ...

    def prepare(self, layout: BatchLayout, decode_splits: int = 0) -> PreparedAttention:
        """decode_splits > 0 asserts every sequence has exactly max_query_len queries: 1 (a decode step), or
        1 + k (a step verifying k drafts per sequence; in a verifying graph every sequence is padded to the
        graph's query count); the caller knows, no device read."""
        ...


class TorchBackend:
    name = "torch"
    supports_cuda_graphs = False  # its padded shapes depend on each step's lengths

    def __init__(self, block_size: int, sliding_window: int | None) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window

    def decode_splits(self, num_seqs: int, max_context: int | None = None) -> int:
        return 0  # no split-KV decode kernel: decodes go through the same path as the rest

    def prepare(self, layout: BatchLayout, decode_splits: int = 0) -> PreparedAttention:
        if layout.context_lens.device.type == "cpu":  # lengths are on the host: group by shape
            return grouped_metadata(layout, self.block_size, self.sliding_window)
        return reference_metadata(layout, self.block_size, self.sliding_window)


@dataclass(slots=True)
class TritonMetadata:
    layout: BatchLayout
    block_size: int
    sliding_window: int | None
    decode_splits: int  # > 0: every sequence has max_query_len queries, use the split-KV decode kernel

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.layout.slot_mapping

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, scale: float) -> torch.Tensor:
        from cbd.model import triton_attention

        lay = self.layout
        if self.decode_splits:
            return triton_attention.decode(
                q, kv_cache, lay.block_tables, lay.context_lens, self.block_size, scale, self.decode_splits,
                self.sliding_window, lay.max_query_len,
            )  # fmt: skip
        return triton_attention.extend(
            q, kv_cache, lay.block_tables, lay.query_start, lay.context_lens, lay.max_query_len,
            self.block_size, scale, self.sliding_window,
        )  # fmt: skip


class TritonBackend:
    name = "triton"
    supports_cuda_graphs = True

    def __init__(self, block_size: int, sliding_window: int | None, num_kv_heads: int) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.num_kv_heads = num_kv_heads

    def decode_splits(self, num_seqs: int, max_context: int | None = None) -> int:
        from cbd.model import triton_attention

        return triton_attention.decode_splits(num_seqs, self.num_kv_heads, max_context)

    def prepare(self, layout: BatchLayout, decode_splits: int = 0) -> TritonMetadata:
        """decode_splits > 0 asserts every sequence has exactly max_query_len queries (no device read)."""
        return TritonMetadata(layout, self.block_size, self.sliding_window, decode_splits)


@dataclass(slots=True)
class FlashMetadata:
    layout: BatchLayout
    block_size: int
    window: tuple[int, int]
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seqused_k: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, W] int32
    decode: bool

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.layout.slot_mapping

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, scale: float) -> torch.Tensor:
        import flash_attn

        pages = kv_cache.view(-1, self.block_size, *kv_cache.shape[1:])  # [blocks, page, 2, Hkv, D]
        k_cache, v_cache = pages[:, :, 0], pages[:, :, 1]
        if self.decode:  # every sequence has max_query_len queries (1, or 1 + its drafts)
            queries = self.layout.max_query_len
            out = flash_attn.flash_attn_with_kvcache(
                q.view(-1, queries, *q.shape[1:]), k_cache, v_cache, cache_seqlens=self.seqused_k,
                block_table=self.block_table, softmax_scale=scale, causal=True, window_size=self.window,
            )  # fmt: skip
            return out.view(q.shape)
        cu_k = torch.zeros_like(self.cu_seqlens_q)
        cu_k[1:] = torch.cumsum(self.seqused_k, 0)
        return flash_attn.flash_attn_varlen_func(
            q, k_cache, v_cache, self.cu_seqlens_q, cu_k, self.layout.max_query_len,
            self.layout.max_context_len, softmax_scale=scale, causal=True, window_size=self.window,
            block_table=self.block_table,
        )  # fmt: skip


class FlashBackend:
    name = "flash"
    supports_cuda_graphs = True

    def __init__(self, block_size: int, sliding_window: int | None) -> None:
        self.block_size = block_size
        self.window = (sliding_window - 1, 0) if sliding_window else (-1, -1)

    def decode_splits(self, num_seqs: int, max_context: int | None = None) -> int:
        return 1  # flash-attn chooses its own split

    def prepare(self, layout: BatchLayout, decode_splits: int = 0) -> FlashMetadata:
        return FlashMetadata(
            layout, self.block_size, self.window, layout.query_start.to(torch.int32),
            layout.context_lens.to(torch.int32), layout.block_tables.to(torch.int32), decode_splits > 0,
        )  # fmt: skip


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def select_backend(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    block_size: int,
    sliding_window: int | None,
    num_kv_heads: int,
    fp8_kv: bool = False,
) -> AttentionBackend:
    """Resolve "auto" (flash > triton > torch where each applies) or check an explicit choice.
    dtype: the model's; fp8_kv: the pool is in kv_format's FP8 layout (not for flash-attn)."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    cuda = device.type == "cuda"
    flash_ok = cuda and flash_attn_available() and block_size % 256 == 0 and dtype != torch.float32 and not fp8_kv
    if name == "auto":
        name = "flash" if flash_ok else "triton" if cuda and triton_available() else "torch"
    if name == "flash" and not flash_ok:
        raise UnsupportedModel(
            "the flash backend needs CUDA, the flash_attn package, fp16/bf16, a block size that is a "
            f"multiple of 256 and kv_cache_dtype auto (block size {block_size}, dtype {dtype}, device {device}, "
            f"fp8 KV {fp8_kv})"
        )
    if name == "triton" and not (cuda and triton_available()):
        raise UnsupportedModel(f"the triton backend needs CUDA and the triton package (device {device})")
    if name == "triton" and fp8_kv and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise UnsupportedModel(
            f"kv_cache_dtype fp8 needs a GPU of compute capability 8.9 or newer for its float8 kernels (this one "
            f"is {major}.{minor}); use kv_cache_dtype auto"
        )
    if name == "flash":
        return FlashBackend(block_size, sliding_window)
    if name == "triton":
        return TritonBackend(block_size, sliding_window, num_kv_heads)
    return TorchBackend(block_size, sliding_window)
