"""Engine throughput: cbd vs transformers generate_batch vs transformers static-batch generate.

The default model, the same 32 chat prompts and 64 greedy new tokens (EOS ignored) for all. Each
round of each engine runs in a fresh process, in rotating order; prints each engine's median tok/s
over --rounds rounds (generate_batch, the slowest, runs once) and cbd's ratio against each.

    python bench/engine_cpu.py [--prompts 32] [--new-tokens 64] [--rounds 3] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

from cbd.config import EngineConfig
from cbd.engine.engine import Engine
from cbd.engine.sampling_params import SamplingParams

log = logging.getLogger("bench")
TOPICS = [
    "the capital of France",
    "how rainbows form",
    "a haiku about autumn",
    "prime numbers",
    "the water cycle",
    "why the sky is blue",
    "how to boil an egg",
    "the moon landing",
    "photosynthesis",
    "a short poem about cats",
    "the rules of chess",
    "what a CPU does",
    "the history of Rome",
    "how vaccines work",
    "black holes",
    "tips for better sleep",
    "the French revolution",
    "how to learn a language",
    "what DNA is",
    "volcanoes",
    "how airplanes fly",
    "the Pythagorean theorem",
    "recycling",
    "the stock market",
    "a limerick about a dog",
    "the speed of light",
    "how bees make honey",
    "the Great Wall of China",
    "machine learning",
    "tea vs coffee",
    "the planets of the solar system",
    "how a bicycle works",
]


def chat_prompts(tokenizer, count: int, topics: list[str] = TOPICS) -> list[list[int]]:
    prompts = []
    for i in range(count):
        messages = [{"role": "user", "content": f"Tell me about {topics[i % len(topics)]}."}]
        prompts.append(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
        )
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
    return statistics.median(speeds), outputs


def bench_static(
    hf, tokenizer, prompts: list[list[int]], new_tokens: int, device, rounds: int
) -> tuple[float, list[list[int]]]:
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


WORKERS = {
    "cbd": ("cbd engine", dict()),
    "cbd-blas": ("cbd engine, plain BLAS GEMMs (no packing)", dict(cpu_packed_gemm=False)),
    "cbd-nocache": ("cbd engine, prefix caching off", dict(enable_prefix_caching=False)),
    "static": ("transformers generate (static batch)", None),
    "generate_batch": ("transformers generate_batch", None),
}


def worker(name: str, args: argparse.Namespace) -> dict:
    """One timed round of one engine, in a process of its own."""
    from transformers import AutoModelForCausalLM

    from cbd.model.loader import resolve_checkpoint

    checkpoint = resolve_checkpoint(None)
    if name.startswith("cbd"):
        engine = Engine(EngineConfig(device=args.device, **WORKERS[name][1]))
        tokenizer = engine.loaded.tokenizer
        prompts = chat_prompts(tokenizer, args.prompts)
        warm = chat_prompts(tokenizer, 1, topics=["the weather"])  # a prompt outside the measured set
        tps, outputs = bench_cbd(engine, prompts, args.new_tokens, 1, warm)
        engine.shutdown()
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        prompts = chat_prompts(tokenizer, args.prompts)
        hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).to(args.device).eval()
        if name == "static":
            tps, outputs = bench_static(hf, tokenizer, prompts, args.new_tokens, args.device, 1)
        else:
            tps, outputs = bench_generate_batch(hf, prompts, args.new_tokens)
    return {"tok_s": tps, "outputs": outputs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per engine (median reported)")
    parser.add_argument("--skip-generate-batch", action="store_true", help="skip the slowest peer (one round)")
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    log.setLevel(logging.INFO)
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args)))
        return

    # Every round of every engine runs in a fresh process (torch's OpenMP teams, allocator state and
    # prefix cache start clean), and the order rotates each round so that the machine's drift lands on
    # all engines alike.
    names = [n for n in WORKERS if n != "generate_batch"]
    speeds: dict[str, list[float]] = {n: [] for n in WORKERS}
    outputs: dict[str, list[list[int]]] = {}
    passthrough = ["--prompts", str(args.prompts), "--new-tokens", str(args.new_tokens), "--device", args.device]
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        if r == 0 and not args.skip_generate_batch:
            order.append("generate_batch")
        for name in order:
            done = subprocess.run(
                [sys.executable, __file__, "--worker", name, *passthrough], capture_output=True, text=True, check=True
            )
            result = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))[7:])
            speeds[name].append(result["tok_s"])
            outputs.setdefault(name, result["outputs"])
            log.info("round %d %-14s %.1f tok/s", r, name, result["tok_s"])

    cbd_tps = statistics.median(speeds["cbd"])
    same = sum(a == b for a, b in zip(outputs["cbd"], outputs["static"]))
    print(
        f"\nmachine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, device {args.device}; "
        f"{args.prompts} prompts x {args.new_tokens} greedy new tokens (EOS ignored)"
    )
    print(
        f"each engine: median of {args.rounds} rounds, one fresh process per round, order rotating "
        f"(generate_batch: 1 round)"
    )
    print(f"greedy outputs identical to static generate: {same}/{len(outputs['cbd'])}")
    print(f"{'engine':42s} {'tok/s':>8s} {'cbd ratio':>10s}   rounds")
    for name, (label, _) in WORKERS.items():
        if speeds[name]:
            tps = statistics.median(speeds[name])
            rounds = ", ".join(f"{x:.1f}" for x in speeds[name])
            print(f"{label:42s} {tps:8.1f} {cbd_tps / tps:9.2f}x   {rounds}")


if __name__ == "__main__":
    main()
