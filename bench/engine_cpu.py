"""Engine throughput: cbd vs transformers generate_batch vs transformers static-batch generate.

One process, the default model, the same 32 chat prompts and 64 greedy new tokens (EOS ignored) for
all. Prints tok/s for each (median of --rounds timed rounds; generate_batch, the slowest, runs once)
and cbd's ratios against each peer.

    python bench/engine_cpu.py [--prompts 32] [--new-tokens 64] [--rounds 3] [--device cpu]
"""

from __future__ import annotations

import argparse
import logging
import platform
import statistics
import time

import torch

from cbd.config import EngineConfig
from cbd.engine.engine import Engine
from cbd.engine.sampling_params import SamplingParams

log = logging.getLogger("bench")
TOPICS = [
    "the capital of France", "how rainbows form", "a haiku about autumn", "prime numbers", "the water cycle",
    "why the sky is blue", "how to boil an egg", "the moon landing", "photosynthesis", "a short poem about cats",
    "the rules of chess", "what a CPU does", "the history of Rome", "how vaccines work", "black holes",
    "tips for better sleep", "the French revolution", "how to learn a language", "what DNA is", "volcanoes",
    "how airplanes fly", "the Pythagorean theorem", "recycling", "the stock market", "a limerick about a dog",
    "the speed of light", "how bees make honey", "the Great Wall of China", "machine learning", "tea vs coffee",
    "the planets of the solar system", "how a bicycle works",
]


def chat_prompts(tokenizer, count: int, topics: list[str] = TOPICS) -> list[list[int]]:
    prompts = []
    for i in range(count):
        messages = [{"role": "user", "content": f"Tell me about {topics[i % len(topics)]}."}]
        prompts.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])
    return prompts


def bench_cbd(
    engine: Engine, prompts: list[list[int]], new_tokens: int, rounds: int, warm: list[list[int]]
) -> tuple[float, list[list[int]]]:
    """Median tok/s over rounds; the prefix cache is reset before each, then warmed on the `warm` prompts."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    speeds = []
    for _ in range(rounds):
        engine.reset_prefix_cache()
        # Only what any earlier request would leave behind (the chat template's shared system
        # prompt) is in the prefix cache when the clock starts.
        engine.generate(warm, SamplingParams(max_tokens=4, temperature=0.0))
        start = time.perf_counter()
        results = engine.generate(prompts, params)
        elapsed = time.perf_counter() - start
        outputs = [r.candidates[0].token_ids for r in results]
        speeds.append(sum(map(len, outputs)) / elapsed)
    log.info("%s rounds: %s", engine.config, ", ".join(f"{x:.1f}" for x in speeds))
    return statistics.median(speeds), outputs


def bench_static(hf, tokenizer, prompts: list[list[int]], new_tokens: int, device, rounds: int) -> tuple[float, list[list[int]]]:
    tokenizer.padding_side = "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    kwargs = dict(do_sample=False, pad_token_id=pad, min_new_tokens=new_tokens, max_new_tokens=new_tokens)
    hf.generate(ids[:2], attention_mask=mask[:2], **{**kwargs, "min_new_tokens": 4, "max_new_tokens": 4})
    speeds = []
    for _ in range(rounds):
        start = time.perf_counter()
        out = hf.generate(ids, attention_mask=mask, **kwargs)
        elapsed = time.perf_counter() - start
        outputs = out[:, width:].tolist()
        speeds.append(sum(map(len, outputs)) / elapsed)
    return statistics.median(speeds), outputs


def bench_generate_batch(hf, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1)
    start = time.perf_counter()
    results = hf.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
    elapsed = time.perf_counter() - start
    outputs = [r.generated_tokens for r in results.values()]
    return sum(map(len, outputs)) / elapsed, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per engine (median reported)")
    parser.add_argument("--skip-generate-batch", action="store_true", help="skip the slowest peer (one round)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    log.setLevel(logging.INFO)
    from transformers import AutoModelForCausalLM

    # One engine at a time, each shut down before the next model loads: every thread that runs torch
    # work gets its own OpenMP team, and teams that outnumber the cores slow each other down.
    engine = Engine(EngineConfig(device=args.device))
    tokenizer = engine.loaded.tokenizer
    checkpoint = engine.loaded.checkpoint_dir
    prompts = chat_prompts(tokenizer, args.prompts)
    warm = chat_prompts(tokenizer, 1, topics=["the weather"])  # a prompt outside the measured set
    rows = []
    cbd_tps, cbd_out = bench_cbd(engine, prompts, args.new_tokens, args.rounds, warm)
    engine.shutdown()
    del engine
    rows.append(("cbd engine", cbd_tps))
    exact = Engine(EngineConfig(device=args.device, cpu_packed_gemm=False))
    exact_tps, _ = bench_cbd(exact, prompts, args.new_tokens, args.rounds, warm)
    exact.shutdown()
    del exact
    rows.append(("cbd engine, plain BLAS GEMMs (no packing)", exact_tps))
    no_cache = Engine(EngineConfig(device=args.device, enable_prefix_caching=False))
    no_cache_tps, _ = bench_cbd(no_cache, prompts, args.new_tokens, args.rounds, warm)
    no_cache.shutdown()
    del no_cache
    rows.append(("cbd engine, prefix caching off", no_cache_tps))

    dtype = EngineConfig(device=args.device).torch_dtype()
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).to(args.device).eval()
    static_tps, static_out = bench_static(hf, tokenizer, prompts, args.new_tokens, args.device, args.rounds)
    rows.append(("transformers generate (static batch)", static_tps))
    if not args.skip_generate_batch:
        gb_tps, _ = bench_generate_batch(hf, prompts, args.new_tokens)
        rows.append(("transformers generate_batch", gb_tps))

    same = sum(a == b for a, b in zip(cbd_out, static_out))
    print(f"\nmachine: {platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"device {args.device}; {args.prompts} prompts x {args.new_tokens} greedy new tokens (EOS ignored); "
          f"median of {args.rounds} rounds (generate_batch: 1 round)")
    print(f"greedy outputs identical to static generate: {same}/{len(prompts)}")
    print(f"{'engine':40s} {'tok/s':>10s} {'cbd ratio':>10s}")
    for name, tps in rows:
        print(f"{name:40s} {tps:10.1f} {cbd_tps / tps:9.2f}x")


if __name__ == "__main__":
    main()
