"""Copy a HF safetensors checkpoint into CausalLM, fusing q/k/v and gate/up on the way."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from cbd.model.llama import CausalLM

# checkpoint name suffix -> (our parameter suffix, shard index within the fused parameter)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def checkpoint_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / n for n in names]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {directory}")
    return files


def load_weights(
    model: CausalLM, directory: Path, transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None
) -> None:
    """Fill every parameter of `model` from the checkpoint; unknown or missing tensors are errors.
    `transform(name, tensor)` may cut each tensor first (a tensor-parallel shard)."""

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for path in checkpoint_files(directory):
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    tensor = f.get_tensor(name)
                    yield name, tensor if transform is None else transform(name, tensor)

    copy_weights(model, tensors())


def copy_weights(model: CausalLM, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Fill every parameter of `model` from HF-named tensors (a checkpoint's, or a live model's state)."""
    spec = model.spec
    params = dict(model.named_parameters(remove_duplicate=False))
    shard_sizes = {
        "self_attn.qkv_proj": [spec.q_size, spec.kv_size, spec.kv_size],
        "mlp.gate_up_proj": [spec.intermediate_size, spec.intermediate_size],
    }
    filled: set[str] = set()
    for name, tensor in named_tensors:
        if _IGNORED.match(name) or (spec.tie_word_embeddings and name == "lm_head.weight"):
            continue
        target, rows = _target(name, shard_sizes)
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in the {spec.model_type} model")
        param = params[target]
        dest = param.data if rows is None else param.data[rows[0] : rows[1]]
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(dest.shape)}")
        dest.copy_(tensor.to(dtype=dest.dtype))
        filled.add(target if rows is None else f"{target}[{rows[0]}]")
    if spec.tie_word_embeddings:
        filled.add("lm_head.weight")
    missing = [n for n in _expected_keys(params, shard_sizes) if n not in filled]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:4]}")


def _target(name: str, shard_sizes: dict[str, list[int]]) -> tuple[str, tuple[int, int] | None]:
    if name.startswith("model.") and not _LAYER.match(name):
        return name.removeprefix("model."), None
    m = _LAYER.match(name)
    if m is None:
        return name, None
    layer, module, kind = m.groups()
    if module not in _FUSED:
        return f"layers.{layer}.{module}.{kind}", None
    fused, shard = _FUSED[module]
    sizes = shard_sizes[fused]
    start = sum(sizes[:shard])
    return f"layers.{layer}.{fused}.{kind}", (start, start + sizes[shard])


def _expected_keys(params: dict[str, torch.nn.Parameter], shard_sizes: dict[str, list[int]]) -> list[str]:
    keys = []
    for name in params:
        fused = next((f for f in shard_sizes if f".{f}." in name), None)
        if fused is None:
            keys.append(name)
            continue
        offsets = [sum(shard_sizes[fused][:i]) for i in range(len(shard_sizes[fused]))]
        keys.extend(f"{name}[{o}]" for o in offsets)
    return keys
