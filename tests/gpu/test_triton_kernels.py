"""Triton kernels vs the torch reference on random inputs.

Runs on CUDA, or on CPU under Triton's interpreter (`TRITON_INTERPRET=1`, slow); skipped where
neither is available (CI has no GPU and no Triton).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

pytest.importorskip("triton")
if torch.cuda.is_available():
    DEVICE = "cuda"
elif os.environ.get("TRITON_INTERPRET") == "1":
    DEVICE = "cpu"
    from triton.runtime import interpreter as _interpreter

    _patch_tensor = _interpreter._patch_lang_tensor

    def _patch_with_scalar_index(tensor, scope):
        # The interpreter keeps scalars as 1-element arrays, which numpy 2 refuses to int(): use .item().
        _patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _interpreter._patch_lang_tensor = _patch_with_scalar_index
else:
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from cbd.model import kv_format, ops, triton_attention, triton_extend, triton_ops  # noqa: E402
from cbd.model.attention import layout_from_lists, reference_metadata, row_sequences  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]
TOL = {torch.float32: 2e-4, torch.bfloat16: 2e-2}


def _paged_case(rng: random.Random, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                query_lens: list[int], context_lens: list[int]):  # fmt: skip
    num_blocks = sum(-(-c // block_size) for c in context_lens) + 4
    free = list(range(num_blocks))
    rng.shuffle(free)  # block tables are not contiguous
    tables = [[free.pop() for _ in range(-(-c // block_size))] for c in context_lens]
    kv = torch.randn(num_blocks * block_size, 2, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    layout = layout_from_lists(query_lens, context_lens, tables, block_size, DEVICE)
    return kv, layout


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [4, 16, 32])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (12, 3), (32, 8)])
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_kernel_matches_reference(dtype, block_size, heads, window, splits) -> None:
    rng = random.Random(block_size * 7 + heads[0] + splits)
    torch.manual_seed(rng.randrange(1000))
    num_heads, num_kv_heads = heads
    head_dim = 64
    context_lens = [rng.randrange(1, 300) for _ in range(6)] + [1, 129]
    kv, layout = _paged_case(rng, block_size, num_kv_heads, head_dim, dtype, [1] * len(context_lens), context_lens)
    q = torch.randn(len(context_lens), num_heads, head_dim, device=DEVICE).to(dtype)
    scale = head_dim**-0.5
    ours = triton_attention.decode(q, kv, layout.block_tables, layout.context_lens, block_size, scale, splits, window)
    ref = reference_metadata(layout, block_size, window).attend(q.float(), kv.float(), scale)
    torch.testing.assert_close(ours.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("queries", [3, 9])
@pytest.mark.parametrize("heads", [(8, 2), (32, 8), (12, 3), (16, 2)])  # GQA 4, 4, 4, 8 (128 rows at 9 queries)
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_kernel_with_drafts_matches_reference(dtype, queries, heads, window, splits) -> None:
    """The decode kernel over each sequence's own 1 + k last positions, laid out ragged (a step verifying
    k drafts, k per sequence): causal among them, ranges that end before a query's position merged away;
    a sequence with no rows and rows past the last sequence's (a CUDA graph's padding) change nothing."""
    rng = random.Random(queries * 5 + heads[0] + splits)
    torch.manual_seed(rng.randrange(1000))
    num_heads, num_kv_heads = heads
    head_dim, block_size = 64, 16
    context_lens = [rng.randrange(queries, 400) for _ in range(4)] + [queries, 129, 130]
    query_lens = [rng.randint(1, queries) for _ in context_lens[:-1]] + [queries]
    kv, layout = _paged_case(rng, block_size, num_kv_heads, head_dim, dtype, query_lens, context_lens)
    real = sum(query_lens)
    q = torch.randn(real + 3, num_heads, head_dim, device=DEVICE).to(dtype)  # 3 padding rows
    scale = head_dim**-0.5
    starts = torch.cat([layout.query_start, layout.query_start[-1:]])  # then a sequence of no rows
    ctx = torch.cat([layout.context_lens, layout.context_lens[:1]])
    tables = torch.cat([layout.block_tables, layout.block_tables[:1]])
    rows = row_sequences(starts, real + 3)
    assert rows[real:].tolist() == [-1] * 3
    ours = triton_attention.decode(q, kv, tables, ctx, block_size, scale, splits, window, queries, starts, rows)
    ref = reference_metadata(layout, block_size, window).attend(q[:real].float(), kv.float(), scale)
    torch.testing.assert_close(ours[:real].float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (32, 8), (14, 2)])
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_extend_kernel_matches_reference(dtype, block_size, heads, window, head_dim) -> None:
    """Prefills, chunks over a cached prefix and decodes mixed in one batch."""
    rng = random.Random(block_size + heads[0] * 3 + head_dim)
    torch.manual_seed(rng.randrange(1000))
    num_heads, num_kv_heads = heads
    scale = head_dim**-0.5
    cases = [
        # long runs, decodes and short runs (drafts) in one batch: two launches
        ([70, 1, 13, 1, 33, 5, 2, 4], [70, 90, 13, 200, 140, 5, 77, 4]),
        ([1, 3, 1, 2], [50, 9, 1, 130]),  # only short runs: one launch of short tiles
    ]
    for query_lens, context_lens in cases:
        kv, layout = _paged_case(rng, block_size, num_kv_heads, head_dim, dtype, query_lens, context_lens)
        q = torch.randn(sum(query_lens), num_heads, head_dim, device=DEVICE).to(dtype)
        ours = triton_extend.extend(
            q, kv, layout.block_tables, layout.query_start, layout.context_lens, layout.max_query_len, block_size,
            scale, window,
        )  # fmt: skip
        ref = reference_metadata(layout, block_size, window).attend(q.float(), kv.float(), scale)
        torch.testing.assert_close(ours.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_elementwise_ops_match_torch(dtype) -> None:
    torch.manual_seed(0)
    x = torch.randn(7, 96, device=DEVICE).to(dtype)
    r = torch.randn(7, 96, device=DEVICE).to(dtype)
    w = torch.randn(96, device=DEVICE).to(dtype)
    ops.set_fused(False)
    try:
        ref_norm, ref_sum = ops.rms_norm(x, w, 1e-5, r)
        ref_plain, _ = ops.rms_norm(x, w, 1e-5)
        ref_act = ops.silu_mul(torch.cat((x, r), dim=1))
    finally:
        ops.set_fused(True)
    norm, total = triton_ops.rms_norm(x, w, 1e-5, r)
    plain, _ = triton_ops.rms_norm(x, w, 1e-5)
    act = triton_ops.silu_mul(torch.cat((x, r), dim=1))
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(total, ref_sum, atol=0, rtol=0)
    torch.testing.assert_close(norm, ref_norm, **tol)
    torch.testing.assert_close(plain, ref_plain, **tol)
    torch.testing.assert_close(act, ref_act, **tol)


def _rope_inputs(dtype: torch.dtype, seed: int, magnitude: float) -> tuple[torch.Tensor, ...]:
    """q, k, v as views of one fused projection's output (9 tokens, 6 / 2 heads of 32), positions, the
    cos / sin tables and the slots the new K/V go to (16 slots)."""
    torch.manual_seed(seed)
    tokens, heads, kv_heads, dim = 9, 6, 2, 32
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, device=DEVICE) * magnitude).to(dtype)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    positions = torch.tensor([0, 5, 6, 7, 100, 3, 2, 1, 50], device=DEVICE)
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.outer(torch.arange(128, dtype=torch.float32), inv)
    cos = torch.cat((freqs, freqs), -1).cos().to(DEVICE)
    sin = torch.cat((freqs, freqs), -1).sin().to(DEVICE)
    slots = torch.tensor([3, 9, 1, 0, 12, 15, 4, 7, 8], device=DEVICE)
    return q, k, v, positions, cos, sin, slots


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_rope_and_kv_write_match_torch(dtype) -> None:
    q, k, v, positions, cos, sin, slots = _rope_inputs(dtype, seed=1, magnitude=1.0)
    kv_heads, dim = k.shape[1], k.shape[2]
    ref_kv = torch.zeros(16, 2, kv_heads, dim, device=DEVICE, dtype=dtype)
    ours_kv = ref_kv.clone()
    ops.set_fused(False)
    try:
        ref_q = ops.rope_and_write_kv(q, k, v, positions, cos, sin, ref_kv, slots)
    finally:
        ops.set_fused(True)
    ours_q = triton_ops.rope_and_write_kv(q, k, v, positions, cos, sin, ours_kv, slots)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1.6e-2, "rtol": 8e-3}
    torch.testing.assert_close(ours_q, ref_q, **tol)  # bf16: the same roundings, up to one ulp
    torch.testing.assert_close(ours_kv, ref_kv, **tol)


def _fp8(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float pool [S, 2, Hkv, D] -> (the FP8 pool, what it holds as fp32: the reference's input)."""
    pool = kv_format.quantize(kv)
    return pool, kv_format.dequantize(pool, kv.shape[-1], torch.float32)


# Every way the FP8 tiles can be widened (triton_attention.FP8_WIDEN; on CPU the float32 rows take 0).
WIDEN_MODES = [1, 2, 3] if DEVICE == "cuda" else [triton_attention.FP8_WIDEN]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(8, 2), (32, 8)])
@pytest.mark.parametrize("splits", [1, 5])
@pytest.mark.parametrize("window", [None, 700])
@pytest.mark.parametrize("widen", WIDEN_MODES)
@pytest.mark.parametrize("queries", [1, 5])
def test_fp8_decode_kernel_matches_reference(dtype, heads, splits, window, widen, queries, monkeypatch) -> None:
    """Several ranges per sequence (with a window: over its last keys only); one KV head's V is tiny (its
    scales are far below fp16's normal range) and another's large. 5 queries: a step verifying 4 drafts."""
    monkeypatch.setattr(triton_attention, "FP8_WIDEN", widen)
    rng = random.Random(heads[0] + splits)
    torch.manual_seed(rng.randrange(1000))
    num_heads, num_kv_heads = heads
    head_dim, block_size = 128, 16
    context_lens = [rng.randrange(queries, 2000) for _ in range(5)] + [queries, 256, 257, 1900]
    kv, layout = _paged_case(rng, block_size, num_kv_heads, head_dim, dtype, [queries] * len(context_lens),
                             context_lens)  # fmt: skip
    kv = kv.float() * 4
    kv[:, 1, 0] *= 1e-7
    kv[:, 1, 1] *= 1e3
    pool, held = _fp8(kv)
    q = torch.randn(len(context_lens) * queries, num_heads, head_dim, device=DEVICE).to(dtype)
    scale = head_dim**-0.5
    starts = layout.query_start
    ours = triton_attention.decode(q, pool, layout.block_tables, layout.context_lens, block_size, scale, splits,
                                   window, queries, starts, row_sequences(starts, q.shape[0]))  # fmt: skip
    ref = reference_metadata(layout, block_size, window).attend(q.float(), held, scale)
    group = num_heads // num_kv_heads
    for kv_head in range(num_kv_heads):  # each head against its own magnitude
        rows = slice(kv_head * group, (kv_head + 1) * group)
        size = float(ref[:, rows].abs().max())
        torch.testing.assert_close(ours[:, rows].float() / size, ref[:, rows] / size, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("widen", WIDEN_MODES)
def test_fp8_extend_kernel_matches_reference(dtype, window, widen, monkeypatch) -> None:
    monkeypatch.setattr(triton_attention, "FP8_WIDEN", widen)
    rng = random.Random(3)
    torch.manual_seed(3)
    num_heads, num_kv_heads, head_dim, block_size = 32, 8, 128, 16
    query_lens, context_lens = [70, 1, 13, 1, 2], [70, 900, 13, 200, 77]
    kv, layout = _paged_case(rng, block_size, num_kv_heads, head_dim, dtype, query_lens, context_lens)
    pool, held = _fp8(kv.float())
    q = torch.randn(sum(query_lens), num_heads, head_dim, device=DEVICE).to(dtype)
    scale = head_dim**-0.5
    ours = triton_extend.extend(
        q, pool, layout.block_tables, layout.query_start, layout.context_lens, layout.max_query_len, block_size,
        scale, window,
    )  # fmt: skip
    ref = reference_metadata(layout, block_size, window).attend(q.float(), held, scale)
    torch.testing.assert_close(ours.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_rope_and_kv_write_match_torch(dtype) -> None:
    """Same scales; values within one e4m3 step (x / s and x * (1 / s) may round apart at a tie)."""
    if DEVICE != "cuda":
        pytest.skip("the interpreter's float8 conversion halves values that round up to a power of two")
    q, k, v, positions, cos, sin, slots = _rope_inputs(dtype, seed=2, magnitude=3.0)
    kv_heads, dim = k.shape[1], k.shape[2]
    v[3] = 0.0  # an all-zero row: scale 0, values 0
    ref_pool = torch.zeros(16, kv_format.fp8_slot_bytes(kv_heads, dim), device=DEVICE, dtype=torch.uint8)
    ours_pool = ref_pool.clone()
    ops.set_fused(False)
    try:
        ops.rope_and_write_kv(q, k, v, positions, cos, sin, ref_pool, slots)
    finally:
        ops.set_fused(True)
    triton_ops.rope_and_write_kv(q, k, v, positions, cos, sin, ours_pool, slots)
    ref_values, ref_scales = kv_format.fp8_views(ref_pool, dim)
    ours_values, ours_scales = kv_format.fp8_views(ours_pool, dim)
    # bf16: the rotated k may differ by one bf16 ulp (as in the test above), and so its row maximum
    torch.testing.assert_close(ours_scales, ref_scales, atol=0, rtol=1e-6 if dtype == torch.float32 else 8e-3)
    assert float((ref_scales[slots[3], 1] == 0).float().min()) == 1.0
    a, b = ours_values.float(), ref_values.float()
    assert float((a == b).float().mean()) > (0.99 if dtype == torch.float32 else 0.9)
    a, b = a * ours_scales[..., None], b * ref_scales[..., None]  # the values held
    # one e4m3 step (1/8 of the value at most) plus what the bf16 RoPE inputs may differ by: the rounding of
    # its products, 2^-8 of the row's largest value (= 448 / 256 scales)
    slack = torch.maximum(a.abs(), b.abs()) * 0.14 + torch.maximum(ours_scales, ref_scales)[..., None] * 2
    assert float(((a - b).abs() - slack).max()) <= 0


@pytest.mark.parametrize("context", [300, 8192, 32768, 65536])
def test_decode_splits_over_long_contexts(context) -> None:
    """The split count a graph captures for batch 1 (the most), over contexts to 64K, bf16 and fp8."""
    if DEVICE != "cuda":
        pytest.skip("long contexts: CUDA only")
    rng = random.Random(context)
    torch.manual_seed(context)
    num_heads, num_kv_heads, head_dim, block_size = 32, 8, 128, 16
    splits = triton_attention.decode_splits(1, num_kv_heads)
    context_lens = [context, max(1, context // 3)]
    kv, layout = _paged_case(
        rng, block_size, num_kv_heads, head_dim, torch.bfloat16, [1, 1], context_lens
    )  # fmt: skip
    q = torch.randn(2, num_heads, head_dim, device=DEVICE).to(torch.bfloat16)
    scale = head_dim**-0.5
    ours = triton_attention.decode(q, kv, layout.block_tables, layout.context_lens, block_size, scale, splits)
    ref = reference_metadata(layout, block_size).attend(q.float(), kv.float(), scale)
    torch.testing.assert_close(ours.float(), ref, atol=2e-2, rtol=2e-2)
    pool, held = _fp8(kv.float())
    ours = triton_attention.decode(q, pool, layout.block_tables, layout.context_lens, block_size, scale, splits)
    ref = reference_metadata(layout, block_size).attend(q.float(), held, scale)
    torch.testing.assert_close(ours.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("context", [8192, 65536])
def test_extend_over_long_contexts(context) -> None:
    """A 512-token chunk at the end of a long context (the last chunk of a long prefill)."""
    if DEVICE != "cuda":
        pytest.skip("long contexts: CUDA only")
    rng = random.Random(context + 1)
    torch.manual_seed(context + 1)
    num_heads, num_kv_heads, head_dim, block_size = 32, 8, 128, 16
    query_lens, context_lens = [512, 1], [context, context // 2]
    kv, layout = _paged_case(rng, block_size, num_kv_heads, head_dim, torch.bfloat16, query_lens, context_lens)
    q = torch.randn(sum(query_lens), num_heads, head_dim, device=DEVICE).to(torch.bfloat16)
    scale = head_dim**-0.5
    ours = triton_extend.extend(
        q, kv, layout.block_tables, layout.query_start, layout.context_lens, layout.max_query_len, block_size, scale
    )  # fmt: skip
    ref = reference_metadata(layout, block_size).attend(q.float(), kv.float(), scale)
    torch.testing.assert_close(ours.float(), ref, atol=2e-2, rtol=2e-2)
