"""The MLP's fused SwiGLU GEMM: its setting, its choice on the CPU (never), and which steps it serves."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from cbd.errors import UnsupportedModel
from cbd.model import swiglu_gemm
from cbd.model.llama import MLP, CausalLM
from cbd.model.spec import ModelSpec
from cbd.server.settings import load_settings

SPEC = ModelSpec(
    model_type="llama", vocab_size=64, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=2,
    num_kv_heads=1, head_dim=8, rms_norm_eps=1e-5, qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False,
    tie_word_embeddings=False, max_position_embeddings=64, sliding_window=None, rope_type="default",
    rope_theta=10000.0,
)  # fmt: skip


def test_the_setting_takes_auto_on_off(monkeypatch) -> None:
    monkeypatch.delenv("CBD_FUSED_SWIGLU", raising=False)
    assert load_settings(["serve"])[0].fused_swiglu == "auto"
    assert load_settings(["serve", "--fused-swiglu", "off"])[0].fused_swiglu == "off"
    with pytest.raises(ValueError, match="fused_swiglu must be 'auto', 'on' or 'off'"):
        load_settings(["serve", "--fused-swiglu", "maybe"])


def test_auto_on_the_cpu_keeps_the_unfused_form_and_says_why(caplog) -> None:
    model = CausalLM(SPEC)
    with caplog.at_level(logging.INFO, logger="cbd.model.swiglu_gemm"):
        assert swiglu_gemm.install("auto", model) is None
    assert all(layer.mlp.swiglu is None for layer in model.layers)
    line = caplog.records[-1].getMessage()
    assert "unfused" in line and "it needs CUDA" in line, line


def test_on_where_it_cannot_run_is_a_configuration_error() -> None:
    with pytest.raises(UnsupportedModel, match="fused_swiglu on .* cannot run: it needs CUDA"):
        swiglu_gemm.install("on", CausalLM(SPEC))
    with pytest.raises(ValueError, match="fused_swiglu must be one of"):
        swiglu_gemm.install("yes", CausalLM(SPEC))


def test_what_the_fused_gemm_needs_besides_the_package(monkeypatch) -> None:
    """The checks before any import, in order; the device's capability stands in for a GPU's."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "compute capability 9.0" in str(swiglu_gemm.unusable_reason(cuda, torch.bfloat16, 64, 256, False))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert "bfloat16 or float16" in str(swiglu_gemm.unusable_reason(cuda, torch.float32, 64, 256, False))
    assert "biases" in str(swiglu_gemm.unusable_reason(cuda, torch.bfloat16, 64, 256, True))
    assert "multiples of 8" in str(swiglu_gemm.unusable_reason(cuda, torch.bfloat16, 64, 2 * 100 + 4, False))
    assert "multiples of 8" in str(swiglu_gemm.unusable_reason(cuda, torch.bfloat16, 60, 256, False))
    loaded = swiglu_gemm.load()
    expected = None if not isinstance(loaded, str) else loaded
    assert swiglu_gemm.unusable_reason(cuda, torch.float16, 64, 256, False) == expected


@pytest.mark.skipif(swiglu_gemm.installed(), reason="quack-kernels is installed here")
def test_without_the_package_load_says_how_to_install_it() -> None:
    reason = swiglu_gemm.load()
    assert isinstance(reason, str) and "quack-kernels" in reason and "cbd[flash]" in reason


def test_steps_of_min_rows_or_more_take_the_fused_gemm_and_fewer_the_unfused_form() -> None:
    """The fused GEMM stands in here as a plain-torch one (silu(x Wg) * x Wu, in float64): the MLP's output
    is the same either way, and only steps of MIN_ROWS rows or more call it."""
    torch.manual_seed(0)
    mlp = MLP(SPEC)
    calls: list[int] = []

    def fused(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        gate, up = weight.double().chunk(2, dim=0)
        return (F.silu(x.double() @ gate.T) * (x.double() @ up.T)).to(x.dtype)

    for rows in (1, swiglu_gemm.MIN_ROWS - 1, swiglu_gemm.MIN_ROWS, swiglu_gemm.MIN_ROWS + 37):
        x = torch.randn(rows, SPEC.hidden_size)
        mlp.swiglu = None
        unfused = mlp(x)
        mlp.swiglu = fused
        torch.testing.assert_close(mlp(x), unfused, rtol=1e-5, atol=1e-5)
    assert calls == [swiglu_gemm.MIN_ROWS, swiglu_gemm.MIN_ROWS + 37]
