"""The MLP's gate|up GEMM with SiLU(gate) * up in its epilogue, for prefill-sized steps on Hopper and newer.

Unfused, a step of T rows writes the GEMM's [T, 2I] output and a second kernel reads it back; at the 8B shape
(I = 14336) that is ~0.94 GB of traffic per layer of an 8K-token chunk. quack's CuTe DSL GEMMs
(`quack-kernels`, a dependency of flash-attn-4: the `flash` extra installs it) apply the gated activation in
the epilogue and read the weight as stored, `[gate; up]` rows (`concat_layout`). On an H100 (8B shape, bf16)
it took 0.62 ms against cuBLASLt + the Triton SiLU-mul's 0.68 at 2048 rows, 2.68 against 2.90 at 8192; it lost
at 256 rows (0.120 against 0.116), was within noise at 512 and won from 1024 (4%): hence `MIN_ROWS`. Smaller
steps (decode and verifying steps) keep the unfused form, and so do CUDA graphs whatever their size. The
epilogue applies SiLU to the fp32 accumulator, not to a bf16-rounded one: its result was nearer a float64
reference (max error 0.031 against 0.100 at 2048 rows).

One kernel serves every row count (the M extent is dynamic); `install` compiles it before the engine reports
SERVING (~2 s cold; quack keeps compiled kernels under cbd's cache directory).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from cbd.errors import UnsupportedModel
from cbd.model import cute_packages

if TYPE_CHECKING:
    from cbd.model.llama import CausalLM

MODES = ("auto", "on", "off")
MIN_ROWS = 1024  # rows of a step from which the fused GEMM runs (it won from 1024 on an H100)

log = logging.getLogger(__name__)

SwiGLU = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x [T, H], gate|up weight [2I, H]) -> [T, I]


def installed() -> bool:
    return cute_packages.present("quack")


@functools.cache
def load() -> SwiGLU | str:
    """The fused GEMM, or why it cannot be imported (one line)."""
    gemm_act = cute_packages.import_from("quack.gemm_interface", "gemm_act", "quack-kernels", probe="quack")
    if isinstance(gemm_act, str):
        return gemm_act

    def swiglu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # weight.T is (H, 2I) with [gate; up] along its non-contiguous dim: concat_layout B.
        return gemm_act(x, weight.T, activation="swiglu", store_preact=False, tuned=False, concat_layout=("B",))[1]

    return swiglu


def unusable_reason(
    device: torch.device, dtype: torch.dtype, in_features: int, out_features: int, has_bias: bool
) -> str | None:
    """Why the fused GEMM cannot serve an MLP whose gate|up projection is in_features -> out_features (= 2I), or
    None (imports quack, once)."""
    reason = cute_packages.device_reason(device, dtype)
    if reason is not None:
        return reason
    if has_bias:
        return "the model's MLP has biases"
    if out_features % 16 or in_features % 8:  # 16-byte rows for the loads, both halves alike
        return f"it needs the MLP's sizes in multiples of 8 (gate|up {in_features} -> {out_features})"
    loaded = load()
    return loaded if isinstance(loaded, str) else None


def install(mode: str, model: CausalLM) -> SwiGLU | None:
    """Resolve `mode` for this model, log the choice, and give every MLP the fused GEMM (compiled here) or
    None. auto: where it can run; on: the same, or UnsupportedModel saying why not; off: never."""
    from cbd.model.llama import MLP

    if mode not in MODES:
        raise ValueError(f"fused_swiglu must be one of {', '.join(MODES)}, got {mode!r}")
    mlps = [m for m in model.modules() if isinstance(m, MLP)]
    if not mlps:
        return None
    gate_up = mlps[0].gate_up_proj  # an nn.Linear (a PackedLinear on the CPU): in/out_features, bias
    device, dtype = model.embed_tokens.weight.device, model.embed_tokens.weight.dtype
    reason = (
        "switched off"
        if mode == "off"
        else unusable_reason(device, dtype, gate_up.in_features, gate_up.out_features, gate_up.bias is not None)
    )
    fused = None if reason is not None else load()
    assert not isinstance(fused, str)
    if fused is not None:
        try:  # compile the one kernel before any request needs it
            with torch.inference_mode():
                fused(torch.zeros(MIN_ROWS, gate_up.in_features, dtype=dtype, device=device), gate_up.weight)
        except Exception as exc:  # a kernel that does not build here is a reason, as a missing package is
            reason, fused = f"its kernel failed to build: {type(exc).__name__}: {str(exc)[:200]}", None
    if mode == "on" and reason is not None:
        raise UnsupportedModel(f"fused_swiglu on (quack's GEMM with a SwiGLU epilogue) cannot run: {reason}")
    for mlp in mlps:
        mlp.swiglu = fused
    how = "chosen by auto" if mode == "auto" else "requested"
    if fused is None:
        log.info("MLP gate|up GEMM: unfused (%s; then a SiLU-mul kernel), not quack's fused epilogue: %s", how, reason)
        return None
    log.info(
        "MLP gate|up GEMM: quack's with SiLU-mul in its epilogue (%s), for steps of %d rows or more", how, MIN_ROWS
    )
    return fused
