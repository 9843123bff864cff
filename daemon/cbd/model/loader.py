"""Find a checkpoint (HF directory, GGUF file, or the embedded default), convert GGUF once, load it.

A GGUF file is dequantised by transformers on first use and cached as a plain HF directory
(config.json + model.safetensors + tokenizer files) under the cache dir, keyed by the file's path,
size and mtime, so later loads read safetensors directly and take seconds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cbd.model.files import default_cache_dir, default_gguf_path, load_tokenizer
from cbd.model.llama import CausalLM
from cbd.model.model_config import ModelConfig, from_hf_config, read_model_config
from cbd.model.packed_linear import pack_linears, packing_available
from cbd.model.spec import ModelSpec
from cbd.model.tensor_parallel import TensorParallel, local_spec, shard_of, shard_tensor
from cbd.model.weights import copy_weights, load_weights

log = logging.getLogger(__name__)

PROGRESS_SECONDS = 10.0  # a first start's conversion logs that it is still working this often


@dataclass(slots=True)
class LoadedModel:
    model: CausalLM
    spec: ModelSpec
    tokenizer: Any | None  # a transformers tokenizer, or None for a weights-only checkpoint
    eos_token_ids: tuple[int, ...]
    checkpoint_dir: Path
    name: str


def display_name(model: str | None) -> str:
    """SmolLM2-135M-Instruct.Q4_1 for the default; else the file's stem or the directory's name."""
    path = default_gguf_path() if model is None else Path(model).expanduser()
    return path.stem if path.suffix == ".gguf" else path.resolve().name


def resolve_checkpoint(model: str | None, cache_dir: str | None = None) -> Path:
    """Return a HF checkpoint directory for `model`, converting a GGUF file on first use."""
    source = default_gguf_path() if model is None else Path(model).expanduser()
    if source.is_dir():
        if not (source / "config.json").exists():
            raise FileNotFoundError(f"{source} is not a HF checkpoint directory (no config.json)")
        return source
    if source.suffix == ".gguf" and source.is_file():
        return convert_gguf(source, Path(cache_dir) if cache_dir else default_cache_dir())
    raise FileNotFoundError(f"model {str(source)!r} is neither a checkpoint directory nor a .gguf file")


def convert_gguf(gguf: Path, cache_root: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_root / f"{gguf.stem}-{key}"
    if (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s (first load, ~1 min on 2 cores); cached at %s", gguf.name, target)
    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=cache_root))
    progress = _Progress(gguf.name)
    try:
        progress.phase("reading the tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        progress.phase("dequantizing the weights")
        hf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        progress.phase("writing the checkpoint")
        _save_plain(hf_model, tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.replace(tmp, target)  # atomic: a crash mid-way never leaves a half cache entry
        except OSError:
            if not (target / "config.json").exists():
                raise
            # Another process (a second replica starting at once) converted the same file first: use its entry.
    finally:
        progress.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted %s in %.0f s", gguf.name, time.monotonic() - progress.start)
    return target


class _Progress:
    """Logs the conversion's phase when it starts and every PROGRESS_SECONDS while it lasts, so a terminal
    (or a log) shows a first start working rather than hung."""

    def __init__(self, name: str) -> None:
        self.name, self.start, self._phase = name, time.monotonic(), ""
        self._done = threading.Event()
        threading.Thread(target=self._beat, name="cbd-convert-progress", daemon=True).start()

    def phase(self, phase: str) -> None:
        self._phase = phase
        log.info("converting %s: %s (%.0f s so far)", self.name, phase, time.monotonic() - self.start)

    def _beat(self) -> None:
        while not self._done.wait(PROGRESS_SECONDS):
            log.info("converting %s: still %s (%.0f s so far)", self.name, self._phase, time.monotonic() - self.start)

    def stop(self) -> None:
        self._done.set()


def _save_plain(hf_model: Any, directory: Path) -> None:
    from safetensors.torch import save_file

    config = hf_model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(hf_model).__name__]
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    hf_model.generation_config.to_json_file(directory / "generation_config.json")
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    if getattr(hf_model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})


def load_model(
    model: str | None = None,
    cache_dir: str | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    max_positions: int | None = None,
    pack_cpu_gemm: bool = False,
    tensor_parallel: tuple[int, int] | None = None,
) -> LoadedModel:
    """tensor_parallel=(rank, world): build and fill only this rank's shard (see tensor_parallel.py);
    the returned spec stays the full model's, the network's is the local one."""
    directory = resolve_checkpoint(model, cache_dir)
    config = read_model_config(directory, Path(cache_dir) if cache_dir else default_cache_dir())
    spec = config.spec
    shard = shard_of(spec, *tensor_parallel) if tensor_parallel and tensor_parallel[1] > 1 else None
    net = _empty_network(local_spec(spec, shard) if shard else spec, device, dtype)
    transform = None if shard is None else (lambda name, t: shard_tensor(name, t, spec, shard))
    load_weights(net, directory, transform)
    _finish_network(net, config, max_positions)
    if pack_cpu_gemm and torch.device(device).type == "cpu" and dtype == torch.float32 and packing_available():
        pack_linears(net)
    if shard is not None:
        net.set_tensor_parallel(TensorParallel(shard), spec.vocab_size)
    tokenizer = load_tokenizer(directory)
    return LoadedModel(
        model=net,
        spec=spec,
        tokenizer=tokenizer,
        eos_token_ids=_eos_ids(directory, config.eos_token_id, tokenizer),
        checkpoint_dir=directory,
        name=display_name(model),
    )


def model_from_hf(
    hf_model: Any, device: torch.device | str, dtype: torch.dtype, max_positions: int | None = None
) -> LoadedModel:
    """Build the engine's model from a live transformers model (benchmarks and tests; no tokenizer)."""
    config = from_hf_config(hf_model.config)
    spec = config.spec
    net = _empty_network(spec, device, dtype)
    copy_weights(net, hf_model.state_dict().items())
    _finish_network(net, config, max_positions)
    eos = config.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return LoadedModel(net, spec, None, eos_ids, Path("."), type(hf_model).__name__)


def _empty_network(spec: ModelSpec, device: torch.device | str, dtype: torch.dtype) -> CausalLM:
    """The network with uninitialised weights on `device`: built on the meta device (no init cost), then
    each tensor given storage by `torch.empty` (Module.to_empty runs meta kernels that import sympy: half
    a second of a start); floating-point tensors in `dtype`."""
    with torch.device("meta"):
        net = CausalLM(spec)
    for module in net.modules():
        for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            kind = dtype if tensor.is_floating_point() else tensor.dtype
            empty = torch.empty(tensor.shape, device=device, dtype=kind)
            setattr(
                module, name, nn.Parameter(empty, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty
            )
    if spec.tie_word_embeddings:
        net.lm_head.weight = net.embed_tokens.weight
    return net


def _finish_network(net: CausalLM, config: ModelConfig, max_positions: int | None) -> None:
    net.set_rope(config.inv_freq, config.rope_scale, max_positions or config.spec.max_position_embeddings)
    net.eval()


def _eos_ids(directory: Path, config_eos: Any, tokenizer: Any | None) -> tuple[int, ...]:
    ids: list[int] = []

    def add(value: Any) -> None:
        if isinstance(value, int):
            ids.append(value)
        elif isinstance(value, (list, tuple)):
            ids.extend(v for v in value if isinstance(v, int))

    gen = directory / "generation_config.json"
    if gen.exists():
        add(json.loads(gen.read_text()).get("eos_token_id"))
    add(config_eos)
    if tokenizer is not None:
        add(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(ids))
