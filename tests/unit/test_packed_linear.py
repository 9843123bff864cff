"""oneDNN-packed linears: same results as nn.Linear, and a bounded set of GEMM shapes whatever the batch."""

from __future__ import annotations

import pytest
import torch

from cbd.model.packed_linear import PackedLinear, packing_available, row_bucket


def test_row_buckets_bound_padding_and_the_number_of_shapes() -> None:
    buckets = [row_bucket(r) for r in range(1, 4097)]
    assert all(b >= r for r, b in zip(range(1, 4097), buckets))
    assert all(b == r for r, b in zip(range(1, 9), buckets))
    assert all(b - r < 8 or b - r < r / 8 for r, b in zip(range(1, 4097), buckets))  # under 1/8 more rows
    assert len(set(buckets)) <= 100  # shapes oneDNN builds a primitive for, up to 4096 rows


@pytest.mark.skipif(not packing_available(), reason="oneDNN weight packing not available")
@pytest.mark.parametrize("rows", [1, 7, 9, 33, 130, 1025])
def test_packed_linear_equals_linear(rows: int) -> None:
    torch.manual_seed(rows)
    linear = torch.nn.Linear(64, 96, bias=True)
    x = torch.randn(rows, 64)
    with torch.inference_mode():
        out = PackedLinear(linear, 32)(x)
        assert out.shape == (rows, 96)
        torch.testing.assert_close(out, linear(x), atol=1e-5, rtol=1e-5)
