"""The embedded SmolLM2-135M-Instruct against transformers' own generate, plus text-level behaviour."""

from __future__ import annotations

from pathlib import Path

import pytest

from cbd.config import EngineConfig
from cbd.engine.detokenizer import IncrementalDetokenizer
from cbd.engine.engine import Engine
from cbd.engine.sampling_params import SamplingParams
from cbd.engine.sequence import FinishReason
from cbd.model.loader import load_model
from helpers import assert_greedy_matches, hf_greedy, make_core, poll_until, run_all

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain gravity to a child in two sentences.",
    "Translate 'good morning' into Spanish and German.",
    "What is 17 times 23?",
    "Give me a Python function that reverses a string.",
    "Who wrote Romeo and Juliet, and when?",
]
NEW_TOKENS = 32


def chat(tokenizer, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]


@pytest.fixture(scope="module")
def chat_prompts(default_model) -> list[list[int]]:
    return [chat(default_model.tokenizer, q) for q in QUESTIONS]


@pytest.fixture(scope="module")
def hf_outputs(default_hf, chat_prompts) -> list[list[int]]:
    return [hf_greedy(default_hf, p, NEW_TOKENS) for p in chat_prompts]


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def test_greedy_one_at_a_time_equals_transformers(default_model, default_hf, chat_prompts, hf_outputs) -> None:
    core = make_core(default_model)
    for prompt, expected in zip(chat_prompts, hf_outputs):
        ours = run_all(core, [prompt], GREEDY)[0]["tokens"][0]
        assert_greedy_matches(core, default_hf, prompt, ours, expected)


def test_greedy_all_in_one_batch_equals_transformers(default_model, default_hf, chat_prompts, hf_outputs) -> None:
    core = make_core(default_model)
    results = run_all(core, chat_prompts, GREEDY)
    for prompt, result, expected in zip(chat_prompts, results, hf_outputs):
        assert_greedy_matches(core, default_hf, prompt, result["tokens"][0], expected)
    assert core.block_manager.num_used_blocks == 0


def test_packed_gemm_default_engine_agrees_up_to_near_ties(chat_prompts, hf_outputs) -> None:
    """The serving default (oneDNN-packed GEMMs) differs from BLAS in the last bits of the logits."""
    packed = load_model(None, pack_cpu_gemm=True)
    core = make_core(packed)
    results = run_all(core, chat_prompts, GREEDY)
    agree = sum(r["tokens"][0] == e for r, e in zip(results, hf_outputs))
    assert agree >= len(chat_prompts) - 1, f"only {agree}/{len(chat_prompts)} identical"


def test_greedy_answer_mentions_paris_and_stops_at_eos(default_model, chat_prompts) -> None:
    result = run_all(make_core(default_model), [chat_prompts[0]], SamplingParams(max_tokens=64, temperature=0.0))[0]
    assert "Paris" in result["text"][0]
    assert result["finish"][0] is FinishReason.STOP
    assert result["tokens"][0][-1] in default_model.eos_token_ids


def test_stop_string_across_tokens_is_cut_and_never_streamed(default_model, chat_prompts) -> None:
    free = run_all(make_core(default_model), [chat_prompts[1]], GREEDY)[0]["text"][0]
    stop = free[10:16]  # a piece that almost surely spans token boundaries
    assert stop and stop in free
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, stop=(stop,))
    result = run_all(make_core(default_model), [chat_prompts[1]], params)[0]
    assert result["text"][0] == free[: free.index(stop)]
    assert result["finish"][0] is FinishReason.STOP
    streamed = [d.text for out in result["outputs"] for d in out.candidates]
    assert all(stop not in "".join(streamed[: i + 1]) for i in range(len(streamed)))


def test_incremental_detokenizer_handles_multibyte_characters(default_model) -> None:
    tok = default_model.tokenizer
    text = "Café ☕ — naïve 日本語 🎉 done"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(i) for i in ids]
    assert "".join(pieces) == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


def test_threaded_engine_streams_aborts_and_reports_stats(default_model, chat_prompts) -> None:
    engine = Engine(EngineConfig(num_kv_blocks=256), loaded=default_model)
    try:
        done = engine.generate(chat_prompts[:3], GREEDY)
        assert [c.candidates[0].finish_reason for c in done] == [FinishReason.LENGTH] * 3
        stream = engine.stream(chat_prompts[3], SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
        outputs = iter(stream)
        next(outputs)
        engine.abort(stream.request_id)
        last = list(outputs)[-1]
        assert last.finished and last.candidates[-1].finish_reason is FinishReason.ABORT
        assert last.usage.completion_tokens < 400
        stats = engine.stats()
        assert stats.num_running == 0 and stats.num_blocks_used == 0
        fan = engine.generate([chat_prompts[0]], SamplingParams(max_tokens=8, temperature=0.9, seed=3, n=4))[0]
        assert len(fan.candidates) == 4 and fan.usage.completion_tokens == sum(len(c.token_ids) for c in fan.candidates)
    finally:
        engine.shutdown()


def test_converted_checkpoint_is_cached_and_reused(default_model, monkeypatch) -> None:
    from cbd.model import loader
    from cbd.model.loader import resolve_checkpoint

    directory = default_model.checkpoint_dir
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (directory / name).exists(), name
    # No half-written entries left behind (another test worker's conversion, started as this one's, ends too).
    poll_until(lambda: not list(directory.parent.glob(".convert-*")), 300, what="no .convert-* entry")
    weights = (directory / "model.safetensors").stat().st_mtime_ns

    def no_second_conversion(name: str) -> None:  # a conversion starts by reporting its progress
        raise AssertionError(f"{name} converted again")

    monkeypatch.setattr(loader, "_Progress", no_second_conversion)
    assert resolve_checkpoint(None) == directory
    assert (directory / "model.safetensors").stat().st_mtime_ns == weights


def test_a_conversion_that_loses_the_race_uses_the_winners_entry(tmp_path, monkeypatch) -> None:
    """Two daemons starting at once on an empty cache both convert; the second to finish finds the first's
    entry in place (os.replace cannot replace a full directory) and uses it instead of failing to start."""
    import os

    import transformers

    from cbd.model import loader

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    cache = tmp_path / "cache"

    class Fake:
        def save_pretrained(self, directory: Path) -> None:
            (directory / "tokenizer.json").write_text("{}")

    def replace_after_the_winner(src: Path, dst: Path) -> None:
        dst.mkdir()  # the other process's conversion lands first
        (dst / "config.json").write_text('{"winner": true}')
        os.replace(src, dst)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: Fake())
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: Fake())
    monkeypatch.setattr(loader, "_save_plain", lambda model, directory: (directory / "config.json").write_text("{}"))
    monkeypatch.setattr(loader.os, "replace", replace_after_the_winner)
    target = loader.convert_gguf(gguf, cache)
    assert (target / "config.json").read_text() == '{"winner": true}'
    assert [p.name for p in cache.iterdir()] == [target.name]  # the loser's temporary directory is removed
