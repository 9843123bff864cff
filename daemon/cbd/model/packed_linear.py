"""Linear layers with weights pre-packed for oneDNN: faster CPU GEMMs for the small batches of decoding.

The packed GEMM accumulates in another order than the plain BLAS path, so logits differ in the last
bits (about 1e-5 relative); correctness tests against transformers run with packing off.
"""

from __future__ import annotations

import torch
from torch import nn


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, batch_hint: int) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed_weight, self.bias, "none", [], "")


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
