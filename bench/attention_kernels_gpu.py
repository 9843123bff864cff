"""The attention kernels alone at long contexts (GPU): decode split policies and extend tiles, bf16 and FP8.

Decode: `triton_attention.decode` (kernel + merge) for one layer of the 8B shape (32 query / 8 KV
heads, head_dim 128, block size 16, shuffled block tables), ten calls captured in a CUDA graph and
replayed; µs per call and the KV bytes read per second. Policies: programs per SM / least keys per
range / most ranges ("old": the cap of 16 ranges, every range active, before ranges followed each
context). FP8 rows also vary the widening (w: `FP8_WIDEN`, see `online_softmax_block`) and the keys
per loop step (kf: x 64). Extend: a whole prefill of L tokens in chunks, the extend kernel's ms per layer summed over
the chunks, and its causal attention FLOP rate, for several `Tile`s (rows, keys per step, warps, stages).
The module's knobs are set per row and restored at the end.

    python bench/attention_kernels_gpu.py [decode|extend|both|fp8]   (fp8: decode, the engine's policy only)
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable

import torch

from cbd.model import kv_format
from cbd.model import triton_attention as ta
from cbd.model import triton_extend as te
from cbd.model.attention import BatchLayout, layout_from_lists

H, HKV, D, BS = 32, 8, 128, 16
WIDEN_MODES = (3, 2, 1, 0)  # ta.FP8_WIDEN: how e4m3 tiles are widened (see online_softmax_block)
POLICIES = [("old", 3, 1, 16), ("4/256/64", 4, 256, 64), ("8/256/64", 8, 256, 64), ("3/128/64", 3, 128, 64)]
T = te.Tile
BF16_TILES = [T(64, 64, 4, 2), T(128, 64, 4, 3), T(128, 32, 4, 3), T(128, 64, 4, 4), T(64, 64, 4, 3), T(128, 64, 8, 3)]
FP8_TILES = [
    T(64, 128, 4, 2),
    T(64, 128, 4, 3),
    T(128, 128, 8, 3),
    T(128, 64, 4, 3),
    T(128, 128, 4, 3),
    T(64, 64, 4, 2),
]


def case(query_lens: list[int], contexts: list[int], fp8: bool) -> tuple[torch.Tensor, BatchLayout]:
    num_blocks = sum(-(-c // BS) for c in contexts) + 2
    free = list(range(num_blocks))
    random.Random(0).shuffle(free)
    tables = [[free.pop() for _ in range(-(-c // BS))] for c in contexts]
    kv = torch.randn(num_blocks * BS, 2, HKV, D, device="cuda", dtype=torch.bfloat16)
    if fp8:
        kv = kv_format.quantize(kv)
    return kv, layout_from_lists(query_lens, contexts, tables, BS, "cuda")


def graph_ms(fn: Callable[[], object], inner: int = 10, reps: int = 5) -> float:
    """ms per call of fn: `inner` calls captured in one CUDA graph (after two warm-up calls on a side
    stream), replayed `reps` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps / inner


def eager_ms(fn: Callable[[], object], reps: int = 3) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


DECODE_CASES = [(1, 8192), (1, 32768), (1, 65536), (8, 16384), (32, 8192), (32, 512)]


def sweep_decode(cases: list[tuple[int, int]] = DECODE_CASES, policies: list = POLICIES) -> None:
    print("== decode (CUDA graph): us per layer; policy = programs per SM / least keys per range / most ranges")
    for batch, context in cases:
        for fp8 in (False, True):
            kv, lay = case([1] * batch, [context] * batch, fp8)
            q = torch.randn(batch, H, D, device="cuda", dtype=torch.bfloat16)
            kv_bytes = batch * context * (kv.shape[1] if fp8 else 2 * HKV * D * 2)
            variants = [(w, kf) for w in WIDEN_MODES for kf in (2, 1)] if fp8 else [(0, 1)]
            for widen, kf in variants:
                ta.FP8_WIDEN, ta.DECODE_FP8_KEYS_FACTOR = widen, kf
                line = f"{batch:>3}x{context:<6} " + (f"fp8 w={widen} kf={kf}" if fp8 else "bf16")
                for name, per_sm, least, most in policies:
                    ta.PROGRAMS_PER_SM, ta.MIN_SPLIT, ta.MAX_SPLITS = per_sm, least, most
                    splits = ta.decode_splits(batch, HKV)

                    def call(kv=kv, lay=lay, q=q, splits=splits) -> object:  # type: ignore[no-untyped-def]
                        return ta.decode(q, kv, lay.block_tables, lay.context_lens, BS, D**-0.5, splits)

                    ms = graph_ms(call)
                    line += f" | {name}:{ms * 1000:6.1f}us {kv_bytes / ms / 1e9:4.2f}TB/s s={splits}"
                print(line, flush=True)
            del kv


def sweep_extend() -> None:
    print("== extend: a whole prefill, ms per layer summed over its chunks; tile = rows/keys/warps/stages")
    for length, chunk in [(8192, 2048), (32768, 2048), (32768, 8192)]:
        for fp8 in (False, True):
            kv, _ = case([1], [length], fp8)
            table = list(range(-(-length // BS)))
            starts = range(0, length, chunk)
            lays = [layout_from_lists([min(chunk, length - s)], [min(s + chunk, length)], [table], BS, "cuda")
                    for s in starts]  # fmt: skip
            qs = [torch.randn(lay.max_query_len, H, D, device="cuda", dtype=torch.bfloat16) for lay in lays]
            for widen in WIDEN_MODES if fp8 else (0,):
                ta.FP8_WIDEN = widen
                line = f"{length:>6}/{chunk:<5} " + (f"fp8 w={widen}" if fp8 else "bf16")
                for tile in FP8_TILES if fp8 else BF16_TILES:
                    te.LONG_TILE = te.LONG_TILE_FP8 = tile

                    def prefill(kv=kv, lays=lays, qs=qs) -> None:  # type: ignore[no-untyped-def]
                        for q, lay in zip(qs, lays):
                            te.extend(q, kv, lay.block_tables, lay.query_start, lay.context_lens, lay.max_query_len,
                                      BS, D**-0.5)  # fmt: skip

                    ms = eager_ms(prefill)
                    flops = 2 * length * length * D * H  # causal: half of QK^T and PV
                    line += f" | {tile.rows}/{tile.block_n}/{tile.warps}/{tile.stages}:{ms:6.2f}ms {flops / ms / 1e9:3.0f}TF"
                print(line, flush=True)
            del kv


def main() -> None:
    which = sys.argv[1] if len(sys.argv) > 1 else "both"
    knobs = (ta.PROGRAMS_PER_SM, ta.MIN_SPLIT, ta.MAX_SPLITS, ta.FP8_WIDEN, ta.DECODE_FP8_KEYS_FACTOR, te.LONG_TILE,
             te.LONG_TILE_FP8)  # fmt: skip
    try:
        if which in ("both", "decode"):
            sweep_decode()
        if which == "fp8":  # the widening modes at the engine's split policy
            sweep_decode([(1, 32768), (8, 16384), (32, 8192)], [p for p in POLICIES if p[0] == "3/128/64"])
        if which in ("both", "extend"):
            sweep_extend()
    finally:
        (ta.PROGRAMS_PER_SM, ta.MIN_SPLIT, ta.MAX_SPLITS, ta.FP8_WIDEN, ta.DECODE_FP8_KEYS_FACTOR, te.LONG_TILE,
         te.LONG_TILE_FP8) = knobs  # fmt: skip


if __name__ == "__main__":
    main()
