"""Which cuBLAS front end runs the model's GEMMs on CUDA.

torch reaches NVIDIA's GEMMs through cuBLAS or cuBLASLt; for the skinny GEMMs of decoding (a few to
a few dozen rows against an 8B model's weights) their heuristics pick different kernels. On an H200,
8B shape, cuBLASLt's make the standard overlap benchmark's step (batch 32) about 3% faster
(docs/BENCHMARKS.md). The choice is process-wide (torch's preferred BLAS library), so it is made
once per process that runs the model: the engine core's and each tensor-parallel rank's.
"""

from __future__ import annotations

import torch

LIBRARIES = ("auto", "cublas", "cublaslt")


def resolve(library: str) -> str:
    """The library that "auto" stands for: cuBLASLt."""
    if library not in LIBRARIES:
        raise ValueError(f"blas_library must be one of {', '.join(LIBRARIES)}, got {library!r}")
    return "cublaslt" if library == "auto" else library


def select(library: str, device: torch.device) -> None:
    """Make `library` torch's BLAS front end for this process's CUDA GEMMs (nothing on the CPU)."""
    if device.type == "cuda":
        torch.backends.cuda.preferred_blas_library(resolve(library))
