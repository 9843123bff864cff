"""Long agent contexts on the GPU: decode ms/step by batch x context against the plain-torch floor, time to
first token of long prompts, the same with the FP8 KV cache, and the 16K-token sessions a KV pool holds.

Llama-3-8B shape (overlap_gpu.SHAPE), random bf16 weights, one model shared by every run.

- cbd decode ms/step: B requests of a C-token random prompt, greedy (EOS ignored), the engine's
  defaults but for block size 16, CUDA graphs up to B, no prefix cache, no speculation; wall time of
  N steps in which all B sequences decode (after every prompt is prefilled) / N.
- torch floor: the same decode step in plain torch with the KV contiguous per sequence
  ([B, Hkv, C, D] per layer: torch SDPA with GQA), cbd's own weights and fused projections, captured
  in one CUDA graph and replayed (no scheduler, no paging, no sampling).
- weights + KV at 4.29 TB/s (a measured H200 device-to-device copy rate): the step's bytes / that rate.
- TTFT: one request with an L-token prompt (chunked prefill at the engine's default budget of 2048
  tokens per step, or --chunk), submit to first token, best of 2.
- sessions: 16K-token sessions that fit in a pool of --pool-gib (the engine's own sizing).

    python bench/long_context_gpu.py [--configs 1x8192,1x32768,1x65536,8x16384,32x8192] [--new-tokens 128]
        [--ttft 8192,32768,65536] [--chunk 2048] [--skip-floor] [--kv bf16,fp8]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from attention_kernels_gpu import graph_ms  # noqa: E402
from overlap_gpu import build_hf  # noqa: E402

from cbd.config import EngineConfig  # noqa: E402
from cbd.engine.core import EngineCore  # noqa: E402
from cbd.engine.device.runner import ModelRunner  # noqa: E402
from cbd.engine.sampling_params import SamplingParams  # noqa: E402
from cbd.model.llama import CausalLM  # noqa: E402
from cbd.model.loader import model_from_hf  # noqa: E402

OUT = os.environ.get("OUT", ".")
COPY_TBS = 4.29
BLOCK = 16


def make_core(loaded, kv: str, max_seqs: int, max_len: int, chunk: int) -> EngineCore:  # type: ignore[no-untyped-def]
    config = EngineConfig(
        device="cuda", dtype="bfloat16", block_size=BLOCK, num_kv_blocks=max_seqs * (max_len // BLOCK + 2) + 8,
        max_num_seqs=max_seqs, max_num_batched_tokens=chunk, max_model_len=max_len, cuda_graph_max_batch=max_seqs,
        enable_prefix_caching=False, speculative="off", kv_cache_dtype="fp8" if kv == "fp8" else "auto",
        host_kv_gib=0,
    )  # fmt: skip
    core = EngineCore(loaded, config)
    core.warm_up()
    return core


def free(*objs) -> None:  # type: ignore[no-untyped-def]
    del objs
    gc.collect()
    torch.cuda.empty_cache()


def prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(batch)]


def cbd_decode(loaded, kv: str, batch: int, context: int, new_tokens: int, chunk: int) -> float:  # type: ignore[no-untyped-def]
    """Wall ms per step over new_tokens steps in which all `batch` sequences decode (the first ones to be
    prefilled decode while the others prefill: they get enough tokens to outlast that)."""
    prefill_steps = -(-batch * context // chunk) + batch
    core = make_core(loaded, kv, batch, context + new_tokens + prefill_steps + BLOCK, chunk)
    params = SamplingParams(max_tokens=new_tokens + prefill_steps, temperature=0.0, ignore_eos=True)
    requests = [core.add_request(p, params) for p in prompts(batch, context, loaded.spec.vocab_size)]
    sched = core.scheduler
    while sched.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running):
        core.step()
    for _ in range(4):  # into the steady state
        core.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(new_tokens):
        core.step()
        assert len(sched.running) == batch
    torch.cuda.synchronize()
    ms = 1000 * (time.perf_counter() - start) / new_tokens
    for request in requests:
        core.abort_request(request.request_id)
    while core.has_work():
        core.step()
    assert core.block_manager.num_used_blocks == 0
    free(core)
    return ms


def ttft(loaded, kv: str, length: int, chunk: int) -> float:  # type: ignore[no-untyped-def]
    core = make_core(loaded, kv, 1, length + 2 * BLOCK, chunk)
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
    return best


@torch.inference_mode()
def torch_floor(model: CausalLM, batch: int, context: int, reps: int = 20) -> float:
    """ms per plain-torch decode step over contiguous KV, replayed from one CUDA graph."""
    spec = model.spec
    h, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    dev = model.embed_tokens.weight.device
    dtype = model.embed_tokens.weight.dtype
    caches = [torch.zeros(2, batch, hkv, context, d, device=dev, dtype=dtype) for _ in model.layers]
    ids = torch.zeros(batch, dtype=torch.long, device=dev)
    pos = context - 1
    cos = model.cos_table[pos].to(dtype)
    sin = model.sin_table[pos].to(dtype)

    def rope(x: torch.Tensor) -> torch.Tensor:
        half = d // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin

    def step() -> torch.Tensor:
        x = model.embed_tokens(ids)
        for layer, cache in zip(model.layers, caches):
            attn, mlp = layer.self_attn, layer.mlp
            hn = F.rms_norm(x, (x.shape[-1],), layer.input_layernorm.weight, spec.rms_norm_eps)
            qkv = F.linear(hn, attn.qkv_proj.weight)
            q = rope(qkv[:, : spec.q_size].view(batch, h, 1, d))
            k = rope(qkv[:, spec.q_size : spec.q_size + spec.kv_size].view(batch, hkv, 1, d))
            v = qkv[:, spec.q_size + spec.kv_size :].view(batch, hkv, 1, d)
            cache[0, :, :, pos : pos + 1].copy_(k)
            cache[1, :, :, pos : pos + 1].copy_(v)
            o = F.scaled_dot_product_attention(q, cache[0], cache[1], scale=attn.scale, enable_gqa=True)
            x = x + F.linear(o.reshape(batch, spec.q_size), attn.o_proj.weight)
            hn = F.rms_norm(x, (x.shape[-1],), layer.post_attention_layernorm.weight, spec.rms_norm_eps)
            gate, up = F.linear(hn, mlp.gate_up_proj.weight).chunk(2, -1)
            x = x + F.linear(F.silu(gate) * up, mlp.down_proj.weight)
        x = F.rms_norm(x, (x.shape[-1],), model.norm.weight, spec.rms_norm_eps)
        return F.linear(x, model.lm_head.weight)

    return graph_ms(step, inner=1, reps=reps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="1x8192,1x32768,1x65536,8x16384,32x8192")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--ttft", default="8192,32768,65536")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--kv", default="bf16,fp8")
    ap.add_argument("--pool-gib", type=float, default=40.0)
    ap.add_argument("--skip-floor", action="store_true")
    args = ap.parse_args()
    configs = [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",") if c]
    lengths = [int(x) for x in args.ttft.split(",") if x]
    kinds = args.kv.split(",")
    longest = max([c + args.new_tokens for _, c in configs] + lengths) + 256
    hf = build_hf(32)
    loaded = model_from_hf(hf, "cuda", torch.bfloat16, max_positions=longest)
    free(hf)
    spec = loaded.spec
    weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    results: dict = {"decode": {}, "ttft": {}, "sessions": {}, "weights_gb": weight_bytes / 1e9}
    for kind in kinds:
        for batch, context in configs:
            ms = cbd_decode(loaded, kind, batch, context, args.new_tokens, args.chunk)
            results["decode"][f"{kind} {batch}x{context}"] = ms
            print(f"decode {kind} {batch}x{context}: {ms:.2f} ms/step", flush=True)
        for length in lengths:
            seconds = ttft(loaded, kind, length, args.chunk)
            results["ttft"][f"{kind} {length}"] = seconds
            print(f"ttft {kind} {length}: {seconds:.3f} s", flush=True)
        block_bytes = ModelRunner.kv_bytes_per_block(loaded.model, BLOCK, "fp8" if kind == "fp8" else "auto")
        blocks = int(args.pool_gib * 2**30) // block_bytes
        results["sessions"][kind] = blocks * BLOCK // 16384
    if not args.skip_floor:
        for batch, context in configs:
            results["decode"][f"floor {batch}x{context}"] = torch_floor(loaded.model, batch, context)
    with open(os.path.join(OUT, "long_context_gpu.json"), "w") as f:
        json.dump(results, f, indent=1)

    per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 2  # bf16 K and V bytes
    print(f"\n{torch.cuda.get_device_name()}, 8B shape, random bf16 weights ({weight_bytes / 1e9:.1f} GB), "
          f"{args.new_tokens} new tokens, prefill budget {args.chunk}")  # fmt: skip
    print("| batch x context | cbd bf16 ms/step | cbd fp8 ms/step | torch floor | weights+KV at 4.29 TB/s |")
    print("| --- | ---: | ---: | ---: | ---: |")
    d = results["decode"]
    for batch, context in configs:
        ideal = (weight_bytes + batch * (context + args.new_tokens // 2) * per_token) / (COPY_TBS * 1e12) * 1e3
        cells = [d.get(f"{k} {batch}x{context}") for k in ("bf16", "fp8", "floor")]
        text = " | ".join(f"{c:.2f}" if c is not None else "-" for c in cells)
        print(f"| {batch} x {context // 1024}K | {text} | {ideal:.2f} |")
    print("| prompt | TTFT bf16 s | TTFT fp8 s |")
    print("| --- | ---: | ---: |")
    for length in lengths:
        cells = [results["ttft"].get(f"{k} {length}") for k in ("bf16", "fp8")]
        print(f"| {length // 1024}K | " + " | ".join(f"{c:.3f}" if c is not None else "-" for c in cells) + " |")
    print(
        f"16K-token sessions in {args.pool_gib:g} GiB: " + ", ".join(f"{k} {v}" for k, v in results["sessions"].items())
    )


if __name__ == "__main__":
    main()
