"""The fused SwiGLU GEMM on the GPU (quack-kernels, sm90+): its product against the unfused form and a float64
reference, and the engine's greedy tokens with it on and off."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from cbd.model import swiglu_gemm


def _usable() -> bool:
    if not torch.cuda.is_available():
        return False
    return swiglu_gemm.unusable_reason(torch.device("cuda"), torch.bfloat16, 64, 256, False) is None


needs_quack = pytest.mark.skipif(not _usable(), reason="needs CUDA (sm90+) and quack-kernels")


@pytest.mark.gpu
@needs_quack
@pytest.mark.parametrize("hidden, inter", [(4096, 14336), (576, 1536), (64, 136)])
@pytest.mark.parametrize("rows", [1024, 1500, 4097])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_equals_the_unfused_form_and_is_nearer_a_float64_reference(hidden, inter, rows, dtype) -> None:
    from cbd.model import ops

    torch.manual_seed(rows + hidden)
    fused = swiglu_gemm.load()
    assert not isinstance(fused, str)
    x = torch.randn(rows, hidden, device="cuda", dtype=dtype)
    weight = (torch.randn(2 * inter, hidden, device="cuda") * hidden**-0.5).to(dtype)
    gate, up = (x.double() @ weight.double().T).chunk(2, dim=-1)
    reference = F.silu(gate) * up
    unfused = ops.silu_mul(F.linear(x, weight))
    out = fused(x, weight)
    assert out.shape == (rows, inter) and out.dtype == dtype
    err_fused = (out.double() - reference).abs().max().item()
    err_unfused = (unfused.double() - reference).abs().max().item()
    scale = reference.abs().max().item()
    assert err_fused <= max(err_unfused, 1e-3 * scale), (err_fused, err_unfused, scale)
    torch.testing.assert_close(out, unfused, rtol=2e-2, atol=2e-2 * scale)


@pytest.mark.gpu
@needs_quack
def test_engine_greedy_fused_equals_unfused_in_bf16(tiny_checkpoint) -> None:
    """Steps of 1024+ rows (eight prompts prefilled in one step) take the fused GEMM: token-exact, or the first
    divergence a near-tie under both (the gap re-measured on the prefix alone, a step under 1024 rows: unfused)."""
    from cbd.model.loader import load_model
    from helpers import assert_bf16_engines_agree, make_core

    loaded = {
        mode: load_model(str(tiny_checkpoint("llama")), device="cuda", dtype=torch.bfloat16) for mode in ("on", "off")
    }
    cores = {
        mode: make_core(loaded[mode], device="cuda", dtype="bfloat16", block_size=16, max_num_batched_tokens=2048,
                        fused_swiglu=mode, enable_prefix_caching=False)
        for mode in ("on", "off")
    }  # fmt: skip
    assert all(layer.mlp.swiglu is not None for layer in loaded["on"].model.layers)
    assert all(layer.mlp.swiglu is None for layer in loaded["off"].model.layers)
    calls: list[int] = []
    fused = loaded["on"].model.layers[0].mlp.swiglu
    loaded["on"].model.layers[0].mlp.swiglu = lambda x, w: (calls.append(x.shape[0]), fused(x, w))[1]
    rng = random.Random(11)
    prompts = [[rng.randrange(2, 256) for _ in range(rng.randrange(140, 300))] for _ in range(8)]
    assert sum(map(len, prompts)) >= swiglu_gemm.MIN_ROWS
    assert_bf16_engines_agree(cores, prompts)
    assert calls, "no step of 1024+ rows took the fused GEMM"


@pytest.mark.gpu
@needs_quack
def test_cuda_graphs_keep_the_unfused_form() -> None:
    """A graph of 1024+ rows captures cuBLAS and the SiLU-mul kernel; the same step run eagerly takes the
    fused GEMM, and the two agree."""
    import dataclasses

    from cbd.model.llama import MLP
    from cbd.model.spec import ModelSpec

    fields = {f.name: 0 for f in dataclasses.fields(ModelSpec)}
    spec = ModelSpec(**{**fields, "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                        "rms_norm_eps": 1e-5, "qkv_bias": False, "o_bias": False, "mlp_bias": False,
                        "qk_norm": False, "tie_word_embeddings": False, "sliding_window": None,
                        "rope_type": "default", "rope_theta": 1e4})  # fmt: skip
    mlp = MLP(spec).to("cuda", torch.bfloat16)
    fused = swiglu_gemm.load()
    assert not isinstance(fused, str)
    calls: list[int] = []
    counting = lambda x, w: (calls.append(x.shape[0]), fused(x, w))[1]  # noqa: E731
    x = torch.randn(swiglu_gemm.MIN_ROWS + 8, 64, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.inference_mode(), torch.cuda.stream(side):  # both forms' kernels loaded outside the capture
        mlp(x)
        mlp.swiglu = counting
        mlp(x)
    torch.cuda.current_stream().wait_stream(side)
    assert calls == [x.shape[0]]
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph):
        captured = mlp(x)
    graph.replay()
    torch.cuda.synchronize()
    assert calls == [x.shape[0]], "the capture took the fused GEMM"
    with torch.inference_mode():
        eager = mlp(x)
    assert calls == [x.shape[0]] * 2
    torch.testing.assert_close(captured, eager, rtol=2e-2, atol=2e-2)
