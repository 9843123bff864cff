"""CUDA checks, run on the accelerator machine (skipped where no GPU is present)."""

from __future__ import annotations

import random

import pytest
import torch

from cbd.engine.sampling_params import SamplingParams
from cbd.model.loader import load_model
from conftest import make_core
from helpers import assert_greedy_matches, run_all

pytestmark = pytest.mark.gpu


def _prompts(count: int) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(2, 256) for _ in range(rng.randrange(4, 60))] for _ in range(count)]


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mistral-window"])
def test_fp32_on_cuda_matches_transformers_on_cuda(tiny_checkpoint, kind: str) -> None:
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    directory = tiny_checkpoint(kind)
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).cuda().eval()
    core = make_core(load_model(str(directory), device="cuda"), block_size=8, max_num_batched_tokens=96)
    prompts = _prompts(8)
    results = run_all(core, prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        ours = result["tokens"][0]
        theirs = _hf_cuda(hf, prompt, 24)
        assert_greedy_matches(core, _CpuView(hf), prompt, ours, theirs)


def _hf_cuda(hf, prompt: list[int], n: int) -> list[int]:  # type: ignore[no-untyped-def]
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=0, eos_token_id=None)  # fmt: skip
    return out[0, len(prompt) :].tolist()


class _CpuView:
    """Lets helpers.hf_top2_gap feed CPU tensors to a CUDA model."""

    def __init__(self, model) -> None:  # type: ignore[no-untyped-def]
        self.model = model

    def __call__(self, ids: torch.Tensor):  # type: ignore[no-untyped-def]
        return self.model(ids.cuda())


def test_seeded_sampling_is_identical_on_cpu_and_cuda(tiny_checkpoint) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    directory = str(tiny_checkpoint("llama"))
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=11, n=3, ignore_eos=True)
    prompt = _prompts(1)[0]
    cpu = run_all(make_core(load_model(directory)), [prompt], params)[0]["tokens"]
    gpu = run_all(make_core(load_model(directory, device="cuda")), [prompt], params)[0]["tokens"]
    assert cpu == gpu


def test_bf16_on_cuda_runs_a_mixed_batch_and_frees_everything(tiny_checkpoint) -> None:
    loaded = load_model(str(tiny_checkpoint("qwen2")), device="cuda", dtype=torch.bfloat16)
    core = make_core(loaded, num_kv_blocks=24, block_size=4)  # small pool: forces preemption
    prompts = _prompts(10)
    params = [SamplingParams(max_tokens=30, temperature=0.0 if i % 2 else 0.7, seed=i, n=1 + i % 3, ignore_eos=True) for i in range(10)]
    results = run_all(core, prompts, params)
    assert all(len(r["tokens"]) == p.n and all(len(t) == 30 for t in r["tokens"].values()) for r, p in zip(results, params))
    assert core.scheduler.num_preemptions > 0 and core.block_manager.num_used_blocks == 0
