"""Constrained decoding on the CPU with the embedded model: every sequence under a tool-call JSON schema vs
the same requests without a grammar, one process, alternating rounds.

SmolLM2-135M-Instruct (fp32, sync engine: the CPU default), R chat prompts x N new tokens, greedy.
Unconstrained: EOS ignored. Constrained: the tool-call array schema of bench/structured_gpu.py (at least
1000 calls), so no sequence ends before N tokens. Prints each mode's median ms per engine step over the
decode phase and their ratio.

    python bench/structured_cpu.py [--requests 16] [--new-tokens 48] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from structured_gpu import SCHEMA  # noqa: E402

from cbd.config import EngineConfig  # noqa: E402
from cbd.engine.core import EngineCore  # noqa: E402
from cbd.engine.grammar.matcher import GrammarCompiler, GrammarKind, GrammarSpec  # noqa: E402
from cbd.engine.sampling_params import SamplingParams  # noqa: E402
from cbd.model.loader import load_model  # noqa: E402


def run(core: EngineCore, prompts: list[list[int]], params: SamplingParams) -> float:
    for p in prompts:
        core.add_request(p, params)
    stamps, decode_from = [], None
    while core.has_work():
        core.step()
        stamps.append(time.perf_counter())
        if decode_from is None and all(s.num_computed_tokens >= s.num_prompt_tokens for s in core.scheduler.running):
            decode_from = len(stamps)
    assert decode_from is not None and core.block_manager.num_used_blocks == 0
    steady = stamps[decode_from + 2 :]
    return 1000 * (steady[-1] - steady[0]) / (len(steady) - 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    loaded = load_model(None)
    tok = loaded.tokenizer
    core = EngineCore(loaded, EngineConfig(enable_prefix_caching=False))
    compiler = GrammarCompiler(tok, loaded.spec.vocab_size, loaded.eos_token_ids)
    start = time.perf_counter()
    grammar = compiler.compile(GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA)))
    cold_ms = 1000 * (time.perf_counter() - start)
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": f"Plan {i} tool calls as JSON."}],
                                add_generation_prompt=True, return_dict=True)["input_ids"]
        for i in range(args.requests)
    ]  # fmt: skip
    modes = {
        "unconstrained": SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True),
        "constrained": SamplingParams(max_tokens=args.new_tokens, temperature=0.0, grammar=grammar),
    }
    ms: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in list(modes) if r % 2 == 0 else list(reversed(modes)):
            ms[mode].append(run(core, prompts, modes[mode]))
    med = {m: statistics.median(v) for m, v in ms.items()}
    print(json.dumps({"rounds": ms, "cold_compile_ms": cold_ms}))
    print("| run | ms / engine step (median) | rounds |")
    print("| --- | ---: | --- |")
    for m, v in ms.items():
        print(f"| {m} | {med[m]:.1f} | {', '.join(f'{x:.1f}' for x in v)} |")
    ratio = med["constrained"] / med["unconstrained"]
    print(f"constrained / unconstrained: {ratio:.3f} ({100 * (ratio - 1):+.1f}%); cold compile {cold_ms:.1f} ms")


if __name__ == "__main__":
    main()
