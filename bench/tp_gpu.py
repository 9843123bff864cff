"""Tensor parallelism on one host: ms per decode step of the Llama-3-8B shape at TP=1 and TP=2, one run.

Random bf16 weights (the shape of bench/overlap_gpu.py) are saved once as a safetensors checkpoint so
that every rank can load its shard; then for each TP size a full Engine (its ranks started by the
engine itself) decodes B requests x 128 random prompt tokens x N new tokens, greedy, EOS ignored.
ms/step = wall time between the first and the last token of the batch / engine steps in between.

    python bench/tp_gpu.py [--batches 32,128] [--new-tokens 256]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from cbd.config import EngineConfig
from cbd.engine.engine import Engine
from cbd.engine.sampling_params import SamplingParams

log = logging.getLogger("bench")


def decode_ms_per_step(engine: Engine, batch: int, new_tokens: int, vocab: int) -> float:
    rng = random.Random(batch)
    prompts = [[rng.randrange(vocab) for _ in range(128)] for _ in range(batch)]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    streams = [engine.stream(p, params) for p in prompts]
    iters = [iter(s) for s in streams]
    for it in iters:  # every request has its first token: the prefill phase is over
        next(it)
    t0, s0 = time.perf_counter(), engine.stats().num_steps
    for it in iters:
        for _ in it:
            pass
    t1, s1 = time.perf_counter(), engine.stats().num_steps
    return 1000 * (t1 - t0) / max(1, s1 - s0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="32,128")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--sizes", default="1,2")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from overlap_gpu import SHAPE, build_hf

    batches = [int(b) for b in args.batches.split(",")]
    rows: dict[int, dict[int, float]] = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as tmp:
        hf = build_hf(32)
        hf.save_pretrained(tmp, max_shard_size="4GB")
        del hf
        torch.cuda.empty_cache()
        log.info("checkpoint saved")
        for tp in [int(x) for x in args.sizes.split(",")]:
            max_len = 128 + args.new_tokens + 16
            config = EngineConfig(
                model=tmp, device="cuda", dtype="bfloat16", block_size=16, tensor_parallel_size=tp,
                max_num_seqs=max(batches), max_num_batched_tokens=8192, max_model_len=max_len,
                num_kv_blocks=max(batches) * (-(-max_len // 16)) + 64, enable_prefix_caching=False,
                cuda_graph_max_batch=max(batches),
            )  # fmt: skip
            engine = Engine(config)
            try:
                decode_ms_per_step(engine, 8, 16, SHAPE["vocab_size"])  # warm
                rows[tp] = {b: decode_ms_per_step(engine, b, args.new_tokens, SHAPE["vocab_size"]) for b in batches}
            finally:
                engine.shutdown()
                del engine
                torch.cuda.empty_cache()
            log.info("TP=%d: %s", tp, rows[tp])
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "tp_gpu.json"), "w") as f:
            json.dump(rows, f)
    print(f"\n{torch.cuda.get_device_name()} x{torch.cuda.device_count()}: Llama-3-8B shape, random bf16 weights, "
          f"128 prompt + {args.new_tokens} new tokens, greedy; ms per decode step")  # fmt: skip
    print(f"{'':8s}" + "".join(f"{'batch ' + str(b):>12s}" for b in batches))
    for tp, r in rows.items():
        print(f"TP={tp:<5d}" + "".join(f"{r[b]:12.2f}" for b in batches))
    if 1 in rows and 2 in rows:
        print("TP=2 speed-up: " + ", ".join(f"batch {b}: {rows[1][b] / rows[2][b]:.2f}x" for b in batches))


if __name__ == "__main__":
    main()
