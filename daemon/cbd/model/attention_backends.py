"""Attention backends behind one interface: `prepare(layout) -> metadata`, `metadata.attend(q, kv, scale)`.

- torch: the reference (`attention.py`), CPU and any device; the oracle for the others.
- triton: the paged kernels of `triton_attention.py` (CUDA, split-KV decode) and `triton_extend.py` (the rest).
- flash: FlashAttention-4 (`flash_attention.py`) for prefill / extend / mixed steps on compute capability
  9.0+, Triton for decode and verifying steps (FA4 has no split-KV on sm90).
`select_backend` picks the fastest one available for the device, dtype and KV format, and logs it.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from cbd.errors import UnsupportedModel
from cbd.model.attention import BatchLayout, grouped_metadata, reference_metadata, row_sequences

BACKENDS = ("auto", "torch", "triton", "flash")

log = logging.getLogger(__name__)


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
        """decode_splits > 0 asserts a step whose every token is sampled: one per sequence (max_query_len 1, a
        decode step), or each sequence's last token and its drafts (a step verifying up to max_query_len - 1
        drafts per sequence; rows past the last sequence's are padding); the caller knows, no device read."""
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
    decode_splits: int  # > 0: a decode or verifying step (see AttentionBackend.prepare): the split-KV decode kernel
    seq_of_row: torch.Tensor | None = None  # a verifying step's: each row's sequence (-1: padding)

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.layout.slot_mapping

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, scale: float) -> torch.Tensor:
        from cbd.model import triton_attention, triton_extend

        lay = self.layout
        if self.decode_splits:
            return triton_attention.decode(
                q, kv_cache, lay.block_tables, lay.context_lens, self.block_size, scale, self.decode_splits,
                self.sliding_window, lay.max_query_len, lay.query_start, self.seq_of_row,
            )  # fmt: skip
        return triton_extend.extend(
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
        """decode_splits > 0: a decode or verifying step (see AttentionBackend.prepare); no device read."""
        rows = layout.seq_of_row
        if decode_splits > 0 and layout.max_query_len > 1 and rows is None:  # once per step, not per layer
            rows = row_sequences(layout.query_start, layout.slot_mapping.shape[0])
        return TritonMetadata(layout, self.block_size, self.sliding_window, decode_splits, rows)


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
    head_dim: int = 128,
) -> AttentionBackend:
    """Resolve "auto" or check an explicit choice, and log the backend chosen and why.

    auto: on CUDA, `flash` (FA4 for prefill / extend / mixed steps, Triton for decode and verifying steps)
    where FA4 is installed and serves the model (compute capability >= 9.0, bf16/fp16, KV not FP8), else
    `triton`; `torch` on the CPU. dtype: the model's; fp8_kv: the pool is in kv_format's FP8 layout."""
    from cbd.model import flash_attention

    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    cuda = device.type == "cuda"
    flash_reason = None
    if name in ("flash", "auto"):
        flash_reason = flash_attention.unusable_reason(device, dtype, head_dim, fp8_kv)
    if name == "flash" and flash_reason is not None:
        raise UnsupportedModel(f"attention_backend flash (FlashAttention-4) cannot run: {flash_reason}")
    requested = name
    if name == "auto":
        name = "flash" if cuda and flash_reason is None else "triton" if cuda and triton_available() else "torch"
    if name == "triton" and not (cuda and triton_available()):
        raise UnsupportedModel(f"the triton backend needs CUDA and the triton package (device {device})")
    if name == "triton" and fp8_kv and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise UnsupportedModel(
            f"kv_cache_dtype fp8 needs a GPU of compute capability 8.9 or newer for its float8 kernels (this one "
            f"is {major}.{minor}); use kv_cache_dtype auto"
        )
    why = {
        "flash": "FlashAttention-4 for prefill/extend steps, Triton for decode steps",
        "triton": "Triton paged kernels for every step"
        + (f"; not FlashAttention-4: {flash_reason}" if flash_reason else ""),
        "torch": "the plain-torch reference" + (f"; not FlashAttention-4: {flash_reason}" if flash_reason else ""),
    }[name]
    log.info("attention backend: %s (%s: %s)", name, "chosen by auto" if requested == "auto" else "requested", why)
    if name == "flash":
        varlen = flash_attention.load()
        assert not isinstance(varlen, str)  # unusable_reason returned None: it loaded
        return flash_attention.FlashBackend(block_size, sliding_window, num_kv_heads, varlen, head_dim)
    if name == "triton":
        return TritonBackend(block_size, sliding_window, num_kv_heads)
    return TorchBackend(block_size, sliding_window)
