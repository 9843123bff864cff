"""The engine's host time per sequence per step, by phase, with a model too small to matter (CPU).

A 1-layer Llama with hidden size 64 and the default model's vocabulary (49152) and tokenizer: the forward
costs little, so what the engine thread spends per step is mostly its own Python work, the part that
grows with the batch (what bench/daemon_gpu.py sees on a GPU as CPU time per step). The engine core is
stepped as the engine thread steps it (detokenising only for stop strings, an output callback per request,
`deliver()` after each step), in sync mode as on any CPU. Per batch size B: B prompts of --prompt-len
random tokens, greedy, EOS ignored, --new-tokens each, all at once; once every sequence decodes, the
decode steps to the end are measured; best of --rounds. The engine's own step-phase laps
(engine/step_phases.py, `cbd_engine_step_phase_seconds`) give each phase's seconds; "launch" holds the
CPU forward here, so the host figure is every phase but launch and wait, plus the two host parts of
launch timed apart (the bench wraps them): packing the step's inputs (`pack_step`) and staging them
(`InputStager.stage`). Printed as µs per sequence per step. `--before DIR` runs the same from another
source tree. `--stub-forward` replaces the model's forward by a constant row of logits (every row samples
the same plain token): the host phases then run without the forward's cache pollution, as on a GPU, and
"launch" is only its host part. `--stream-interval K` gathers each request's outputs by K tokens (the
batch streams' setting; engine/stream_interval.py). Each tree runs in its own process (gc frozen after
start-up by its own `gc_heap.freeze()`, as its engine process does).

    python bench/host_cost_cpu.py [--batches 32,128,256] [--new-tokens 64] [--prompt-len 128] [--rounds 2]
                                  [--stub-forward] [--stream-interval K] [--before DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HOST_PHASES = ("intake", "schedule", "pack", "stage", "mask", "book", "emit", "deliver")


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


def stub_forward() -> None:
    """The model's forward as a constant [rows, 256] of logits, the largest at a plain token (id 253)."""
    from cbd.engine.device.runner import ModelRunner
    from cbd.engine.device.step_inputs import StepMeta, StepTensors

    logits = torch.zeros(8192, 256)
    logits[:, 253] = 1.0

    def forward(self: ModelRunner, t: StepTensors, meta: StepMeta) -> torch.Tensor:
        rows = t.ids.shape[0] if t.logits_rows is None else t.logits_rows.shape[0]
        return logits[:rows]

    ModelRunner._forward = forward  # type: ignore[method-assign]  # the stub replaces the method on purpose


def measure(
    checkpoint: str, batches: list[int], new_tokens: int, prompt_len: int, rounds: int, stream_interval: int = 1
) -> dict:
    import time

    import cbd.engine.core as core_module
    from cbd import gc_heap
    from cbd.config import EngineConfig
    from cbd.engine.core import EngineCore
    from cbd.engine.device.step_inputs import InputStager
    from cbd.engine.outputs import STEP_PHASES
    from cbd.engine.sampling_params import SamplingParams
    from cbd.engine.step_phases import DELIVER
    from cbd.model.loader import load_model

    torch.set_num_threads(1)
    top = max(batches)
    blocks = top * -(-(prompt_len + new_tokens) // 16) + 64
    config = EngineConfig(model=checkpoint, device="cpu", dtype="float32", block_size=16, num_kv_blocks=blocks,
                          max_num_seqs=top, max_num_batched_tokens=max(16384, top), num_threads=1)  # fmt: skip
    loaded = load_model(config.model, config.cache_dir, config.torch_device(), config.torch_dtype(),
                        pack_cpu_gemm=config.cpu_packed_gemm)  # fmt: skip
    core = EngineCore(loaded, config, detokenize=False)
    gc_heap.freeze()  # as the engine process does once it has started (this tree's rule)
    # The two host parts of launch, timed by wrapping them (on the CPU the forward runs inside launch too).
    packing = {"pack": 0.0, "stage": 0.0}

    def timed(name: str, fn):  # type: ignore[no-untyped-def]
        def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                packing[name] += time.perf_counter() - start

        return wrapper

    core_module.pack_step = timed("pack", core_module.pack_step)  # type: ignore[assignment]
    InputStager.stage = timed("stage", InputStager.stage)  # type: ignore[method-assign]
    gathered = {"stream_interval": stream_interval} if stream_interval > 1 else {}
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, **gathered)
    rng = random.Random(0)
    received = [0]

    def on_output(out) -> None:  # type: ignore[no-untyped-def]
        received[0] += 1

    def run_until_idle() -> None:
        while core.has_work():
            core.step()
            core.deliver()

    results: dict = {}
    core.add_request([rng.randrange(100, 49000) for _ in range(prompt_len)], params, on_output=on_output)
    run_until_idle()  # warm-up
    for b in batches:
        for _ in range(rounds):
            for _ in range(b):  # fresh prompts: no prefix shared with earlier runs
                core.add_request([rng.randrange(100, 49000) for _ in range(prompt_len)], params, on_output=on_output)
            running = core.scheduler.running
            while core.scheduler.waiting or any(s.num_uncomputed > 1 for s in running) or len(running) < b:
                core.step()  # the prefills (a few steps; the first sequences take their first tokens meanwhile)
                core.deliver()
            core.phases.end_step(False)  # what the prefill steps left in the lap clock is not a decode's
            before, steps0, packed0 = list(core.phases.stats.seconds), core.num_steps, dict(packing)
            while core.has_work():
                core.phases.start()
                core.step()
                core.deliver()
                core.phases.lap(DELIVER)
                core.phases.end_step(True)
            steps = core.num_steps - steps0
            us = {p: 1e6 * (x - y) / steps / b for p, x, y in zip(STEP_PHASES, core.phases.stats.seconds, before)}
            for name in packing:
                us[name] = 1e6 * (packing[name] - packed0[name]) / steps / b
            host = sum(us[p] for p in HOST_PHASES)
            if b not in results or host < results[b]["host_us"]:
                results[b] = {"host_us": host, "phase_us": us, "steps": steps}
    assert received[0] > 0
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="32,128,256")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--stub-forward", action="store_true", help="a constant forward: host work only")
    parser.add_argument("--stream-interval", type=int, default=1)
    parser.add_argument("--before", help="also measure the engine of this source tree (DIR/daemon)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # a checkpoint: measure and print JSON
    args = parser.parse_args()
    batches = [int(x) for x in args.batches.split(",")]
    if args.worker:
        if args.stub_forward:
            stub_forward()
        found = measure(args.worker, batches, args.new_tokens, args.prompt_len, args.rounds, args.stream_interval)
        print(json.dumps(found))
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
                    str(args.new_tokens), "--prompt-len", str(args.prompt_len), "--rounds", str(args.rounds),
                    "--stream-interval", str(args.stream_interval), *(["--stub-forward"] if args.stub_forward else [])]  # fmt: skip
            out = subprocess.run(argv, env=env, check=True, capture_output=True, text=True).stdout
            found[label] = {int(k): v for k, v in json.loads(out.splitlines()[-1]).items()}
    print(
        f"host µs per sequence per decode step (engine thread; every phase but launch and wait, with pack and stage), "
        f"best of {args.rounds}; stream interval {args.stream_interval}"
        + ("; forward stubbed (launch: its host part)" if args.stub_forward else "")
    )
    print(f"{'tree':>10} {'B':>4} {'host':>6} " + " ".join(f"{p:>8}" for p in (*HOST_PHASES, "launch")))
    for label, results in found.items():
        for b in batches:
            r = results[b]
            phases = " ".join(f"{r['phase_us'][p]:8.2f}" for p in (*HOST_PHASES, "launch"))
            print(f"{label:>10} {b:4d} {r['host_us']:6.2f} {phases}")


if __name__ == "__main__":
    main()
