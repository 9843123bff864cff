"""The overlap engine on the GPU: cbd async vs cbd sync vs transformers' continuous batching, one run.

Llama-3-8B-shaped config (hidden 4096, 32 layers, 32 heads / 8 KV heads, intermediate 14336,
vocab 128256), random bf16 weights built on the GPU and shared by all three (cbd copies the same
tensors). Workload: R requests x P random prompt tokens x N new tokens, greedy, EOS ignored.

Columns: ms per decode step (wall time of the decode phase / decode steps), tok/s (generated
tokens / end-to-end seconds), end-to-end seconds (submit to last token), and GPU busy: the union
of the device's kernel and copy intervals over the span they cover, from the torch profiler, in a
separate profiled window of decode steps of the same batch (profiling adds host overhead, so the
fraction is a lower bound for the unprofiled run). Then ms/step of cbd async by batch size.

transformers runs `generate_batch` in its best configuration available without flash-attn:
torch's `varlen_attn` registered as a `paged|varlen` attention, `use_cuda_graph=True`, and
`use_async_batching` True/False; its ms/step comes from its per-token timestamps.

    python bench/overlap_gpu.py [--requests 32] [--prompt-len 256] [--new-tokens 2048] [--skip-hf]
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import logging
import os
import random
import statistics
import time

import torch

from cbd.config import EngineConfig
from cbd.engine.core import EngineCore
from cbd.engine.sampling_params import SamplingParams
from cbd.model.loader import LoadedModel, model_from_hf

log = logging.getLogger("bench")
OUT = os.environ.get("OUT", ".")

SHAPE = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
             num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
             tie_word_embeddings=False)  # fmt: skip


def build_hf(layers: int):  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**SHAPE, "num_hidden_layers": layers})
    torch.manual_seed(0)
    with torch.device("cuda"):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = LlamaForCausalLM(config)
        finally:
            torch.set_default_dtype(prev)
    return model.eval()


def loaded_8b(max_positions: int):  # type: ignore[no-untyped-def]
    """The 8B shape (random weights, bf16) as cbd's LoadedModel on CUDA; the transformers copy is freed."""
    from cbd.model.loader import model_from_hf

    hf = build_hf(32)
    loaded = model_from_hf(hf, "cuda", torch.bfloat16, max_positions=max_positions)
    del hf
    torch.cuda.empty_cache()
    return loaded


# ---- cbd ------------------------------------------------------------------------------------
def make_core(loaded: LoadedModel, overlap: str, max_seqs: int, max_len: int, blocks: int) -> EngineCore:
    config = EngineConfig(
        device="cuda", dtype="bfloat16", block_size=16, num_kv_blocks=blocks, max_num_seqs=max_seqs,
        max_num_batched_tokens=4096, max_model_len=max_len, overlap=overlap, cuda_graph_max_batch=max_seqs,
        enable_prefix_caching=False, speculative="off",  # the cost of a decode step (bench/speculative.py: drafts)
    )  # fmt: skip
    core = EngineCore(loaded, config)
    core.warm_up()
    return core


def run_cbd(core: EngineCore, prompts: list[list[int]], new_tokens: int, profile_steps: int = 0) -> dict:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for p in prompts:
        core.add_request(p, params)
    stamps: list[float] = []
    decode_from = None
    generated = 0
    prof = None
    busy = None
    while core.has_work():
        if profile_steps and decode_from is not None and prof is None and len(stamps) >= decode_from + 8:
            prof = _profiler()
            prof.__enter__()
            prof_start = len(stamps)
        if not profile_steps and decode_from is not None and not isinstance(core.runner.step_events, list):
            core.runner.step_events = []  # bracket every decode step's device work with CUDA events
        outputs = core.step()
        stamps.append(time.perf_counter())
        generated += sum(len(d.token_ids) for o in outputs for d in o.candidates)
        if (
            decode_from is None
            and not core.scheduler.waiting
            and all(s.num_computed_tokens >= s.num_prompt_tokens for s in core.scheduler.running)
        ):
            decode_from = len(stamps)  # every prompt is prefilled: decode steps from here
        if prof is not None and busy is None and len(stamps) == prof_start + profile_steps:
            torch.cuda.synchronize()
            prof.__exit__(None, None, None)
            busy = busy_fraction(prof)
            _dump_profile(prof, f"profile_cbd_{'async' if core.overlap else 'sync'}.txt")
    torch.cuda.synchronize()
    end = time.perf_counter()
    assert decode_from is not None and core.block_manager.num_used_blocks == 0
    if profile_steps:
        return {"busy": busy}
    events, core.runner.step_events = list(core.runner.step_events or []), None
    events = events[4:-4]  # steady decode steps only
    device_ms = sum(a.elapsed_time(b) for a, b in events)
    span_ms = events[0][0].elapsed_time(events[-1][1])
    steady = stamps[decode_from + 4 :]
    return {
        "ms_step": 1000 * (steady[-1] - steady[0]) / (len(steady) - 1),
        "tok_s": generated / (end - start),
        "e2e": end - start,
        "generated": generated,
        "stream_busy": device_ms / span_ms,
    }


def _profiler():  # type: ignore[no-untyped-def]
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])


def _dump_profile(prof, name: str) -> None:  # type: ignore[no-untyped-def]
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70)
    with open(os.path.join(OUT, name), "w") as f:
        f.write(table)


def busy_fraction(prof, tail: float = 1.0) -> float:  # type: ignore[no-untyped-def]
    """Union of device intervals / the span they cover (optionally only the last `tail` of the span)."""
    intervals = []
    for e in prof.profiler.kineto_results.events():
        if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0:
            intervals.append((e.start_ns(), e.start_ns() + e.duration_ns()))
    if not intervals:
        return float("nan")
    intervals.sort()
    first, last = intervals[0][0], max(b for _, b in intervals)
    lo = last - tail * (last - first)
    busy, cur_a, cur_b = 0, None, None
    for a, b in intervals:
        a = max(a, lo)
        if b <= a:
            continue
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                busy += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    busy += cur_b - cur_a
    return busy / (last - lo)


# ---- transformers ---------------------------------------------------------------------------
_seen_kwargs: list[str] = []


def varlen_paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):  # type: ignore[no-untyped-def]
    """A `paged|` attention for transformers' continuous batching on torch's varlen_attn."""
    from torch.nn.attention.varlen import varlen_attn

    if not _seen_kwargs:
        _seen_kwargs.extend(sorted(kwargs))
        _seen_kwargs.append("-")
    cache = kwargs.pop("cache", None)
    if cache is not None:  # write the new K/V into the paged cache, read back each sequence's whole K/V
        params = inspect.signature(cache.update).parameters
        if "kwargs" in params and params["kwargs"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
            key, value = cache.update(key, value, module.layer_idx, kwargs)
        elif any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            key, value = cache.update(key, value, module.layer_idx, **kwargs)
        else:
            key, value = cache.update(key, value, module.layer_idx, **{k: v for k, v in kwargs.items() if k in params})
    cu_q, cu_k = kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"]
    max_q = kwargs.get("max_seqlen_q", kwargs.get("max_length_q"))
    max_k = kwargs.get("max_seqlen_k", kwargs.get("max_length_k"))
    if isinstance(cu_k, dict):
        cu_k, max_k = cu_k["full_attention"], max_k["full_attention"]
    config = module.config
    q = _tokens_first(query, config.num_attention_heads)  # [T, H, D]
    k = _tokens_first(key, config.num_key_value_heads)
    v = _tokens_first(value, config.num_key_value_heads)
    if len(_seen_kwargs) == len(kwargs) + 1 and not hasattr(varlen_paged_attention, "logged"):
        varlen_paged_attention.logged = True  # type: ignore[attr-defined]
        log.info("first paged|varlen call: q %s k %s v %s max_q %s max_k %s cu_q %s cu_k %s", tuple(q.shape),
                 tuple(k.shape), tuple(v.shape), max_q, max_k, tuple(cu_q.shape), tuple(cu_k.shape))  # fmt: skip
        for h in log.handlers + logging.getLogger().handlers:
            h.flush()
    names = inspect.signature(varlen_attn).parameters
    extra = {}
    if "enable_gqa" in names:
        extra["enable_gqa"] = True
    elif k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    if "is_causal" in names:
        extra["is_causal"] = True
    else:
        extra["window_size"] = (-1, 0)
    out = varlen_attn(q, k, v, cu_q.to(torch.int32), cu_k.to(torch.int32), int(max_q), int(max_k),
                      scale=scaling, **extra)  # fmt: skip
    return out.unsqueeze(0), None


def _tokens_first(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[1, heads, T, D] or [1, T, heads, D] or 3-D forms -> [T, heads, D]."""
    if x.dim() == 4:
        x = x.squeeze(0)
    if x.shape[0] == heads and x.shape[1] != heads:
        x = x.transpose(0, 1)
    return x


def run_hf(hf, prompts: list[list[int]], new_tokens: int, use_async: bool, profile: bool = False) -> dict:  # type: ignore[no-untyped-def]
    from transformers import GenerationConfig

    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    cb = ContinuousBatchingConfig(use_cuda_graph=True, use_async_batching=use_async, max_memory_percent=0.5)
    kwargs = {}
    if "record_timestamps" in inspect.signature(hf.generate_batch).parameters:
        kwargs["record_timestamps"] = True
    torch.cuda.synchronize()
    prof = _profiler() if profile else None
    if prof is not None:
        prof.__enter__()
    start = time.perf_counter()
    outputs = hf.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb, **kwargs)
    torch.cuda.synchronize()
    end = time.perf_counter()
    if prof is not None:
        prof.__exit__(None, None, None)
        _dump_profile(prof, f"profile_hf_{'async' if use_async else 'sync'}.txt")
        return {"busy": busy_fraction(prof, tail=0.5)}
    generated = sum(len(o.generated_tokens) for o in outputs.values())
    per_request = []
    for o in outputs.values():
        ts = getattr(o, "timestamps", None)
        if ts and len(ts) > 8:
            per_request.append((ts[-1] - ts[4]) / (len(ts) - 5))
    ms_step = 1000 * statistics.median(per_request) if per_request else 1000 * (end - start) / new_tokens
    return {"ms_step": ms_step, "tok_s": generated / (end - start), "e2e": end - start, "generated": generated,
            "timed_by": "timestamps" if per_request else "e2e/new_tokens"}  # fmt: skip


def _hf_subprocess(args: argparse.Namespace, attn: str, use_async: bool) -> dict | None:
    """transformers in its own process: its memory is gone afterwards and a crash cannot end the run."""
    import subprocess
    import sys

    cmd = [sys.executable, __file__, "--hf-worker", attn, "--hf-async", str(int(use_async)),
           "--requests", str(args.requests), "--prompt-len", str(args.prompt_len),
           "--new-tokens", str(args.new_tokens), "--layers", str(args.layers)]  # fmt: skip
    log.info("transformers worker: %s", " ".join(cmd[2:]))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    with open(os.path.join(OUT, f"hf_{attn.replace('|', '_')}_{'async' if use_async else 'sync'}.log"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    for line in proc.stdout.splitlines():
        if line.startswith("HF_RESULT "):
            return json.loads(line.removeprefix("HF_RESULT "))
    log.error("transformers worker (%s, async=%s) failed with rc %s: %s", attn, use_async, proc.returncode,
              proc.stderr[-2000:])  # fmt: skip
    return None


def hf_worker(args: argparse.Namespace, prompts: list[list[int]]) -> None:
    hf = build_hf(args.layers)
    if args.hf_worker.startswith("paged|"):
        from transformers import AttentionInterface

        AttentionInterface.register(args.hf_worker, varlen_paged_attention)
    hf.set_attn_implementation(args.hf_worker)
    hf.generation_config.eos_token_id = None
    use_async = bool(args.hf_async)
    run_hf(hf, prompts[:4], 16, use_async)  # compiles and warms
    row = run_hf(hf, prompts, args.new_tokens, use_async)
    row.update(run_hf(hf, prompts, 160, use_async, profile=True))
    row["attention_kwargs"] = _seen_kwargs
    print("HF_RESULT " + json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=32, help="fewer layers for a quick look (not the benchmark)")
    parser.add_argument("--scaling", default="1,8,32,64,128")
    parser.add_argument("--scaling-new-tokens", type=int, default=192)
    parser.add_argument("--profile-steps", type=int, default=48)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--hf-worker", help=argparse.SUPPRESS)
    parser.add_argument("--hf-async", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    rng = random.Random(0)
    vocab = SHAPE["vocab_size"]
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    if args.hf_worker:
        hf_worker(args, prompts)
        return
    scaling = [int(x) for x in args.scaling.split(",") if x]
    max_seqs = max([args.requests, *scaling])
    max_len = args.prompt_len + max(args.new_tokens, args.scaling_new_tokens) + 16
    blocks = max_seqs * (-(-max_len // 16)) + 64

    hf = build_hf(args.layers)
    loaded = model_from_hf(hf, "cuda", torch.bfloat16, max_positions=max_len + 64)
    rows: dict[str, dict] = {}
    results: dict = {"args": vars(args), "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for mode in ("on", "off"):
        name = f"cbd {'async' if mode == 'on' else 'sync'}"
        core = make_core(loaded, mode, max_seqs, max_len, blocks)
        run_cbd(core, prompts[:4], 16)  # warm the allocator and every kernel shape once
        rows[name] = run_cbd(core, prompts, args.new_tokens)
        rows[name].update(run_cbd(core, prompts, args.profile_steps + 64, profile_steps=args.profile_steps))
        log.info("%s: %s", name, rows[name])
        if mode == "on":
            scale_rows = {}
            for batch in scaling:
                ps = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(batch)]
                scale_rows[batch] = run_cbd(core, ps, args.scaling_new_tokens)["ms_step"]
                log.info("scaling batch %d: %.2f ms/step", batch, scale_rows[batch])
            results["scaling"] = scale_rows
        del core
        gc.collect()
        torch.cuda.empty_cache()
    del loaded
    gc.collect()
    torch.cuda.empty_cache()

    del hf
    gc.collect()
    torch.cuda.empty_cache()
    if not args.skip_hf:
        for use_async in (True, False):
            name = f"transformers generate_batch ({'async' if use_async else 'sync'})"
            for attn in ("paged|varlen", "sdpa"):  # the best available first; a crash falls back
                row = _hf_subprocess(args, attn, use_async)
                if row is not None:
                    row["attention"] = attn
                    rows[name] = row
                    break
    results["rows"] = rows
    results["rows"] = rows
    with open(os.path.join(OUT, "overlap_gpu.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)

    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}: Llama-3-8B shape "
          f"({args.layers} layers), random bf16 weights; {args.requests} requests x {args.prompt_len} prompt tokens "
          f"x {args.new_tokens} new tokens, greedy, EOS ignored")  # fmt: skip
    ref = rows.get("cbd async", {}).get("ms_step")
    print(
        f"{'engine':44s} {'ms/step':>8s} {'tok/s':>9s} {'e2e s':>8s} {'busy(ev)':>9s} {'busy(k)':>8s} {'vs async':>9s}"
    )
    nan = float("nan")
    for name, r in rows.items():
        ratio = r["ms_step"] / ref if ref else nan
        label = name + (f" [{r['attention']}]" if "attention" in r else "")
        print(f"{label:44s} {r['ms_step']:8.2f} {r['tok_s']:9.1f} {r['e2e']:8.1f} "
              f"{100 * r.get('stream_busy', nan):8.1f}% {100 * r.get('busy', nan):7.1f}% {ratio:8.2f}x")  # fmt: skip
    print(
        "busy(ev): device time of each decode step's stream work (CUDA events) over the loop's wall time, "
        "whole run; busy(k): union of kernel/copy intervals over their span (profiler, 48-step window)"
    )
    if "scaling" in results:
        print("\ncbd async, ms per decode step by batch size "
              f"({args.prompt_len} prompt + {args.scaling_new_tokens} new tokens):")  # fmt: skip
        print("  ".join(f"b={b}: {ms:.2f}" for b, ms in results["scaling"].items()))


if __name__ == "__main__":
    main()
