"""Every supported architecture, random weights: greedy output equals transformers' generate."""

from __future__ import annotations

import json
import random

import pytest
import torch

from cbd.engine.sampling_params import SamplingParams
from cbd.errors import UnsupportedModel
from cbd.model.loader import load_model
from conftest import TINY_CONFIGS
from helpers import assert_greedy_matches, hf_greedy, make_core, run_all


def _prompts(count: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 256) for _ in range(rng.randrange(3, 40))] for _ in range(count)]


@pytest.mark.parametrize("kind", sorted(TINY_CONFIGS))
def test_greedy_matches_transformers(tiny_checkpoint, kind: str) -> None:
    from transformers import AutoModelForCausalLM

    directory = tiny_checkpoint(kind)
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    core = make_core(load_model(str(directory)), block_size=4, max_num_batched_tokens=64)
    prompts = _prompts(6)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    results = run_all(core, prompts, params)  # all in one batch, with chunked prefill (budget 64)
    for prompt, result in zip(prompts, results):
        assert_greedy_matches(core, hf, prompt, result["tokens"][0], hf_greedy(hf, prompt, 24))
    assert core.block_manager.num_used_blocks == 0


def test_tied_embeddings_share_one_tensor(tiny_checkpoint) -> None:
    loaded = load_model(str(tiny_checkpoint("llama", tie=True)))
    assert loaded.model.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


def test_unsupported_architecture_is_refused_by_name(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(UnsupportedModel, match="'gpt2' is not supported.*llama.*mistral.*qwen2.*qwen3"):
        load_model(str(tmp_path))


def test_missing_model_path_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="neither a checkpoint directory nor a .gguf file"):
        load_model(str(tmp_path / "nope"))


def test_model_from_live_hf_model_equals_checkpoint_load(tiny_checkpoint) -> None:
    from transformers import AutoModelForCausalLM

    from cbd.model.loader import load_model, model_from_hf

    directory = tiny_checkpoint("qwen2")
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    live = model_from_hf(hf, "cpu", torch.float32)
    saved = load_model(str(directory))
    for (name, a), (_, b) in zip(live.model.state_dict().items(), saved.model.state_dict().items()):
        assert torch.equal(a, b), name
