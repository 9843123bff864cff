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
from helpers import assert_greedy_matches, hf_greedy, make_core, record_last_layer_rows, run_all


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


@pytest.mark.parametrize("kind", ["llama", "mistral-window", "qwen3"])
def test_long_chunks_run_the_last_layer_on_their_sampled_rows_only(tiny_checkpoint, kind: str, monkeypatch) -> None:
    """Prefill chunks of 300 tokens (budget 300) beside other prompts' last chunks and decodes: a step with at least
    LAST_LAYER_MIN_SKIPPED rows that sample nothing runs its last layer past the K/V on the sampled rows alone (a
    step of chunks that sample nothing, on none). Greedy output equals transformers' generate."""
    from transformers import AutoModelForCausalLM

    directory = tiny_checkpoint(kind)
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    core = make_core(load_model(str(directory)), block_size=4, max_num_batched_tokens=300, max_model_len=512)
    seen = record_last_layer_rows(monkeypatch)  # the sampled rows of each step whose last layer skipped the rest
    rng = random.Random(3)
    prompts = [[rng.randrange(2, 256) for _ in range(n)] for n in (450, 380, 290, 20)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    results = run_all(core, prompts, params)
    for prompt, result in zip(prompts, results):
        assert_greedy_matches(core, hf, prompt, result["tokens"][0], hf_greedy(hf, prompt, 12))
    assert 0 in seen and any(n > 1 for n in seen), seen  # a step sampling nothing; one with several sequences


@pytest.mark.parametrize("kind", ["llama", "mistral-window"])
def test_last_layer_on_sampled_rows_gives_the_full_forwards_logits(tiny_checkpoint, kind: str) -> None:
    """One step mixing a decode, a chunk that samples nothing and a prompt's last chunk, over a pool of random
    K/V: the last layer on the sampled rows alone gives the logits of the full forward, and writes the same K/V;
    a step that samples nothing gives no logits and the same K/V."""
    from cbd.model.attention import layout_from_lists, sampled_layout

    core = make_core(load_model(str(tiny_checkpoint(kind))), block_size=4, max_model_len=512)
    runner = core.runner
    torch.manual_seed(0)
    pool = torch.randn_like(runner.kv_caches)
    query_lens, contexts = [1, 300, 150], [40, 300, 450]
    tables, next_block = [], 0
    for context in contexts:
        tables.append(list(range(next_block, next_block + -(-context // 4))))
        next_block += len(tables[-1])
    layout = layout_from_lists(query_lens, contexts, tables, 4)
    seq_of_row = torch.repeat_interleave(torch.arange(3), torch.tensor(query_lens))
    starts = layout.query_start
    positions = (
        torch.arange(sum(query_lens))
        - starts[seq_of_row]
        + (layout.context_lens - torch.tensor(query_lens))[seq_of_row]
    )
    ids = torch.randint(2, 256, (sum(query_lens),))
    model, backend = runner.model, runner.backend

    def forward(rows: torch.Tensor, sampled: bool) -> tuple[torch.Tensor, torch.Tensor]:
        kv = pool.clone()
        meta = backend.prepare(layout)
        rows_meta = (
            (backend.prepare(sampled_layout(layout, seq_of_row, rows)) if rows.numel() else meta) if sampled else None
        )
        with torch.inference_mode():
            return model(ids, positions, kv, meta, rows, rows_meta), kv

    rows = torch.tensor([0, sum(query_lens) - 1])  # the decode's row, the last chunk's last row
    full, full_kv = forward(rows, sampled=False)
    ours, ours_kv = forward(rows, sampled=True)
    torch.testing.assert_close(ours, full, rtol=1e-5, atol=1e-5)
    assert torch.equal(ours_kv, full_kv)
    none, none_kv = forward(torch.tensor([], dtype=torch.int64), sampled=True)
    assert none.shape == (0, full.shape[1]) and torch.equal(none_kv, full_kv)
