"""FlashAttention-4 against cbd's Triton kernels for prefill / extend / mixed steps (GPU, flash-attn-4 installed).

Llama-3-8B shape (32 query / 8 KV heads, head_dim 128), bf16, block size 16, shuffled block tables; every
figure is triton (before) and flash (after) from the same process.

- chunk: one layer's attention of an 8K-token chunk at the end of a 32K context (the backend's prepare +
  attend, ms per layer, mean of 20 calls after 3), its causal TFLOP/s; flash's keys from a gathered copy (the
  copy timed) and, as "flash paged", from the pages in place; peer: torch SDPA over the same K/V made
  contiguous, with a boolean mask (the K/V copy not timed).
- mixed: one layer's attention of a step shaped like the priorities benchmark's mixed step: 240 decodes over
  256..768-token contexts, then two session turns of 200 tokens over 1200- and 2400-token contexts.
- TTFT: one request with an L-token random prompt on an EngineCore over random 8B weights (chunked prefill
  at --chunk tokens per step), submit to first token, best of 2; the engine's warm-up seconds; "flash paged":
  flash with long chunks' keys read from the pages in place; "flash whole": flash with the last layer run on
  every row (before it ran on the sampled rows alone, runner.LAST_LAYER_MIN_SKIPPED); "flash unfused": flash
  with the MLP's SiLU-mul a kernel of its own after cuBLAS's gate|up GEMM (`--fused-swiglu off`; before the
  GEMM applied it in its epilogue: model/swiglu_gemm.py). Every other variant runs with the setting's "auto".
- decode: B x C decode ms/step (CUDA graphs; decodes are Triton's under both backends: not regressed).

    python bench/flash_prefill_gpu.py [--ttft 32768] [--chunk 2048] [--decode 1x32768] [--skip-engine]
                                      [--skip-kernels]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from attention_kernels_gpu import graph_ms  # noqa: E402
from long_context_gpu import free, prompts  # noqa: E402
from overlap_gpu import build_hf  # noqa: E402

from cbd.config import EngineConfig  # noqa: E402
from cbd.engine.core import EngineCore  # noqa: E402
from cbd.engine.device import runner as runner_module  # noqa: E402
from cbd.engine.sampling_params import SamplingParams  # noqa: E402
from cbd.model import flash_attention  # noqa: E402
from cbd.model.attention import BatchLayout, layout_from_lists  # noqa: E402
from cbd.model.attention_backends import select_backend  # noqa: E402
from cbd.model.loader import model_from_hf  # noqa: E402

OUT = os.environ.get("OUT", ".")
H, HKV, D, BS = 32, 8, 128, 16
BACKENDS = ("triton", "flash")


def event_ms(fn: Callable[[], object], reps: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def case(query_lens: list[int], contexts: list[int]) -> tuple[torch.Tensor, torch.Tensor, BatchLayout]:
    num_blocks = sum(-(-c // BS) for c in contexts) + 2
    free_blocks = list(range(num_blocks))
    random.Random(0).shuffle(free_blocks)
    tables = [[free_blocks.pop() for _ in range(-(-c // BS))] for c in contexts]
    kv = torch.randn(num_blocks * BS, 2, HKV, D, device="cuda", dtype=torch.bfloat16)
    layout = layout_from_lists(query_lens, contexts, tables, BS, "cuda")
    q = torch.randn(len(layout.slot_mapping), H, D, device="cuda", dtype=torch.bfloat16)
    return q, kv, layout


def causal_flop(query_lens: list[int], contexts: list[int]) -> float:
    keys = sum(q * (c - q) + q * (q + 1) / 2 for q, c in zip(query_lens, contexts))
    return 4.0 * keys * H * D


def attention_ms(name: str, q: torch.Tensor, kv: torch.Tensor, layout: BatchLayout) -> tuple[float, float | None]:
    """(eager ms per call: launch and host work included, GPU ms per call from a CUDA graph or None)."""
    backend = select_backend(name, torch.device("cuda"), torch.bfloat16, BS, None, HKV, head_dim=D)
    scale = D**-0.5
    eager = event_ms(lambda: backend.prepare(layout).attend(q, kv, scale))
    meta = backend.prepare(layout)
    try:
        gpu: float | None = graph_ms(lambda: meta.attend(q, kv, scale), inner=5, reps=5)
    except Exception as exc:  # a kernel that cannot be captured: its eager figure stands alone
        print(f"{name}: no CUDA graph ({type(exc).__name__}: {str(exc)[:120]})", flush=True)
        gpu = None
    return eager, gpu


def sdpa_ms(q: torch.Tensor, kv: torch.Tensor, layout: BatchLayout, query: int, context: int) -> float:
    """One sequence: the peer over contiguous K/V [1, Hkv, C, D] with an explicit bottom-right causal mask."""
    table = layout.block_tables[0]
    slots = (table[:, None] * BS + torch.arange(BS, device="cuda")).view(-1)[:context]
    k, v = (kv[slots, i].transpose(0, 1)[None] for i in (0, 1))
    qq = q.transpose(0, 1)[None]
    mask = (
        torch.arange(context, device="cuda")[None, :] <= torch.arange(context - query, context, device="cuda")[:, None]
    )
    return event_ms(lambda: F.scaled_dot_product_attention(qq, k, v, attn_mask=mask, enable_gqa=True))


def kernels(results: dict) -> None:
    rng = random.Random(3)
    cases = {
        "chunk": ([8192], [32768]),  # an 8K chunk at the end of a 32K context
        # the priorities benchmark's mixed step: running decodes first (as the scheduler packs them), two turns
        "mixed": ([1] * 240 + [200, 200], [rng.randrange(256, 769) for _ in range(240)] + [1200, 2400]),
        "turns": ([200, 200], [1200, 2400]),  # the mixed step's turns alone
    }
    for case_name, (q_lens, ctx) in cases.items():
        q, kv, layout = case(q_lens, ctx)
        flop = causal_flop(q_lens, ctx)
        variants = [("triton", True), ("flash", True)] + ([("flash", False)] if case_name == "mixed" else [])
        variants += [("flash paged", True)] if case_name == "chunk" else []
        for name, split in variants:
            flash_attention.SPLIT_DECODES = split
            gather_min = flash_attention.GATHER_MIN_QUERIES
            if name == "flash paged":  # the same chunk with its keys read from the pages in place
                flash_attention.GATHER_MIN_QUERIES = 1 << 62
            eager, gpu = attention_ms(name.split()[0], q, kv, layout)
            flash_attention.GATHER_MIN_QUERIES = gather_min
            key = name if split else f"{name} whole"
            results[case_name][key] = {"eager_ms": eager, "gpu_ms": gpu, "tflops": flop / (gpu or eager) / 1e9}
            print(f"{case_name} {key}: eager {eager * 1e3:.0f} us, graph {gpu * 1e3 if gpu else float('nan'):.0f} us/layer",
                  flush=True)  # fmt: skip
        flash_attention.SPLIT_DECODES = True
        if case_name == "chunk":
            ms = sdpa_ms(q, kv, layout, q_lens[0], ctx[0])
            results["chunk"]["sdpa"] = {"eager_ms": ms, "gpu_ms": None, "tflops": flop / ms / 1e9}


def make_core(  # type: ignore[no-untyped-def]
    loaded, backend: str, max_seqs: int, max_len: int, chunk: int, fused_swiglu: str = "auto"
) -> tuple[EngineCore, float]:
    config = EngineConfig(
        device="cuda", dtype="bfloat16", block_size=BS, num_kv_blocks=max_seqs * (max_len // BS + 2) + 8,
        max_num_seqs=max_seqs, max_num_batched_tokens=chunk, max_model_len=max_len, cuda_graph_max_batch=max_seqs,
        enable_prefix_caching=False, speculative="off", host_kv_gib=0, attention_backend=backend,
        fused_swiglu=fused_swiglu,
    )  # fmt: skip
    core = EngineCore(loaded, config)
    start = time.perf_counter()
    core.warm_up()
    return core, time.perf_counter() - start


def ttft(loaded, backend: str, length: int, chunk: int, fused_swiglu: str = "auto") -> tuple[float, float]:  # type: ignore[no-untyped-def]
    core, warm = make_core(loaded, backend, 1, length + 2 * BS, chunk, fused_swiglu)
    best = float("inf")
    for seed in (1, 2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        request = core.add_request(prompts(1, length, loaded.spec.vocab_size, seed)[0],
                                   SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))  # fmt: skip
        done = False
        while not done:
            done = any(o.request_id == request.request_id and o.candidates for o in core.step())
        best = min(best, time.perf_counter() - start)
        while core.has_work():
            core.step()
    free(core)
    return best, warm


def decode_ms(loaded, backend: str, batch: int, context: int, steps: int, chunk: int) -> float:  # type: ignore[no-untyped-def]
    core, _ = make_core(loaded, backend, batch, context + steps + 64, chunk)
    params = SamplingParams(max_tokens=steps + 32, temperature=0.0, ignore_eos=True)
    for p in prompts(batch, context, loaded.spec.vocab_size):
        core.add_request(p, params)
    sched = core.scheduler
    while sched.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running):
        core.step()
    for _ in range(4):
        core.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        core.step()
    torch.cuda.synchronize()
    ms = 1000 * (time.perf_counter() - start) / steps
    for request_id in list(core.requests):
        core.abort_request(request_id)
    while core.has_work():
        core.step()
    free(core)
    return ms


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ttft", default="32768")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--decode", default="1x32768")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--skip-kernels", action="store_true")
    args = ap.parse_args()
    results: dict = {"chunk": {}, "mixed": {}, "turns": {}, "ttft": {}, "warm_up_s": {}, "decode": {}}
    if not args.skip_kernels:
        kernels(results)
    lengths = [int(x) for x in args.ttft.split(",") if x]
    configs = [tuple(int(x) for x in c.split("x")) for c in args.decode.split(",") if c]
    if not args.skip_engine:
        longest = max([c + args.steps + 64 for _, c in configs] + lengths) + 256
        hf = build_hf(32)
        loaded = model_from_hf(hf, "cuda", torch.bfloat16, max_positions=longest)
        free(hf)
        for name in (*BACKENDS, "flash unfused", "flash paged", "flash whole"):
            gather_min, skipped_min = flash_attention.GATHER_MIN_QUERIES, runner_module.LAST_LAYER_MIN_SKIPPED
            if name == "flash paged":  # long chunks' keys from the pages in place (before the gathered copy)
                flash_attention.GATHER_MIN_QUERIES = 1 << 62
            if name == "flash whole":  # the last layer on every row (before it ran on the sampled rows alone)
                runner_module.LAST_LAYER_MIN_SKIPPED = 1 << 62
            for length in lengths:
                fused = "off" if name == "flash unfused" else "auto"
                seconds, warm = ttft(loaded, name.split()[0], length, args.chunk, fused)
                results["ttft"][f"{name} {length}"] = seconds
                results["warm_up_s"][name] = warm
                print(f"ttft {name} {length}: {seconds:.3f} s (warm-up {warm:.1f} s)", flush=True)
            flash_attention.GATHER_MIN_QUERIES, runner_module.LAST_LAYER_MIN_SKIPPED = gather_min, skipped_min
            if name not in BACKENDS:
                continue
            for batch, context in configs:
                ms = decode_ms(loaded, name, batch, context, args.steps, args.chunk)
                results["decode"][f"{name} {batch}x{context}"] = ms
                print(f"decode {name} {batch}x{context}: {ms:.2f} ms/step", flush=True)
    with open(os.path.join(OUT, "flash_prefill_gpu.json"), "w") as f:
        json.dump(results, f, indent=1)

    print(f"\n{torch.cuda.get_device_name()}, 8B shape, bf16, block size {BS}, prefill budget {args.chunk}")
    print("| figure | triton (before) | flash (after) | after / before | note |")
    print("| --- | ---: | ---: | ---: | --- |")
    for case_name, label in (("chunk", "8K chunk at 32K"), ("mixed", "mixed step"), ("turns", "its two turns alone")):
        r = results[case_name]
        if not r:
            continue
        for kind in ("gpu_ms", "eager_ms"):
            t, f_ = r["triton"][kind], r["flash"][kind]
            if t is None or f_ is None:
                continue
            note = f"{r['triton']['tflops']:.0f} -> {r['flash']['tflops']:.0f} TFLOP/s" if case_name == "chunk" else ""
            if case_name == "chunk" and kind == "eager_ms":
                note = f"torch SDPA {r['sdpa']['eager_ms'] * 1e3:.0f} us ({r['sdpa']['tflops']:.0f} TFLOP/s)"
            if case_name == "chunk" and kind == "gpu_ms" and r.get("flash paged", {}).get(kind):
                note += f"; keys from the pages in place: {r['flash paged'][kind] * 1e3:.0f} us"
            if case_name == "mixed" and r["flash whole"][kind] is not None:
                note = f"FA4 over the whole step: {r['flash whole'][kind] * 1e3:.0f} us"
            what = "GPU (graph)" if kind == "gpu_ms" else "eager call"
            print(f"| {label}, {what}, us/layer | {t * 1e3:.0f} | {f_ * 1e3:.0f} | {f_ / t:.2f} | {note} |")
    for length in lengths:
        t, f_ = results["ttft"].get(f"triton {length}"), results["ttft"].get(f"flash {length}")
        if t is not None and f_ is not None:
            paged, whole = results["ttft"].get(f"flash paged {length}"), results["ttft"].get(f"flash whole {length}")
            note = f"keys from the pages in place: {paged:.3f} s" if paged is not None else ""
            note += f"; last layer on every row: {whole:.3f} s" if whole is not None else ""
            unfused = results["ttft"].get(f"flash unfused {length}")
            note += f"; SwiGLU unfused: {unfused:.3f} s" if unfused is not None else ""
            print(f"| TTFT {length // 1024}K prompt, s | {t:.3f} | {f_:.3f} | {f_ / t:.2f} | {note} |")
    for batch, context in configs:
        t, f_ = results["decode"].get(f"triton {batch}x{context}"), results["decode"].get(f"flash {batch}x{context}")
        if t is not None and f_ is not None:
            print(f"| decode {batch}x{context // 1024}K, ms/step | {t:.2f} | {f_:.2f} | {f_ / t:.2f} | |")
    if results["warm_up_s"]:
        print("warm-up s: " + ", ".join(f"{k} {v:.1f}" for k, v in results["warm_up_s"].items()))


if __name__ == "__main__":
    main()
