"""cbd/model/files.py: whether a checkpoint will bring a tokenizer, told from its files alone."""

from __future__ import annotations

from pathlib import Path

from cbd.model.files import expects_tokenizer


def test_a_tokenizer_is_expected_from_gguf_files_and_directories_that_have_one(tmp_path: Path) -> None:
    weights_only = tmp_path / "weights"
    weights_only.mkdir()
    (weights_only / "config.json").write_text("{}")
    with_tokenizer = tmp_path / "full"
    with_tokenizer.mkdir()
    (with_tokenizer / "tokenizer.json").write_text("{}")
    assert expects_tokenizer(None)  # the embedded default: a GGUF file
    assert expects_tokenizer(str(tmp_path / "model.Q4_1.gguf"))
    assert expects_tokenizer(str(with_tokenizer))
    assert not expects_tokenizer(str(weights_only))
    assert not expects_tokenizer(str(tmp_path / "missing"))
