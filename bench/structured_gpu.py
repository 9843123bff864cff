"""Constrained decoding on the GPU: every sequence under a tool-call JSON schema vs the same run without
grammars, overlap on, one process, same model and prompts.

Llama-3-8B shape with the embedded model's vocabulary (49152; its tokenizer, from --tokenizer, builds the
grammar), random bf16 weights, B requests x P random prompt tokens x N new tokens, greedy. Unconstrained:
EOS ignored. Constrained: an array of at least 1000 tool calls ({"name": one of 8 tools, "arguments":
{...}}), so no sequence can end before N tokens. Reports ms per decode step (steady decode wall time /
steps), GPU busy (CUDA events around each step's compute-stream work, over their span), the cold compile
time of the schema and the time of a cache hit.

    python bench/structured_gpu.py --tokenizer DIR [--requests 32] [--prompt-len 256] [--new-tokens 512]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from overlap_gpu import SHAPE, make_core  # noqa: E402

from cbd.engine.grammar.matcher import GrammarCompiler, GrammarKind, GrammarSpec  # noqa: E402
from cbd.engine.sampling_params import SamplingParams  # noqa: E402
from cbd.model.loader import model_from_hf  # noqa: E402

TOOLS = ["search", "get_weather", "read_file", "write_file", "run_tests", "open_url", "send_email", "calendar"]
CALL = {"type": "object", "properties": {
    "name": {"enum": TOOLS},
    "arguments": {"type": "object", "properties": {
        "query": {"type": "string", "maxLength": 40}, "path": {"type": "string", "maxLength": 40},
        "limit": {"type": "integer", "minimum": 1, "maximum": 100}, "recursive": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["urgent", "later", "draft"]}, "maxItems": 3}},
        "required": ["query", "limit"]}},
    "required": ["name", "arguments"]}  # fmt: skip
SCHEMA = {"type": "array", "minItems": 1000, "items": CALL}


def run(core, prompts, params) -> dict:  # type: ignore[no-untyped-def]
    torch.cuda.synchronize()
    for p in prompts:
        core.add_request(p, params)
    stamps, decode_from, generated = [], None, 0
    while core.has_work():
        if decode_from is not None and not isinstance(core.runner.step_events, list):
            core.runner.step_events = []
        outputs = core.step()
        stamps.append(time.perf_counter())
        generated += sum(len(d.token_ids) for o in outputs for d in o.candidates)
        if (
            decode_from is None
            and not core.scheduler.waiting
            and all(s.num_computed_tokens >= s.num_prompt_tokens for s in core.scheduler.running)
        ):
            decode_from = len(stamps)
    torch.cuda.synchronize()
    events, core.runner.step_events = list(core.runner.step_events or []), None
    events = events[8:-8]
    busy = sum(a.elapsed_time(b) for a, b in events) / events[0][0].elapsed_time(events[-1][1])
    steady = stamps[decode_from + 4 :]
    assert core.block_manager.num_used_blocks == 0
    return {"ms_step": 1000 * (steady[-1] - steady[0]) / (len(steady) - 1), "busy": busy, "generated": generated}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    vocab = 49152
    config = LlamaConfig(**{**SHAPE, "num_hidden_layers": args.layers, "vocab_size": vocab})
    torch.manual_seed(0)
    with torch.device("cuda"):
        torch.set_default_dtype(torch.bfloat16)
        hf = LlamaForCausalLM(config).eval()
        torch.set_default_dtype(torch.float32)
    loaded = model_from_hf(hf, "cuda", torch.bfloat16)
    max_len = args.prompt_len + args.new_tokens + 16
    blocks = args.requests * (-(-max_len // 16)) + 64
    core = make_core(loaded, "on", args.requests, max_len, blocks)
    start = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, vocab, (tokenizer.eos_token_id,))
    setup_s = time.perf_counter() - start
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA))
    start = time.perf_counter()
    grammar = compiler.compile(spec)
    cold_ms = 1000 * (time.perf_counter() - start)
    start = time.perf_counter()
    compiler.compile(GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA)))
    hit_ms = 1000 * (time.perf_counter() - start)
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    plain = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, grammar=grammar)
    rows = {"unconstrained": [], "constrained": []}
    for _ in range(args.rounds):
        rows["unconstrained"].append(run(core, prompts, plain))
        rows["constrained"].append(run(core, prompts, constrained))
    best = {k: min(v, key=lambda r: r["ms_step"]) for k, v in rows.items()}
    print(json.dumps({"rounds": rows, "cold_compile_ms": cold_ms, "cache_hit_ms": hit_ms, "compiler_setup_s": setup_s}))
    print("| run | ms / decode step | GPU busy (events) | tokens |")
    print("| --- | ---: | ---: | ---: |")
    for k, r in best.items():
        print(f"| {k} | {r['ms_step']:.2f} | {100 * r['busy']:.1f}% | {r['generated']} |")
    ratio = best["constrained"]["ms_step"] / best["unconstrained"]["ms_step"]
    print(f"constrained / unconstrained ms per step: {ratio:.3f} ({100 * (ratio - 1):+.1f}%)")
    print(f"schema compile: cold {cold_ms:.1f} ms, cache hit {hit_ms:.3f} ms; tokenizer info {setup_s:.2f} s")


if __name__ == "__main__":
    main()
