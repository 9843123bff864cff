"""The decode step's GEMMs under cuBLAS and under cuBLASLt (torch's two BLAS front ends), on CUDA.

    python bench/blas_gpu.py

For M rows (the decode batch) against the Llama-3-8B shape's weights (qkv, o, gate_up, down, LM head;
random bf16), each GEMM 20 times in one CUDA graph, best of 5 replays: microseconds per GEMM, the
weight bytes' rate, and the sum over one decode step (32 layers + the LM head) per library.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
          ("lm_head", 128256, 4096)]  # fmt: skip
LAYERS = 32
ROWS = (1, 8, 32, 64, 128)
LIBRARIES = ("cublas", "cublaslt")


def gemm_us(x: torch.Tensor, w: torch.Tensor, reps: int) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            F.linear(x, w)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            F.linear(x, w)
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / reps * 1e3)
    return best


def main() -> None:
    torch.manual_seed(0)
    weights = {name: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for name, n, k in SHAPES}
    times: dict[tuple[str, int, str], float] = {}
    for library in LIBRARIES:
        torch.backends.cuda.preferred_blas_library(library)
        for rows in ROWS:
            for name, _, k in SHAPES:
                x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
                times[(library, rows, name)] = gemm_us(x, weights[name], 5 if name == "lm_head" else 20)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'rows':>4} {'gemm':>8} {'cublas us':>10} {'lt us':>8} {'cublas TB/s':>11} {'lt TB/s':>8}")
    for rows in ROWS:
        step = dict.fromkeys(LIBRARIES, 0.0)
        for name, n, k in SHAPES:
            a, b = times[("cublas", rows, name)], times[("cublaslt", rows, name)]
            for library, us in zip(LIBRARIES, (a, b), strict=True):
                step[library] += us * (1 if name == "lm_head" else LAYERS)
            print(f"{rows:>4} {name:>8} {a:>10.1f} {b:>8.1f} {n * k * 2 / a / 1e6:>11.2f} {n * k * 2 / b / 1e6:>8.2f}")
        print(f"{rows:>4} {'step':>8} {step['cublas'] / 1e3:>8.3f}ms {step['cublaslt'] / 1e3:>6.3f}ms")


if __name__ == "__main__":
    main()
