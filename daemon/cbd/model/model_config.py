"""A checkpoint's config.json read into what the engine builds from: the ModelSpec, the RoPE table and the
config's EOS ids; kept in the cache directory by the file's content, so that a start need not import
transformers' model classes (over a second of CPU, most of an engine process's start on a small model).

transformers reads the file on a miss (its config classes own the defaults and the RoPE variants); what it
gave is written beside the cache's other entries (`model-configs/<key>.json`, atomically) and read back as
it was. The key covers the file's bytes, the transformers and torch releases, and the source of the code
that derives these values from it (this module and spec.py), so a change to any of them reads the file
again. A cache directory that cannot be written only costs the next start that import.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cbd.model import spec as spec_module
from cbd.model.spec import ModelSpec, rope_inv_freq, spec_from_hf_config

log = logging.getLogger(__name__)

SUBDIR = "model-configs"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    spec: ModelSpec
    inv_freq: torch.Tensor  # [head_dim // 2], RoPE's inverse frequencies as transformers computes them
    rope_scale: float  # the cos/sin scale of the RoPE variant (1.0 but for YaRN)
    eos_token_id: Any  # the config's eos_token_id: an int, a list of ints or None


def from_hf_config(hf_config: Any) -> ModelConfig:
    """From a live transformers config (raises UnsupportedModel for what the engine cannot run)."""
    spec = spec_from_hf_config(hf_config)
    inv_freq, scale = rope_inv_freq(hf_config, spec)
    return ModelConfig(spec, inv_freq, float(scale), getattr(hf_config, "eos_token_id", None))


def read_model_config(directory: Path, cache_root: Path) -> ModelConfig:
    """The checkpoint's config, from the cache when its entry for this file's content exists."""
    entry = cache_root / SUBDIR / f"{_key((directory / 'config.json').read_bytes())}.json"
    cached = _read(entry)
    if cached is not None:
        return cached
    from transformers import AutoConfig

    config = from_hf_config(AutoConfig.from_pretrained(directory))
    _write(entry, config)
    return config


def _key(config_bytes: bytes) -> str:
    digest = hashlib.sha256(config_bytes)
    digest.update(f"{importlib.metadata.version('transformers')}|{torch.__version__}".encode())
    for source in (Path(__file__), Path(spec_module.__file__ or "")):
        digest.update(source.read_bytes())
    return digest.hexdigest()[:32]


def _read(entry: Path) -> ModelConfig | None:
    try:
        data = json.loads(entry.read_text())
        return ModelConfig(
            ModelSpec(**data["spec"]),
            torch.tensor(data["inv_freq"], dtype=getattr(torch, data["inv_freq_dtype"])),
            float(data["rope_scale"]),
            data["eos_token_id"],
        )
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("model config cache entry %s unreadable (%s): reading config.json again", entry, exc)
        return None


def _write(entry: Path, config: ModelConfig) -> None:
    data = {
        "spec": dataclasses.asdict(config.spec),
        "inv_freq": config.inv_freq.tolist(),
        "inv_freq_dtype": str(config.inv_freq.dtype).removeprefix("torch."),
        "rope_scale": config.rope_scale,
        "eos_token_id": config.eos_token_id,
    }
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".", suffix=".tmp", dir=entry.parent)
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump(data, fh)
            os.replace(tmp, entry)  # atomic: a reader sees a whole entry or none
        except BaseException:
            os.unlink(tmp)
            raise
    except (OSError, TypeError, ValueError) as exc:
        log.info("model config not cached (%s): the next start reads config.json again", exc)
