"""The model config cache (model/model_config.py): what a start reads back from it equals what transformers
gives for the same config.json, for every tiny family (default and llama3 RoPE) and the linear and YaRN
RoPE variants; an edited config.json is read again; a damaged entry is read again (and rewritten), never
used."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from cbd.model import model_config
from conftest import TINY_CONFIGS

ROPE_VARIANTS = {
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "rope_theta": 10000.0},
}


def _entries(cache: Path) -> list[Path]:
    return sorted((cache / model_config.SUBDIR).glob("*.json"))


def _assert_cached_equals_transformers(directory: Path, cache: Path) -> model_config.ModelConfig:
    want = model_config.from_hf_config(AutoConfig.from_pretrained(directory))
    first = model_config.read_model_config(directory, cache)  # a miss: read by transformers, then written
    assert len(_entries(cache)) == 1
    again = model_config.read_model_config(directory, cache)  # a hit
    for got in (first, again):
        assert got.spec == want.spec and got.eos_token_id == want.eos_token_id and got.rope_scale == want.rope_scale
        assert got.inv_freq.dtype == want.inv_freq.dtype and torch.equal(got.inv_freq, want.inv_freq)
    return again


@pytest.mark.parametrize("kind", sorted(TINY_CONFIGS))
def test_a_cached_config_equals_the_one_transformers_reads(kind: str, tiny_checkpoint: Callable[..., Path],
                                                          tmp_path: Path) -> None:  # fmt: skip
    _assert_cached_equals_transformers(tiny_checkpoint(kind), tmp_path)


@pytest.mark.parametrize("variant", sorted(ROPE_VARIANTS))
def test_a_cached_rope_variant_equals_the_one_transformers_reads(variant: str, tiny_checkpoint: Callable[..., Path],
                                                                tmp_path: Path) -> None:  # fmt: skip
    config = json.loads((tiny_checkpoint("llama") / "config.json").read_text())
    config["rope_parameters"] = ROPE_VARIANTS[variant]
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    got = _assert_cached_equals_transformers(directory, tmp_path / "cache")
    assert got.spec.rope_type == variant
    if variant == "yarn":
        assert got.rope_scale != 1.0  # YaRN's attention factor came through the cache


def test_an_edited_config_or_a_damaged_entry_is_read_again(tiny_checkpoint: Callable[..., Path],
                                                           tmp_path: Path) -> None:  # fmt: skip
    source = tiny_checkpoint("llama")
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_bytes((source / "config.json").read_bytes())
    cache = tmp_path / "cache"
    assert model_config.read_model_config(directory, cache).spec.rms_norm_eps == 1e-6
    (first_entry,) = _entries(cache)
    config = json.loads((directory / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (directory / "config.json").write_text(json.dumps(config))
    assert model_config.read_model_config(directory, cache).spec.rms_norm_eps == 1e-5  # not the old entry
    assert len(_entries(cache)) == 2
    (newest,) = set(_entries(cache)) - {first_entry}
    newest.write_text('{"spec": {"model_type": "llama"}}')  # damaged: fields missing
    assert model_config.read_model_config(directory, cache).spec.rms_norm_eps == 1e-5
    assert json.loads(newest.read_text())["spec"]["rms_norm_eps"] == 1e-5  # written again, whole
