"""ModelSpec: the few numbers the Llama-family model needs, read once from a HF config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from cbd.errors import UnsupportedModel

# model_type -> whether q/k get a per-head RMSNorm before RoPE (Qwen3).
SUPPORTED_MODEL_TYPES: dict[str, bool] = {
    "llama": False,
    "mistral": False,
    "qwen2": False,
    "qwen3": True,
}
# RoPE variants whose inverse frequencies are position-independent (static tables are exact).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    sliding_window: int | None
    rope_type: str
    rope_theta: float

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def spec_from_hf_config(config: Any) -> ModelSpec:
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModel(
            f"architecture {model_type!r} is not supported; supported model types: "
            f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))} (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM2)"
        )
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"hidden_act {config.hidden_act!r} is not supported; only 'silu' (SwiGLU)")
    rope_type, rope_theta = rope_params(config)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModel(f"rope type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    qkv_bias = bool(getattr(config, "attention_bias", False)) or model_type == "qwen2"
    window = getattr(config, "sliding_window", None)
    if model_type in ("qwen2", "qwen3") and not getattr(config, "use_sliding_window", False):
        window = None
    return ModelSpec(
        model_type=model_type,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        rms_norm_eps=config.rms_norm_eps,
        qkv_bias=qkv_bias,
        o_bias=bool(getattr(config, "attention_bias", False)) and model_type in ("llama", "qwen3"),
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        qk_norm=SUPPORTED_MODEL_TYPES[model_type],
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        max_position_embeddings=config.max_position_embeddings,
        sliding_window=window,
        rope_type=rope_type,
        rope_theta=rope_theta,
    )


def rope_params(config: Any) -> tuple[str, float]:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    return rope_type, float(theta)


def rope_inv_freq(config: Any, spec: ModelSpec) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] and the cos/sin scale, computed as transformers does."""
    if spec.rope_type == "default":
        exponents = torch.arange(0, spec.head_dim, 2, dtype=torch.int64).float() / spec.head_dim
        return 1.0 / (spec.rope_theta**exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[spec.rope_type](config, torch.device("cpu"))
