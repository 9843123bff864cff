"""Speculative decoding (n-gram drafts from the context): end to end on the CPU, step costs on the GPU.

CPU (the default model, real text): each agent-style prompt is generated at batch 1 with
`speculative="off"` and `"ngram"` (greedy, the same tokens by construction; checked), one after
another in this run. Reported per prompt: generated tok/s both ways and their ratio, the drafts'
acceptance rate, and the steps that verified drafts vs plain steps. Then a batch of 32 requests with
`auto` vs `off` (auto turns speculation off above `speculative_max_batch`). The step counts (the
verifying ones by their drafts) are written to $OUT/speculative_cpu.json for the GPU projection
(the last run's copy: bench/speculative_cpu.json).

GPU (`--gpu`, Llama-3-8B shape, random bf16 weights, so drafts are never right and only costs are
measured): per batch B, the wall ms of a decode step with speculation off (overlap loop, CUDA graphs),
of a synchronous step with no drafts, and of a step verifying k drafts per sequence (through the
verifying CUDA graph of 1 + k tokens a sequence; "eager": the largest k without it). With `--profile`, the
projected speedup of each CPU prompt at batch 1: tokens x (overlapped step) / (its verifying steps,
each at the cost of the graph that serves its drafts, + plain steps x a synchronous step's).

    python bench/speculative.py                   # CPU
    python bench/speculative.py --gpu --profile bench/speculative_cpu.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from cbd.config import EngineConfig
from cbd.engine.core import EngineCore
from cbd.engine.sampling_params import SamplingParams
from cbd.engine.sequence import Sequence

log = logging.getLogger("bench")
OUT = os.environ.get("OUT", ".")

CODE = (Path(__file__).resolve().parents[1] / "daemon" / "cbd" / "engine" / "spec" / "drafter.py").read_text()[:2400]
TOOL = json.dumps(
    {"status": "ok", "path": "/srv/data/2024/q3/sales.csv", "rows": 1842, "columns": ["region", "month", "units",
     "revenue"], "sample": [["north", "2024-07", 312, 18250.5], ["south", "2024-07", 288, 16011.0],
     ["east", "2024-08", 301, 17420.25], ["west", "2024-08", 275, 15903.75]], "warnings": []},
    indent=1,
)  # fmt: skip
PROMPTS = {
    "rewrite a file with one change": "Rewrite this Python file exactly as it is, except rename the class "
    "NgramIndex to NgramTable everywhere. Output only the file.\n\n" + CODE,
    "quote a tool result": "The tool returned this JSON:\n" + TOOL + "\nQuote the JSON back verbatim, then "
    "summarise it in one sentence.",
    "no copying (control)": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "tool call copying a result (JSON schema)": "The tool returned this JSON:\n" + TOOL + "\nCall save_report "
    "with the result's path, its columns and its sample rows, exactly as returned.",
}
# Prompts whose reply is held to a JSON schema (constrained decoding): drafts must pass the grammar too.
SCHEMAS = {
    "tool call copying a result (JSON schema)": {
        "type": "object",
        "properties": {"path": {"type": "string"}, "columns": {"type": "array", "items": {"type": "string"}},
                       "sample": {"type": "array", "items": {"type": "array"}}},
        "required": ["path", "columns", "sample"],
    },
}  # fmt: skip


def _chat(tokenizer, text: str) -> list[int]:  # type: ignore[no-untyped-def]
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)  # fmt: skip
    return tokenizer.encode(rendered)


def _record_drafts(core: EngineCore) -> dict[int, int]:
    """Count the verifying steps by their most drafts per sequence (the GPU projection prices each)."""
    counts: dict[int, int] = {}
    launch = core._launch

    def recorded(plan):  # type: ignore[no-untyped-def]
        if any(c.num_draft for c in plan.chunks):
            k = max(c.num_draft for c in plan.chunks)
            counts[k] = counts.get(k, 0) + 1
        return launch(plan)

    core._launch = recorded  # type: ignore[method-assign]
    return counts


def _generate(
    core: EngineCore, prompts: list[list[int]], new_tokens: int, grammar=None
) -> tuple[list[list[int]], float, int]:  # type: ignore[no-untyped-def]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, grammar=grammar)
    requests = [core.add_request(p, params) for p in prompts]
    steps = 0
    start = time.perf_counter()
    while core.has_work():
        core.step()
        steps += 1
    elapsed = time.perf_counter() - start
    return [r.sequences[0].token_ids[len(p) :] for r, p in zip(requests, prompts)], elapsed, steps


def cpu(args: argparse.Namespace) -> None:
    from cbd.engine.grammar.matcher import GrammarCompiler, GrammarKind, GrammarSpec
    from cbd.model.loader import load_model

    loaded = load_model(None, pack_cpu_gemm=True)
    compiler = GrammarCompiler(loaded.tokenizer, loaded.spec.vocab_size, tuple(loaded.eos_token_ids))
    rows = {}
    for name, text in PROMPTS.items() if "prompts" in args.parts else ():
        if args.only and args.only not in name:
            continue
        schema = SCHEMAS.get(name)
        grammar = compiler.compile(GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema))) if schema else None
        prompt = _chat(loaded.tokenizer, text)
        result: dict[str, dict] = {}
        seconds: dict[str, list[float]] = {"off": [], "ngram": []}
        for _ in range(args.repeat):  # interleaved, so that the machine's drift hits both modes alike
            for mode in ("off", "ngram"):
                core = EngineCore(
                    loaded,
                    EngineConfig(
                        speculative=mode, max_model_len=4096, num_kv_blocks=1024, num_speculative_tokens=args.k
                    ),
                )
                drafts = _record_drafts(core)
                tokens, elapsed, steps = _generate(core, [prompt], args.new_tokens, grammar)
                spec = core.stats().speculation
                assert spec is not None
                seconds[mode].append(elapsed)
                result[mode] = dict(tokens=tokens[0], steps=steps, verify_steps=spec.num_steps,
                                    drafted=spec.num_draft_tokens, accepted=spec.num_accepted_tokens,
                                    drafts_per_step=drafts)  # fmt: skip
        off, on = result["off"], result["ngram"]
        off["seconds"], on["seconds"] = statistics.median(seconds["off"]), statistics.median(seconds["ngram"])
        rows[name] = dict(
            prompt_tokens=len(prompt), generated=len(on["tokens"]), same=on["tokens"] == off["tokens"],
            tok_s_off=len(off["tokens"]) / off["seconds"], tok_s_on=len(on["tokens"]) / on["seconds"],
            steps=on["steps"], verify_steps=on["verify_steps"], plain_steps=on["steps"] - on["verify_steps"],
            drafted=on["drafted"], accepted=on["accepted"], drafts_per_step=on["drafts_per_step"],
        )  # fmt: skip
        log.info("%s: %s", name, rows[name])
    # A wide batch: auto must not cost anything (it turns itself off above speculative_max_batch).
    prompts = [_chat(loaded.tokenizer, text) for name, text in PROMPTS.items() if name not in SCHEMAS] * 11
    prompts = prompts[: args.batch]
    wide: dict[str, dict] = {"off": {"tok_s": []}, "auto": {"tok_s": []}}
    for _ in range(args.repeat if "batch" in args.parts else 0):
        for mode in ("off", "auto"):
            core = EngineCore(loaded, EngineConfig(speculative=mode, max_model_len=4096, num_kv_blocks=4096,
                                                   max_num_seqs=args.batch))  # fmt: skip
            tokens, elapsed, _ = _generate(core, prompts, args.batch_tokens)
            wide[mode]["tokens"] = tokens
            wide[mode]["tok_s"].append(sum(map(len, tokens)) / elapsed)
    runs = {mode: [round(v, 1) for v in w["tok_s"]] for mode, w in wide.items()}
    for mode in wide:
        wide[mode]["tok_s"] = statistics.median(wide[mode]["tok_s"]) if wide[mode]["tok_s"] else 0.0
    if rows:
        with open(os.path.join(OUT, "speculative_cpu.json"), "w") as f:
            json.dump(rows, f, indent=1)
    print(f"\nCPU, default model, greedy, {args.new_tokens} new tokens at most, batch 1, k = {args.k} drafts at most; "
          f"tok/s: median of {args.repeat} interleaved runs")  # fmt: skip
    print(f"{'prompt':32s} {'tokens':>6s} {'off tok/s':>9s} {'ngram tok/s':>11s} {'ratio':>6s} {'accept':>7s} "
          f"{'verify/plain steps':>19s} same")  # fmt: skip
    for name, r in rows.items():
        print(f"{name:32s} {r['generated']:6d} {r['tok_s_off']:9.2f} {r['tok_s_on']:11.2f} "
              f"{r['tok_s_on'] / r['tok_s_off']:5.2f}x {r['accepted'] / max(1, r['drafted']):7.0%} "
              f"{r['verify_steps']:9d}/{r['plain_steps']:<9d} {r['same']}")  # fmt: skip
    if "batch" in args.parts:
        same = wide["auto"]["tokens"] == wide["off"]["tokens"]
        print(f"batch {args.batch} x {args.batch_tokens} tokens: auto {wide['auto']['tok_s']:.1f} tok/s vs off "
              f"{wide['off']['tok_s']:.1f} = {wide['auto']['tok_s'] / wide['off']['tok_s']:.2f}x (floor 0.97); "
              f"same: {same}; runs {runs}")  # fmt: skip


class _FixedDrafter:
    """k arbitrary drafts for every sequence at every step: the cost of verifying k, whatever is kept."""

    def __init__(self, k: int) -> None:
        self.k = k

    def propose(self, seq: Sequence, k: int, end: int | None = None) -> list[int]:
        guess = end is not None and end < seq.num_tokens  # the first stands for the token in flight
        return [seq.token_ids[-1]] * min(k, self.k + guess)


def gpu(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from overlap_gpu import build_hf

    from cbd.model.loader import model_from_hf

    hf = build_hf(32)
    loaded = model_from_hf(hf, "cuda", torch.bfloat16, max_positions=4096)
    del hf
    torch.cuda.empty_cache()
    rng = random.Random(0)
    costs: dict[int, dict[str, float]] = {}
    for batch in args.batches:
        config = EngineConfig(device="cuda", dtype="bfloat16", block_size=16, num_kv_blocks=batch * 80 + 64,
                              max_num_seqs=max(batch, 4), max_model_len=1200, speculative="ngram",
                              num_speculative_tokens=max(args.ks), speculative_max_batch=1024,
                              enable_prefix_caching=False)  # fmt: skip
        core = EngineCore(loaded, config)
        core.warm_up()
        core.scheduler.speculator.backoff = False
        row = {}
        graphs = core.runner.graphs
        assert graphs is not None and graphs.max_queries > 1, "no verifying graphs were captured"
        most = graphs.max_queries
        k_eager = max(args.ks)
        for label, drafter, k in (
            [("overlap", None, 0), ("sync", _FixedDrafter(0), 0)]
            + [(f"k={k}", _FixedDrafter(k), k) for k in args.ks]
            + [(f"k={k_eager} eager", _FixedDrafter(k_eager), k_eager)]
        ):
            graphs.max_queries = 1 if label.endswith("eager") else most  # no verifying graph: eager steps
            core.scheduler.speculator.drafter = drafter
            core.scheduler.speculator.num_speculative_tokens = k if drafter is not None else 0
            prompts = [[rng.randrange(100, 120000) for _ in range(args.prompt_len)] for _ in range(batch)]
            params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
            requests = [core.add_request(p, params) for p in prompts]
            while any(r.sequences[0].num_output_tokens < 2 for r in requests):
                core.step()
            for _ in range(5):
                core.step()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.steps):
                core.step()
            torch.cuda.synchronize()
            row[label] = 1000 * (time.perf_counter() - start) / args.steps
            for r in requests:
                core.abort_request(r.request_id)
            while core.has_work():
                core.step()
        costs[batch] = row
        log.info("batch %d: %s", batch, row)
        del core
        torch.cuda.empty_cache()
    with open(os.path.join(OUT, "speculative_gpu.json"), "w") as f:
        json.dump(costs, f, indent=1)
    labels = list(next(iter(costs.values())))
    print(f"\n{torch.cuda.get_device_name()}, 8B shape, {args.prompt_len}-token contexts: ms per decode step")
    print(f"{'batch':>5s} " + " ".join(f"{label:>8s}" for label in labels))
    for batch, row in costs.items():
        print(f"{batch:5d} " + " ".join(f"{row[label]:8.2f}" for label in labels))
    if args.profile:
        with open(args.profile) as f:
            profile = json.load(f)
        one = costs.get(1)
        if one is None:
            return
        ks = sorted(args.ks)

        def verify_ms(k: int) -> float:  # a step verifying k drafts runs the graph of the next measured k
            return one[f"k={next((m for m in ks if m >= k), ks[-1])}"]

        print(f"projected at batch 1 (step counts from the CPU run, costs from this one; eager: every verifying "
              f"step at the cost of k = {k_eager} without a graph):")  # fmt: skip
        for name, r in profile.items():
            counts = {int(k): n for k, n in r["drafts_per_step"].items()}
            spec_ms = sum(n * verify_ms(k) for k, n in counts.items()) + r["plain_steps"] * one["sync"]
            eager_ms = r["verify_steps"] * one[f"k={k_eager} eager"] + r["plain_steps"] * one["sync"]
            base_ms = r["generated"] * one["overlap"]
            print(f"  {name:42s} {base_ms / spec_ms:5.2f}x (eager {base_ms / eager_ms:4.2f}x)  ({r['generated']} "
                  f"tokens: {r['verify_steps']} verifying steps {dict(sorted(counts.items()))} + {r['plain_steps']} "
                  f"plain vs {r['generated']} overlapped)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--batch-tokens", type=int, default=48)
    parser.add_argument("--repeat", type=int, default=3, help="CPU: runs per mode (interleaved); the median counts")
    parser.add_argument("--parts", default="prompts,batch", help="CPU: which parts to run")
    parser.add_argument("--k", type=int, default=8, help="CPU: --num-speculative-tokens")
    parser.add_argument("--only", default="", help="CPU: only the prompts whose name contains this")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 32])
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--profile", help="speculative_cpu.json of a CPU run, for the projection")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    gpu(args) if args.gpu else cpu(args)


if __name__ == "__main__":
    main()
