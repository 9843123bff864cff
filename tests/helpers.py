"""Test helpers: build an EngineCore, step it with the block manager's invariants checked after every
step, drive it to completion, and compare greedy outputs with transformers; how many examples a fuzz test
draws; waiting for a condition with a bound (never sleep-then-assert)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from cbd.config import EngineConfig
from cbd.engine.core import EngineCore
from cbd.engine.device.cuda_graphs import DecodeGraphs
from cbd.engine.outputs import RequestOutput
from cbd.engine.sampling_params import SamplingParams
from cbd.model.loader import LoadedModel

NEAR_TIE = 1e-4
T = TypeVar("T")
# CI (CI=true, as .ci/run is run) keeps the fuzz tests' thorough counts; a local run draws fewer by default.
THOROUGH = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def fuzz_examples(variable: str, thorough: int, quick: int) -> int:
    """A fuzz test's example count: the environment variable `variable` if set, else `thorough` in CI and
    `quick` elsewhere (the tests derandomize hypothesis: a count always draws the same examples)."""
    value = os.environ.get(variable)
    return int(value) if value else thorough if THOROUGH else quick


def make_core(loaded: LoadedModel, **overrides) -> EngineCore:
    return EngineCore(loaded, EngineConfig(**{"num_kv_blocks": 256, **overrides}))


def eager_graphs(core: EngineCore, batch: int) -> DecodeGraphs:
    """The engine's CUDA graphs' layout (batch buckets up to `batch`, verifying graphs included) run eagerly,
    so that a CPU test steps through the graphs' packing and forward; installed on the core's runner."""
    runner = core.runner
    runner.graphs = DecodeGraphs(
        runner.model, runner.kv_caches, runner.backend, runner.block_size, batch, runner.max_blocks_per_seq,
        runner.scratch_block, None, batch, core.config.num_speculative_tokens + 1,
    )  # fmt: skip
    return runner.graphs


def checked_step(core: EngineCore) -> list[RequestOutput]:
    """One engine step, then the KV accounting's invariants (ref counts, free list, hash table, holders)."""
    outputs = core.step()
    core.check_integrity()
    return outputs


def run_all(core: EngineCore, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[dict]:
    """Submit every prompt, step until done; per request: candidates' tokens/text/finish and usage."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    ids = [core.add_request(p, sp).request_id for p, sp in zip(prompts, plist)]
    results = {rid: {"tokens": {}, "text": {}, "finish": {}, "usage": None, "outputs": []} for rid in ids}
    steps = 0
    while core.has_work():
        for out in checked_step(core):
            collect(results[out.request_id], out)
        steps += 1
        assert steps < 100_000, "engine made no progress"
    return [results[rid] for rid in ids]


def collect(result: dict, out: RequestOutput) -> None:
    result["outputs"].append(out)
    for d in out.candidates:
        result["tokens"].setdefault(d.index, []).extend(d.token_ids)
        result["text"][d.index] = result["text"].get(d.index, "") + d.text
        if d.finish_reason is not None:
            result["finish"][d.index] = d.finish_reason
    if out.finished:
        result["usage"] = out.usage


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
            pad_token_id=0, eos_token_id=None,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def hf_top2_gap(hf_model, ids: list[int]) -> float:
    with torch.inference_mode():
        logits = hf_model(torch.tensor([ids])).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def our_top2_gap(core: EngineCore, ids: list[int]) -> float:
    result = run_all(core, [ids], SamplingParams(max_tokens=1, temperature=0.0, logprobs=2, ignore_eos=True))[0]
    top = result["outputs"][-1].candidates[0].logprobs[0].top
    return top[0][1] - top[1][1]  # log-softmax gaps equal logit gaps


BF16_NEAR_TIE = 0.05  # logits of a bf16 forward differ by a few 1e-3 between two kernels of one operation


def assert_bf16_engines_agree(cores: dict[str, EngineCore], prompts: list[list[int]], max_tokens: int = 24) -> None:
    """Two engines over the same bf16 weights that differ in a kernel: each prompt's greedy tokens equal, or the
    first divergence a near-tie under both; at least half the prompts token-exact."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    (name_a, core_a), (name_b, core_b) = cores.items()
    results_a, results_b = run_all(core_a, prompts, params), run_all(core_b, prompts, params)
    exact = 0
    for i, prompt in enumerate(prompts):
        a, b = results_a[i]["tokens"][0], results_b[i]["tokens"][0]
        exact += a == b
        for j, (x, y) in enumerate(zip(a, b)):
            if x != y:
                gaps = [our_top2_gap(core, prompt + b[:j]) for core in (core_a, core_b)]
                assert max(gaps) < BF16_NEAR_TIE, (
                    f"prompt {i} diverged at token {j}: {name_a} {x} vs {name_b} {y}, gaps {gaps}"
                )
                break
    assert exact >= len(prompts) // 2, exact


def assert_greedy_matches(core: EngineCore, hf_model, prompt: list[int], ours: list[int], theirs: list[int]) -> None:
    """Token-exact, or the first divergence is a near-tie in both implementations (then nothing later is compared)."""
    assert len(ours) == len(theirs), (len(ours), len(theirs))
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a == b:
            continue
        prefix = prompt + theirs[:i]
        hf_gap, our_gap = hf_top2_gap(hf_model, prefix), our_top2_gap(core, prefix)
        assert hf_gap < NEAR_TIE and our_gap < NEAR_TIE, (
            f"diverged at new token {i}: ours {a} vs transformers {b}, top-2 gaps {our_gap:.2e} / {hf_gap:.2e}"
        )
        return


def poll_until(condition: Callable[[], T | None], timeout: float = 30.0, every: float = 0.05, what: str = "") -> T:
    """The first truthy value of `condition()`, polled until `timeout` seconds have passed (then AssertionError
    naming `what`): the bound says how long a test may wait, not how fast the daemon must be."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"still not true after {timeout}s: {what}"
        time.sleep(every)


def record_last_layer_rows(monkeypatch) -> list[int]:  # noqa: ANN001
    """The sampled rows of each step whose last layer ran on them alone (runner.ModelRunner._sampled), recorded."""
    from cbd.engine.device import runner as runner_module

    seen: list[int] = []
    original = runner_module.ModelRunner._sampled

    def recording(self, layout, seq_of_row, rows, step):  # type: ignore[no-untyped-def]
        sampled = original(self, layout, seq_of_row, rows, step)
        if sampled is not None:
            seen.append(rows.shape[0])
        return sampled

    monkeypatch.setattr(runner_module.ModelRunner, "_sampled", recording)
    return seen
