"""The model config cache (model/model_config.py): what a start reads back from it equals what transformers
gives for the same config.json, for every supported family and RoPE variant; an edited config.json is read
again; a damaged entry is read again (and rewritten), never used."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from cbd.model import model_config
from conftest import TINY_CONFIGS


def _entries(cache: Path) -> list[Path]:
    return sorted((cache / model_config.SUBDIR).glob("*.json"))


@pytest.mark.parametrize("kind", sorted(TINY_CONFIGS))
def test_a_cached_config_equals_the_one_transformers_reads(kind: str, tiny_checkpoint: Callable[..., Path],
                                                          tmp_path: Path) -> None:  # fmt: skip
    directory = tiny_checkpoint(kind)
    want = model_config.from_hf_config(AutoConfig.from_pretrained(directory))
    first = model_config.read_model_config(directory, tmp_path)  # a miss: read by transformers, then written
    assert len(_entries(tmp_path)) == 1
    again = model_config.read_model_config(directory, tmp_path)  # a hit
    for got in (first, again):
        assert got.spec == want.spec and got.eos_token_id == want.eos_token_id and got.rope_scale == want.rope_scale
        assert got.inv_freq.dtype == want.inv_freq.dtype and torch.equal(got.inv_freq, want.inv_freq)


def test_an_edited_config_or_a_damaged_entry_is_read_again(tiny_checkpoint: Callable[..., Path],
                                                           tmp_path: Path) -> None:  # fmt: skip
    source = tiny_checkpoint("llama")
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_bytes((source / "config.json").read_bytes())
    cache = tmp_path / "cache"
    assert model_config.read_model_config(directory, cache).spec.rms_norm_eps == 1e-6
    config = json.loads((directory / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (directory / "config.json").write_text(json.dumps(config))
    assert model_config.read_model_config(directory, cache).spec.rms_norm_eps == 1e-5  # not the old entry
    assert len(_entries(cache)) == 2
    newest = max(_entries(cache), key=lambda p: p.stat().st_mtime_ns)
    newest.write_text('{"spec": {"model_type": "llama"}}')  # damaged: fields missing
    assert model_config.read_model_config(directory, cache).spec.rms_norm_eps == 1e-5
    assert json.loads(newest.read_text())["spec"]["rms_norm_eps"] == 1e-5  # written again, whole
