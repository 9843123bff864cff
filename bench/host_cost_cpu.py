"""The engine's host time per sequence per step, by phase, with a model too small to matter (CPU).

A 1-layer Llama with hidden size 64 and the default model's vocabulary (49152) and tokenizer: the forward
costs little, so what the engine thread spends per step is mostly its own Python work, the part that
grows with the batch (what bench/daemon_gpu.py sees on a GPU as CPU time per step). The threaded
engine as the daemon's engine process runs it (detokenising only for stop strings, one output callback
per request per step). Per batch size B: B prompts of --prompt-len random tokens, greedy, EOS ignored,
--new-tokens each, all at once; best of --rounds. Decode steps only: each round also runs fresh prompts
of the same length for 1 new token, and subtracts that run's steps and seconds (the prefill). The engine's own step-phase histograms
(engine/step_phases.py, `cbd_engine_step_phase_seconds`) give each phase's seconds; printed as µs per
sequence per step. "launch" includes the forward here (the CPU runs it in the engine thread), so the
host figure is every phase but launch and wait. `--before DIR` runs the same from another source tree.

    python bench/host_cost_cpu.py [--batches 32,128,256] [--new-tokens 64] [--rounds 2] [--before DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

HOST_PHASES = ("intake", "schedule", "mask", "book", "emit", "deliver")


def build_checkpoint(directory: Path) -> None:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from cbd.model.loader import resolve_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(resolve_checkpoint(None))
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=49152, max_position_embeddings=4096,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def measure(checkpoint: str, batches: list[int], new_tokens: int, prompt_len: int, rounds: int) -> dict:
    from cbd.config import EngineConfig
    from cbd.engine.engine import Engine
    from cbd.engine.outputs import STEP_PHASES
    from cbd.engine.sampling_params import SamplingParams

    torch.set_num_threads(1)
    top = max(batches)
    blocks = top * -(-(prompt_len + new_tokens) // 16) * 2 + 64
    config = EngineConfig(model=checkpoint, device="cpu", dtype="float32", block_size=16, num_kv_blocks=blocks,
                          max_num_seqs=top, max_num_batched_tokens=max(2048, top), num_threads=1)  # fmt: skip
    engine = Engine(config, detokenize=False)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    rng = random.Random(0)
    results: dict = {}
    try:
        engine.generate([[rng.randrange(100, 49000) for _ in range(prompt_len)]], params)  # warm-up
        for b in batches:
            for _ in range(rounds):
                # Decode steps alone: a run of 1 new token (prefill) taken from one of new_tokens + 1,
                # fresh prompts of the same length for each (no prefix shared with earlier runs).
                runs = []
                for n in (1, new_tokens + 1):
                    prompts = [[rng.randrange(100, 49000) for _ in range(prompt_len)] for _ in range(b)]
                    before = engine.stats()
                    engine.generate(prompts, replace(params, max_tokens=n))
                    after = engine.stats()
                    assert before.step_phases is not None and after.step_phases is not None
                    runs.append((sum(after.step_phases.buckets[0]) - sum(before.step_phases.buckets[0]),
                                 [a - z for a, z in zip(after.step_phases.seconds, before.step_phases.seconds)]))  # fmt: skip
                steps = runs[1][0] - runs[0][0]
                us = {p: 1e6 * (x - y) / steps / b for p, x, y in zip(STEP_PHASES, runs[1][1], runs[0][1], strict=True)}
                host = sum(us[p] for p in HOST_PHASES)
                if b not in results or host < results[b]["host_us"]:
                    results[b] = {"host_us": host, "phase_us": us, "steps": steps}
    finally:
        engine.shutdown()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="32,128,256")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--before", help="also measure the engine of this source tree (DIR/daemon)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # a checkpoint: measure and print JSON
    args = parser.parse_args()
    batches = [int(x) for x in args.batches.split(",")]
    if args.worker:
        print(json.dumps(measure(args.worker, batches, args.new_tokens, args.prompt_len, args.rounds)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        build_checkpoint(Path(tmp))
        runs = {"this tree": None, **({"before": args.before} if args.before else {})}
        found = {}
        for label, tree in runs.items():
            env = dict(os.environ)
            if tree is not None:
                env["PYTHONPATH"] = os.pathsep.join([f"{tree}/daemon", env.get("PYTHONPATH", "")])
            argv = [sys.executable, __file__, "--worker", tmp, "--batches", args.batches, "--new-tokens",
                    str(args.new_tokens), "--prompt-len", str(args.prompt_len), "--rounds", str(args.rounds)]  # fmt: skip
            out = subprocess.run(argv, env=env, check=True, capture_output=True, text=True).stdout
            found[label] = {int(k): v for k, v in json.loads(out.splitlines()[-1]).items()}
    print(f"host µs per sequence per step (engine thread; every phase but launch and wait), best of {args.rounds}")
    print(f"{'tree':>10} {'B':>4} {'host':>6} " + " ".join(f"{p:>8}" for p in (*HOST_PHASES, "launch")))
    for label, results in found.items():
        for b in batches:
            r = results[b]
            phases = " ".join(f"{r['phase_us'][p]:8.2f}" for p in (*HOST_PHASES, "launch"))
            print(f"{label:>10} {b:4d} {r['host_us']:6.2f} {phases}")


if __name__ == "__main__":
    main()
