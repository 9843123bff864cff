"""Shared fixtures: tiny random-weight checkpoints built from a config, and the default model loaded once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cbd.model.loader import LoadedModel, load_model
from daemon_process import DaemonProcess

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


def gpu_available() -> bool:
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):  # type: ignore[no-untyped-def]
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not gpu_available():
            item.add_marker(skip)


TINY_CONFIGS: dict[str, dict] = {
    "llama": dict(model_type="llama"),
    "llama3-rope": dict(
        model_type="llama",
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "mistral": dict(model_type="mistral", sliding_window=None),
    "mistral-window": dict(model_type="mistral", sliding_window=12),
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3", head_dim=32),
}


def build_tiny_checkpoint(directory: Path, kind: str, seed: int = 0, tie: bool = False) -> Path:
    """A 2-layer GQA model with random weights, saved as a HF safetensors checkpoint (no tokenizer)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    overrides = dict(TINY_CONFIGS[kind])
    model_type = overrides.pop("model_type")
    config = AutoConfig.for_model(
        model_type,
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.3, tie_word_embeddings=tie, bos_token_id=0, eos_token_id=1, pad_token_id=1,
        **overrides,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):  # type: ignore[no-untyped-def]
    cache: dict[tuple[str, bool], Path] = {}

    def make(kind: str = "llama", tie: bool = False) -> Path:
        key = (kind, tie)
        if key not in cache:
            cache[key] = build_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny-{kind}"), kind, tie=tie)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_loaded(tiny_checkpoint) -> LoadedModel:  # type: ignore[no-untyped-def]
    return load_model(str(tiny_checkpoint("llama")))


@pytest.fixture(scope="session")
def default_model() -> LoadedModel:
    """The embedded SmolLM2-135M-Instruct with exact (unpacked) fp32 GEMMs: the transformers oracle's twin."""
    return load_model(None)


@pytest.fixture(scope="session")
def default_hf(default_model):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model.checkpoint_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def compiler():  # type: ignore[no-untyped-def]
    """A grammar compiler for the embedded model's tokenizer (the model's weights are not loaded)."""
    from transformers import AutoTokenizer

    from cbd.engine.grammar import GrammarCompiler
    from cbd.model.loader import resolve_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(resolve_checkpoint(None))
    return GrammarCompiler(tokenizer, 49152, (tokenizer.eos_token_id,))


@pytest.fixture()
def tiny_daemon(tiny_checkpoint, tmp_path):  # type: ignore[no-untyped-def]
    """Start real daemons serving the tiny llama checkpoint (flags, env); all are stopped at the end."""

    def start(*flags: str, env: dict[str, str] | None = None) -> DaemonProcess:
        d = DaemonProcess(tmp_path / "cbd.sock", "--model", str(tiny_checkpoint("llama")), *flags, env=env)
        d.wait_serving(120)
        started.append(d)
        return d

    started: list[DaemonProcess] = []
    yield start
    for d in started:
        d.stop()
