"""Tensor parallelism: 2 ranks (gloo processes on CPU, NCCL on GPUs) give the single-process greedy output."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from cbd.config import EngineConfig
from cbd.engine.engine import Engine
from cbd.engine.sampling_params import SamplingParams
from cbd.errors import UnsupportedModel
from cbd.model.loader import load_model
from cbd.model.spec import ModelSpec
from cbd.model.tensor_parallel import local_spec, shard_of, shard_tensor


def _prompts(count: int, vocab: int) -> list[list[int]]:
    rng = random.Random(9)
    return [[rng.randrange(2, vocab) for _ in range(rng.randrange(4, 40))] for _ in range(count)]


def _greedy(config: EngineConfig, prompts: list[list[int]]) -> list[list[int]]:
    engine = Engine(config)
    try:
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        return [c.candidates[0].token_ids for c in engine.generate(prompts, params)]
    finally:
        engine.shutdown()


def test_shards_cover_every_weight_once(tiny_checkpoint) -> None:
    """Column shards concatenate to the full rows, row shards to the full columns, uneven splits included."""
    tiny: ModelSpec = load_model(str(tiny_checkpoint("qwen2"))).spec  # 4 query / 2 KV heads
    with pytest.raises(UnsupportedModel, match="exceeds the model's 2 KV heads"):
        shard_of(tiny, 0, 3)
    # The tiny model splits evenly over 2 ranks; 4 KV heads (8 query heads) over 3 ranks split 2|1|1,
    # the MLP's 128 rows 43|43|42 and the 256-row vocabulary 86|86|84 (the last slice padded).
    wide = dataclasses.replace(tiny, num_heads=8, num_kv_heads=4)
    for spec, world in ((tiny, 2), (wide, 3)):
        shards = [shard_of(spec, r, world) for r in range(world)]
        if world == 3:
            assert [len(s.kv_heads) for s in shards] == [2, 1, 1]
            assert [len(s.inter) for s in shards] == [43, 43, 42]
        assert sum(len(s.kv_heads) for s in shards) == spec.num_kv_heads
        assert sum(local_spec(spec, s).intermediate_size for s in shards) == spec.intermediate_size
        full_q = torch.randn(spec.q_size, spec.hidden_size)
        parts = [shard_tensor("model.layers.0.self_attn.q_proj.weight", full_q, spec, s) for s in shards]
        assert torch.equal(torch.cat(parts), full_q)
        full_o = torch.randn(spec.hidden_size, spec.q_size)
        parts = [shard_tensor("model.layers.0.self_attn.o_proj.weight", full_o, spec, s) for s in shards]
        assert torch.equal(torch.cat(parts, dim=1), full_o)
        embed = torch.randn(spec.vocab_size, spec.hidden_size)
        parts = [shard_tensor("model.embed_tokens.weight", embed, spec, s) for s in shards]
        assert torch.equal(torch.cat(parts)[: spec.vocab_size], embed)


@pytest.mark.parametrize("kind,kv_cache_dtype", [("llama", "auto"), ("qwen2", "auto"), ("llama", "fp8")])
def test_two_gloo_ranks_equal_one_process_on_tiny_models(tiny_checkpoint, kind: str, kv_cache_dtype: str) -> None:
    directory = str(tiny_checkpoint(kind))
    prompts = _prompts(6, 256)
    base = dict(model=directory, device="cpu", num_kv_blocks=128, cpu_packed_gemm=False, kv_cache_dtype=kv_cache_dtype)
    single = _greedy(EngineConfig(**base), prompts)
    sharded = _greedy(EngineConfig(**base, tensor_parallel_size=2), prompts)
    assert sharded == single


@pytest.mark.slow
def test_two_gloo_ranks_equal_one_process_on_the_default_model() -> None:
    """SmolLM2: 9 query / 3 KV heads split 6|3 / 2|1 over two ranks."""
    prompts = _prompts(4, 49152)
    base = dict(device="cpu", num_kv_blocks=256, cpu_packed_gemm=False)
    single = _greedy(EngineConfig(**base), prompts)
    sharded = _greedy(EngineConfig(**base, tensor_parallel_size=2), prompts)
    same = sum(a == b for a, b in zip(single, sharded))
    assert same == len(prompts), (single, sharded)


@pytest.mark.gpu
def test_two_nccl_ranks_equal_one_gpu(tiny_checkpoint) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    directory = str(tiny_checkpoint("llama"))
    prompts = _prompts(8, 256)
    base = dict(model=directory, device="cuda", dtype="float32", num_kv_blocks=128, block_size=16)
    torch.backends.cuda.matmul.allow_tf32 = False
    single = _greedy(EngineConfig(**base), prompts)
    sharded = _greedy(EngineConfig(**base, tensor_parallel_size=2), prompts)
    assert sharded == single


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_two_gloo_ranks_sample_constrained_rows_like_one_process(tiny_checkpoint, overlap: str) -> None:
    """Workers get the token masks (a SampleStep after the step's RunStep, in both modes): a batch of
    constrained and unconstrained rows gives rank 0's tokens, equal to one process's."""
    import re

    from cbd.engine.grammar.matcher import GrammarCompiler, GrammarKind, GrammarSpec

    compiler = GrammarCompiler(None, 256, (1,), encoded_vocab=[bytes([i]) for i in range(256)])
    grammar = compiler.compile(GrammarSpec(GrammarKind.REGEX, "[a-z]{12}"))
    prompts = _prompts(4, 256)
    params = [SamplingParams(max_tokens=14, temperature=0.0, grammar=grammar if i % 2 else None, ignore_eos=i % 2 == 0)
              for i in range(4)]  # fmt: skip
    config = EngineConfig(model=str(tiny_checkpoint("llama")), num_kv_blocks=128, overlap=overlap)
    outputs = []
    for tp in (1, 2):
        engine = Engine(dataclasses.replace(config, tensor_parallel_size=tp))
        try:
            streams = [engine.stream(p, sp) for p, sp in zip(prompts, params)]
            outputs.append([s.result().candidates[0].token_ids for s in streams])
        finally:
            engine.shutdown()
    assert outputs[0] == outputs[1]
    for tokens in outputs[0][1::2]:
        assert re.fullmatch("[a-z]{12}", bytes(t for t in tokens if t != 1).decode())


def test_two_gloo_ranks_verify_drafts_like_one_process(tiny_checkpoint) -> None:
    """Speculative decoding over two ranks: every verifying step (1 + k rows per sequence) is run by both
    shards; the tokens equal one process's without speculation, and drafts were verified."""
    rng = random.Random(4)
    prompts = []
    for length in (3, 5, 7, 11):  # repeated motifs: the drafter finds n-grams
        motif = [rng.randrange(2, 256) for _ in range(length)]
        prompts.append(motif * (44 // length))
    base = dict(model=str(tiny_checkpoint("llama")), device="cpu", num_kv_blocks=128, cpu_packed_gemm=False)
    single = _greedy(EngineConfig(**base, speculative="off"), prompts)
    engine = Engine(EngineConfig(**base, speculative="ngram", tensor_parallel_size=2))
    try:
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        sharded = [c.candidates[0].token_ids for c in engine.generate(prompts, params)]
        speculation = engine.stats().speculation
    finally:
        engine.shutdown()
    assert sharded == single
    assert speculation is not None and speculation.num_draft_tokens > 0
