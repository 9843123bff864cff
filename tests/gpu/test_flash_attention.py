"""The FlashAttention-4 backend: its choice (CPU, always) and its results against Triton and the torch
reference (GPU with flash-attn-4, on the accelerator machine)."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from cbd.errors import UnsupportedModel
from cbd.model import flash_attention
from cbd.model.attention import layout_from_lists, reference_metadata, write_kv
from cbd.model.attention_backends import TorchBackend, TritonBackend, select_backend


def test_auto_on_cpu_is_the_torch_reference_and_says_why_not_flash(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="cbd.model.attention_backends"):
        backend = select_backend("auto", torch.device("cpu"), torch.float32, 8, None, 2, head_dim=16)
    assert isinstance(backend, TorchBackend)
    line = caplog.records[-1].getMessage()
    assert "attention backend: torch" in line and "chosen by auto" in line and "not FlashAttention-4" in line, line


def test_flash_where_it_cannot_run_is_a_configuration_error() -> None:
    with pytest.raises(UnsupportedModel, match="flash .*FlashAttention-4.* cannot run: it needs CUDA"):
        select_backend("flash", torch.device("cpu"), torch.bfloat16, 16, None, 2, head_dim=64)


@pytest.mark.skipif(flash_attention.installed(), reason="flash-attn-4 is installed here")
def test_without_the_package_load_says_how_to_install_it() -> None:
    reason = flash_attention.load()
    assert isinstance(reason, str) and "flash-attn-4" in reason and "cbd[flash]" in reason


def test_a_mixed_steps_leading_decodes_go_to_triton_and_the_rest_to_fa4() -> None:
    """Routing only (CPU): which metadata each step kind gets, and the FA4 half's shifted query starts."""
    from cbd.model.attention_backends import TritonMetadata

    backend = flash_attention.FlashBackend(4, None, 2, varlen=lambda *a, **k: None)
    tables = [[0, 1], [2, 3, 4], [5, 6], [7]]
    mixed = layout_from_lists([1, 1, 6, 1], [5, 9, 6, 3], tables, 4)
    assert mixed.num_decodes == 2
    meta = backend.prepare(mixed)
    assert isinstance(meta, flash_attention.SplitMetadata) and meta.num_decodes == 2
    assert isinstance(meta.decodes, TritonMetadata) and meta.decodes.layout.max_query_len == 1
    assert meta.rest.cu_seqlens_q.tolist() == [0, 6, 7] and meta.rest.seqused_k.tolist() == [6, 3]
    assert meta.rest.page_table.dtype == torch.int32 and meta.rest.page_table.shape == (2, 3)
    assert meta.slot_mapping is mixed.slot_mapping
    prefill = layout_from_lists([6, 1], [6, 3], [[5, 6], [7]], 4)
    assert prefill.num_decodes == 0 and isinstance(backend.prepare(prefill), flash_attention.FlashMetadata)
    decode = layout_from_lists([1, 1], [5, 3], [[0, 1], [7]], 4)
    assert isinstance(backend.prepare(decode, decode_splits=2), TritonMetadata)
    long = layout_from_lists([200], [300], [list(range(75))], 4)
    assert backend.prepare(long).pack_gqa is False and backend.prepare(prefill).pack_gqa is None


def _reference_varlen(q, k, v, *, cu_seqlens_q, seqused_k, page_table, softmax_scale, window_size, **_):  # type: ignore[no-untyped-def]
    """FA4's contract for batched keys (k, v: [B, C, Hkv, D], seqused_k), causal at the end of each row's keys,
    in plain torch: the stand-in that lets the CPU check what the gathered path hands FA4."""
    assert page_table is None and window_size == (None, None)
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[2]
    for b in range(k.shape[0]):
        rows = slice(int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]))
        n, c = rows.stop - rows.start, int(seqused_k[b])
        keys, values = (t[b, :c].repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))  # [H, c, D]
        scores = torch.einsum("qhd,hkd->hqk", q[rows], keys) * softmax_scale
        allowed = torch.arange(c)[None, :] <= torch.arange(c - n, c)[:, None]
        weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out[rows] = torch.einsum("hqk,hkd->qhd", weights, values)
    return out, None


def test_long_chunks_hand_fa4_their_keys_gathered_in_position_order() -> None:
    """CPU: the slots gathered for a step of long chunks (shuffled blocks, a context not a multiple of the block,
    a shorter sequence padded), and the step's attention through them equals the torch reference."""
    rng = random.Random(5)
    block_size, ctx = 4, [700, 530]
    free = list(range(sum(-(-c // block_size) for c in ctx) + 3))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-c // block_size))] for c in ctx]
    layout = layout_from_lists([600, 512], ctx, tables, block_size)
    backend = flash_attention.FlashBackend(block_size, None, 2, varlen=_reference_varlen, head_dim=16)
    meta = backend.prepare(layout)
    assert isinstance(meta, flash_attention.FlashMetadata) and meta.key_slots is not None
    for b, table in enumerate(tables):
        want = [table[p // block_size] * block_size + p % block_size for p in range(ctx[b])]
        assert meta.key_slots[b, : ctx[b]].tolist() == want and not meta.key_slots[b, ctx[b] :].any()
    kv = torch.randn(len(free) * 0 + (max(map(max, tables)) + 1) * block_size, 2, 2, 16)
    q = torch.randn(len(layout.slot_mapping), 4, 16)
    reference = reference_metadata(layout, block_size).attend(q, kv, 0.25)
    assert torch.allclose(meta.attend(q, kv, 0.25), reference, atol=1e-5)
    short = layout_from_lists([511, 1], [600, 9], [tables[0], tables[1]], block_size)
    assert backend.prepare(short).key_slots is None  # below GATHER_MIN_QUERIES: the pages in place
    longest = flash_attention.GATHER_MAX_BYTES // backend.key_bytes // 2 + 1  # two of them: one key too many
    wide = layout_from_lists([600] * 2, [longest] * 2, [list(range(-(-longest // block_size)))] * 2, block_size)
    assert backend.prepare(wide).key_slots is None  # a copy past GATHER_MAX_BYTES: the pages in place
    windowed = flash_attention.FlashBackend(block_size, 256, 2, varlen=_reference_varlen, head_dim=16)
    assert windowed.prepare(layout).key_slots is None  # a sliding window: the pages in place


def _fa4_usable() -> bool:
    return flash_attention.unusable_reason(torch.device("cuda"), torch.bfloat16, 128, False) is None


needs_flash = pytest.mark.skipif(
    not torch.cuda.is_available() or not _fa4_usable(), reason="needs CUDA (sm90+) and flash-attn-4"
)


def _random_step(
    rng: random.Random, runs: list[tuple[int, int]], heads: tuple[int, int], head_dim: int, block_size: int
) -> tuple:
    """A pool with every context written, shuffled block tables, and the step's queries (bf16 on CUDA)."""
    num_heads, num_kv_heads = heads
    ctx = [c for _, c in runs]
    num_blocks = sum(-(-c // block_size) for c in ctx) + 4
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-c // block_size))] for c in ctx]
    kv = torch.randn(num_blocks * block_size, 2, num_kv_heads, head_dim, device="cuda").to(torch.bfloat16)
    everything = layout_from_lists(ctx, ctx, tables, block_size, "cuda")  # every position, to fill the pool
    write_kv(kv, *torch.randn(2, len(everything.slot_mapping), num_kv_heads, head_dim, device="cuda")
             .to(torch.bfloat16).unbind(0), everything.slot_mapping)  # fmt: skip
    layout = layout_from_lists([q for q, _ in runs], ctx, tables, block_size, "cuda")
    q = torch.randn(len(layout.slot_mapping), num_heads, head_dim, device="cuda").to(torch.bfloat16)
    return layout, kv, q


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("heads, head_dim", [((32, 8), 128), ((9, 3), 64), ((4, 4), 128)])
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("runs", [
    [(1, 37), (1, 300), (5, 200), (300, 1000), (257, 257), (1, 1), (64, 700)],  # decodes, drafts, chunks
    [(2048, 2048 + 13)],  # one long chunk over a short prefix
    [(1, 300), (600, 3000), (512, 700)],  # a decode, then long chunks read from a gathered copy of their keys
], ids=["mixed", "long", "gathered"])  # fmt: skip
@pytest.mark.gpu
@needs_flash
def test_flash_equals_triton_and_the_reference(block_size, heads, head_dim, window, runs) -> None:
    if window is not None and runs[0][0] == 2048:
        pytest.skip("one windowed case is enough")
    gathered = runs[-1][0] >= flash_attention.GATHER_MIN_QUERIES and window is None
    rng = random.Random(block_size * 31 + head_dim + heads[0])
    torch.manual_seed(rng.randrange(1000))
    layout, kv, q = _random_step(rng, runs, heads, head_dim, block_size)
    scale = head_dim**-0.5
    flash = select_backend("flash", torch.device("cuda"), torch.bfloat16, block_size, window, heads[1],
                           head_dim=head_dim).prepare(layout)  # fmt: skip
    # leading decodes go to Triton's decode kernel, the rest to FA4
    assert isinstance(flash, flash_attention.SplitMetadata if runs[0][0] == 1 else flash_attention.FlashMetadata)
    fa4 = flash.rest if isinstance(flash, flash_attention.SplitMetadata) else flash
    assert (fa4.key_slots is not None) == gathered
    ours = flash.attend(q, kv, scale).float()
    triton = TritonBackend(block_size, window, heads[1]).prepare(layout).attend(q, kv, scale).float()
    reference = reference_metadata(layout, block_size, window).attend(q.float(), kv.float(), scale)
    assert ours.shape == q.shape and torch.isfinite(ours).all()
    assert (ours - reference).abs().max().item() < 2e-2
    assert (ours - triton).abs().max().item() < 3e-2


@pytest.mark.gpu
@needs_flash
def test_decode_steps_stay_on_triton() -> None:
    backend = select_backend("flash", torch.device("cuda"), torch.bfloat16, 16, None, 8, head_dim=128)
    layout = layout_from_lists([1, 1], [40, 9], [[0, 1, 2], [3]], 16, "cuda")
    splits = backend.decode_splits(2, 40)
    assert splits >= 1 and not isinstance(backend.prepare(layout, splits), flash_attention.FlashMetadata)
    assert backend.supports_cuda_graphs


@pytest.mark.gpu
@needs_flash
@pytest.mark.parametrize("kind", ["llama", "mistral-window"])
def test_engine_greedy_flash_equals_triton_in_bf16(tiny_checkpoint, kind: str) -> None:
    """bf16 (FA4 has no fp32): token-exact, or the first divergence is a near-tie under both backends."""
    from cbd.model.loader import load_model
    from helpers import assert_bf16_engines_agree, make_core

    loaded = load_model(str(tiny_checkpoint(kind)), device="cuda", dtype=torch.bfloat16)
    cores = {
        name: make_core(loaded, device="cuda", dtype="bfloat16", block_size=8, max_num_batched_tokens=96,
                        attention_backend=name, enable_prefix_caching=False)
        for name in ("flash", "triton")
    }  # fmt: skip
    assert cores["flash"].runner.backend.name == "flash"
    rng = random.Random(7)
    prompts = [[rng.randrange(2, 256) for _ in range(rng.randrange(4, 200))] for _ in range(8)]
    assert_bf16_engines_agree(cores, prompts)
