"""Linear layers with weights pre-packed for oneDNN: faster CPU GEMMs for the small batches of decoding.

The packed GEMM accumulates in another order than the plain BLAS path, so logits differ in the last
bits (about 1e-5 relative); correctness tests against transformers run with packing off.

oneDNN builds (and caches, with its own buffers) one primitive per input shape. A serving engine feeds
a different number of rows nearly every step, which grew a daemon's memory by gigabytes over hours; the
rows are therefore padded up to one of a few bucket sizes (under 1/8 more rows, or under 8), so the
cache holds a fixed, small set of primitives.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def row_bucket(rows: int) -> int:
    """The padded row count for `rows`: exact up to 8, then steps of 1/16 of the next power of two (at
    least 8), i.e. under 1/8 more rows; about 60 sizes up to 4096 rows."""
    if rows <= 8:
        return rows
    step = max(8, (1 << (rows - 1).bit_length()) // 16)
    return -(-rows // step) * step


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, batch_hint: int) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer(
            "packed_weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint)
        )
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        padded = row_bucket(rows)
        if padded != rows:
            x = F.pad(x, (0, 0, 0, padded - rows))
        out = torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed_weight, self.bias, "none", [], "")
        return out[:rows] if padded != rows else out


def pack_linears(model: nn.Module, batch_hint: int = 32) -> int:
    """Replace every nn.Linear of a CPU fp32 model in place; returns how many were packed."""
    count = 0
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, PackedLinear(child, batch_hint))
            count += 1
        else:
            count += pack_linears(child, batch_hint)
    return count
