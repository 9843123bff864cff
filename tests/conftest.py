"""Shared fixtures: tiny random-weight checkpoints built from a config, and the default model loaded once."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from cbd.model.loader import LoadedModel, load_model
from daemon_process import DaemonFactory, DaemonProcess, serving

MAX_WORKERS = 4  # each worker may hold the default model twice and start daemons: memory, not cores, bounds it


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto` (pyproject.toml): a worker per core this process may use, at most MAX_WORKERS."""
    return max(1, min(MAX_WORKERS, len(os.sched_getaffinity(0))))


# The in-process engines' intra-op threads: the cores shared out between the workers (at most 2 each).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, len(os.sched_getaffinity(0)) // _WORKERS, torch.get_num_threads())))


def pytest_configure(config: pytest.Config) -> None:
    """The daemons the tests start get a worker's share of the cores too: their `num_threads` 0 would take
    every core, and their OpenMP workers spin, so a daemon beside a busy worker ran several times slower
    until it adapted. Set in each worker (or the one process of a run without workers), not in the
    controller, whose environment the workers inherit; a test's own `--num-threads` still wins (flags over
    the environment), and so does a CBD_NUM_THREADS given to pytest."""
    if hasattr(config, "workerinput") or not config.getoption("numprocesses", None):
        os.environ.setdefault("CBD_NUM_THREADS", str(torch.get_num_threads()))


def gpu_available() -> bool:
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None and not gpu_available():
            item.add_marker(skip)
    # The workers take whole files in this order (pyproject.toml's addopts): the files marked `first`, which
    # take minutes, go before the rest, so that none is taken last while the other workers have run dry.
    items.sort(key=lambda item: item.get_closest_marker("first") is None)


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
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    cache: dict[tuple[str, bool], Path] = {}

    def make(kind: str = "llama", tie: bool = False) -> Path:
        key = (kind, tie)
        if key not in cache:
            cache[key] = build_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny-{kind}"), kind, tie=tie)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_loaded(tiny_checkpoint: Callable[..., Path]) -> LoadedModel:
    return load_model(str(tiny_checkpoint("llama")))


@pytest.fixture(scope="session")
def default_model() -> LoadedModel:
    """The embedded SmolLM2-135M-Instruct with exact (unpacked) fp32 GEMMs: the transformers oracle's twin."""
    return load_model(None)


@pytest.fixture(scope="session")
def default_hf(default_model: LoadedModel) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model.checkpoint_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def compiler() -> Any:
    """A grammar compiler for the embedded model's tokenizer (the model's weights are not loaded)."""
    from transformers import AutoTokenizer

    from cbd.engine.grammar.matcher import GrammarCompiler
    from cbd.model.loader import resolve_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(resolve_checkpoint(None))
    return GrammarCompiler(tokenizer, 49152, (tokenizer.eos_token_id,))


@pytest.fixture()
def tiny_daemon(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> Iterator[DaemonFactory]:
    """Start real daemons serving the tiny llama checkpoint (flags, env, socket_name); all are stopped at the end."""
    factory = DaemonFactory(tmp_path, str(tiny_checkpoint("llama")))
    yield factory
    factory.stop_all()


@pytest.fixture(scope="session")
def shared_tiny_daemon(
    tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DaemonProcess]:
    """One daemon on the tiny llama checkpoint with the default flags, shared by every test that only calls it."""
    with serving(tmp_path_factory.mktemp("shared-tiny"), model=str(tiny_checkpoint("llama"))) as d:
        yield d


MiB = 1 << 20
SHARED_DAEMON_FLAGS = ("--max-message-bytes", str(64 * MiB))


@pytest.fixture(scope="session")
def shared_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """One daemon on the embedded default model, shared by the whole run (one per test worker): every test
    that only calls it (no flags of its own, no auth, nothing killed or restarted). Its gRPC message limit is
    64 MiB, so that a prompt's own bound (not the message size) is what refuses big prompts
    (tests/daemon/test_prompt_bounds.py)."""
    with serving(tmp_path_factory.mktemp("shared-default"), *SHARED_DAEMON_FLAGS) as d:
        yield d


@pytest.fixture(scope="session")
def tenant_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """The default model behind two bearer tokens (two tenants, gateway_stack.TOKEN and OTHER_TOKEN), shared by
    the agent-API modules: each puts its own gateway (and state directory) in front of it."""
    from gateway_stack import start_daemon

    tmp = tmp_path_factory.mktemp("shared-tenants")
    d = start_daemon(tmp)
    try:
        d.wait_serving()
        yield d
    finally:
        assert d.stop() == 0, d.log()[-4000:]
