"""GPU engine throughput on a random-weight model of a real shape: cbd vs transformers static generate.

The accelerator machine has no copy of the default model, so the checkpoint is built from a config
(random weights, bf16) in a temporary directory. Same prompts (random token ids) and 64 greedy new
tokens, EOS ignored, for both.

    python bench/engine_gpu.py [--shape smollm2-135m|llama-1b] [--prompts 32] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_cpu import bench_cbd  # noqa: E402

from cbd.config import EngineConfig  # noqa: E402
from cbd.engine.engine import Engine  # noqa: E402

SHAPES = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
}  # fmt: skip


def build(directory: Path, shape: str) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(max_position_embeddings=4096, **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)


def static_generate(hf, prompts: list[list[int]], new_tokens: int) -> float:  # type: ignore[no-untyped-def]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device="cuda")
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device="cuda")
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None, min_new_tokens=new_tokens, max_new_tokens=new_tokens)
    hf.generate(ids, attention_mask=mask, **{**kw, "min_new_tokens": 4, "max_new_tokens": 4})
    speeds = []
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = hf.generate(ids, attention_mask=mask, **kw)
        torch.cuda.synchronize()
        speeds.append((out.shape[1] - width) * len(prompts) / (time.perf_counter() - start))
    logging.getLogger("bench").info("transformers rounds: %s", ", ".join(f"{x:.1f}" for x in speeds))
    return statistics.median(speeds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("bench").setLevel(logging.INFO)
    from transformers import AutoModelForCausalLM

    rng = random.Random(0)
    vocab = SHAPES[args.shape]["vocab_size"]
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(30, 60))] for _ in range(args.prompts)]
    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp), args.shape)
        engine = Engine(EngineConfig(model=tmp, device="cuda", dtype="bfloat16", kv_cache_gib=4))
        warm = [[rng.randrange(vocab) for _ in range(40)]]
        cbd_tps, _ = bench_cbd(engine, prompts, args.new_tokens, 3, warm)
        engine.shutdown()
        del engine
        hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16).cuda().eval()
        hf_tps = static_generate(hf, prompts, args.new_tokens)
    print(
        f"\n{torch.cuda.get_device_name()} bf16, {args.shape} random weights, {args.prompts} prompts x {args.new_tokens} greedy tokens"
    )
    print(f"{'engine':40s} {'tok/s':>10s} {'cbd ratio':>10s}")
    print(f"{'cbd engine, median of 3':40s} {cbd_tps:10.1f} {1.0:9.2f}x")
    print(f"{'transformers generate (static), median of 3':40s} {hf_tps:10.1f} {cbd_tps / hf_tps:9.2f}x")


if __name__ == "__main__":
    main()
