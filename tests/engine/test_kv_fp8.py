"""The FP8 KV cache (kv_cache_dtype="fp8"): the format's error bound, quality against the float cache
on the default model and the tiny models (the bounds README.md documents), and the engine's
features on it: capacity, prefix cache, fan-out, sessions and the host tier."""

from __future__ import annotations

import dataclasses
import inspect
import json.decoder
import random

import pytest
import torch
from test_kv_tiers import _play, _scripts

from cbd.engine.sampling_params import SamplingParams
from cbd.model import kv_format, kv_quality
from cbd.model.loader import load_model
from conftest import TINY_CONFIGS
from helpers import make_core, run_all

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_each_value_is_within_one_rounding_of_e4m3_and_scales_are_row_maxima() -> None:
    torch.manual_seed(0)
    kv = torch.randn(64, 2, 3, 32) * torch.logspace(-3, 3, 64)[:, None, None, None]
    kv[5, 1, 2] = 0.0  # a zero row: scale 0, values 0
    kv[7, 0, 0, 3] = 1e4  # an outlier only crushes its own row
    pool = kv_format.quantize(kv)
    assert pool.shape == (64, kv_format.fp8_slot_bytes(3, 32)) and pool.dtype == torch.uint8
    _, scales = kv_format.fp8_views(pool, 32)
    torch.testing.assert_close(scales, kv.abs().amax(-1) / kv_format.FP8_MAX, atol=0, rtol=0)
    back = kv_format.dequantize(pool, 32, torch.float32)
    # e4m3 keeps 3 mantissa bits: half a step is 1/16 of the value; below 2^-6 (subnormals) the step is 2^-9.
    bound = kv.abs() / 16 + scales[..., None] * 2**-10
    assert bool(((back - kv).abs() <= bound * (1 + 1e-6)).all())
    assert bool((back[5, 1, 2] == 0).all())
    torch.testing.assert_close(back[8], kv[8], rtol=1 / 16, atol=0)


def _text_tokens(loaded, count: int) -> list[int]:
    ids = loaded.tokenizer(inspect.getsource(json.decoder))["input_ids"]
    assert len(ids) >= count
    return ids[:count]


def test_default_model_quality_bound(default_model) -> None:
    """Teacher-forced over 2048 tokens of Python source: next-token argmax and distribution against fp32."""
    quality = kv_quality.measure(default_model.model, _text_tokens(default_model, 2048))
    assert quality.positions == 2048
    assert quality.top1_agreement >= 0.90 and quality.mean_kl <= 0.02, quality


@pytest.mark.parametrize("kind", sorted(TINY_CONFIGS))
def test_tiny_models_quality_bound(tiny_checkpoint, kind: str) -> None:
    """Random weights give near-flat distributions whose argmax flips easily: a looser bound."""
    model = load_model(str(tiny_checkpoint(kind))).model
    rng = random.Random(0)
    quality = kv_quality.measure(model, [rng.randrange(2, 256) for _ in range(500)], chunk=64)
    assert quality.top1_agreement >= 0.70 and quality.mean_kl <= 0.15, quality


def test_the_same_memory_holds_more_blocks(default_model) -> None:
    auto = make_core(default_model, num_kv_blocks=None, kv_cache_gib=0.05, cuda_graphs=False)
    fp8 = make_core(default_model, num_kv_blocks=None, kv_cache_gib=0.05, kv_cache_dtype="fp8", cuda_graphs=False)
    # fp32 and head_dim 64 here: 2 * 64 + 8 bytes per head and token against 2 * 64 * 4 (bf16 at 128: 1.94x)
    assert fp8.block_manager.num_blocks / auto.block_manager.num_blocks == pytest.approx(512 / 136, rel=1e-2)
    assert fp8.runner.kv_caches.dtype == torch.uint8
    assert fp8.runner.kv_caches.numel() <= auto.runner.kv_caches.numel() * 4 * (1 + 1e-3)


def test_prefix_cache_and_fan_out_on_fp8_give_the_uncached_answers(tiny_loaded) -> None:
    rng = random.Random(3)
    shared = [rng.randrange(2, 256) for _ in range(23)]
    prompts = [shared + [rng.randrange(2, 256) for _ in range(rng.randrange(1, 9))] for _ in range(5)]
    cached = run_all(make_core(tiny_loaded, block_size=4, kv_cache_dtype="fp8"), prompts, GREEDY)
    plain = run_all(
        make_core(tiny_loaded, block_size=4, kv_cache_dtype="fp8", enable_prefix_caching=False), prompts, GREEDY
    )  # fmt: skip
    assert [r["tokens"] for r in cached] == [r["tokens"] for r in plain]
    assert sum(r["usage"].cached_prompt_tokens for r in cached) > 0
    fan = run_all(
        make_core(tiny_loaded, block_size=4, kv_cache_dtype="fp8"), prompts[:1], dataclasses.replace(GREEDY, n=4)
    )
    assert list(fan[0]["tokens"].values()) == [plain[0]["tokens"][0]] * 4


def test_sessions_and_the_host_tier_on_fp8_keep_every_answer(tiny_loaded) -> None:
    """Offloaded FP8 blocks come back byte for byte: the same answers as a pool that holds every session."""
    scripts = _scripts(13)
    want, ideal = _play(make_core(tiny_loaded, block_size=4, num_kv_blocks=512, num_host_kv_blocks=0,
                                  kv_cache_dtype="fp8"), scripts)  # fmt: skip
    tiered = make_core(tiny_loaded, block_size=4, num_kv_blocks=40, num_host_kv_blocks=400, kv_cache_dtype="fp8")
    got, computed = _play(tiered, scripts)
    assert got == want and computed == ideal
    assert tiered.host_tier is not None and tiered.host_tier.num_restored_blocks > 0


def test_a_session_and_its_fork_on_fp8_equal_stateless_fp8_runs(tiny_loaded) -> None:
    """Each token's FP8 bytes depend on that token alone: KV kept across turns and shared by a fork gives what a
    fresh prefill of the whole history gives."""
    from test_sessions import _turn

    def stateless(history: list[int]) -> list[int]:
        core = make_core(tiny_loaded, block_size=4, enable_prefix_caching=False, kv_cache_dtype="fp8")
        return run_all(core, [history], GREEDY)[0]["tokens"][0]

    core = make_core(tiny_loaded, block_size=4, kv_cache_dtype="fp8")
    trunk = core.sessions.open()
    base = [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    reply = _turn(core, trunk.session_id, base, GREEDY)["tokens"][0]
    branch = core.sessions.fork(trunk.session_id)
    a = _turn(core, trunk.session_id, [40, 41, 42], GREEDY)["tokens"][0]
    b = _turn(core, branch.session_id, [50, 51], GREEDY)["tokens"][0]
    assert a == stateless(base + reply + [40, 41, 42])
    assert b == stateless(base + reply + [50, 51])
    for s in (trunk, branch):
        core.sessions.close(s.session_id)
    assert core.block_manager.num_used_blocks == 0


def test_through_the_daemon_the_flag_is_reported_and_serves(tiny_daemon, tiny_loaded) -> None:
    from cbd_client import Client

    d = tiny_daemon("--kv-cache-dtype", "fp8", "--kv-cache-gib", "0.01")
    prompt = [5, 6, 7, 8, 9]
    want = run_all(make_core(tiny_loaded, kv_cache_dtype="fp8", block_size=8), [prompt], GREEDY)[0]["tokens"][0]
    with Client(d.address, timeout=60) as client:
        info = client.model_info()
        assert info.kv_cache_dtype == "fp8" and info.dtype == "float32"
        reply = client.generate(prompt, max_tokens=12, temperature=0, ignore_eos=True)
    assert reply.candidates[0].token_ids == want
    spec = tiny_loaded.spec  # 0.01 GiB of 8-token blocks: fp8 slots are 2 * D + 8 bytes per KV head
    per_block = spec.num_layers * 8 * kv_format.fp8_slot_bytes(spec.num_kv_heads, spec.head_dim)
    assert info.num_kv_blocks == int(0.01 * 2**30) // per_block
