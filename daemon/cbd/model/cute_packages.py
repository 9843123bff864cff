"""The CuTe DSL kernel packages of the `flash` extra (flash-attn-4, quack-kernels): whether one is present,
an import from it that gives a one-line reason where it fails, and where their compiled kernels are cached.

Both compile kernels at run time and keep them on disk; their caches go under cbd's cache directory. quack
reads its variable once, when it is first imported (FA4 imports it too), so `import_from` sets both first.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Any

import torch

from cbd.model.files import default_cache_dir

MIN_CAPABILITY = (9, 0)  # their Hopper and Blackwell kernels
DTYPES = (torch.bfloat16, torch.float16)


def present(module: str) -> bool:
    """`module` can be found (cheap: a top-level name imports nothing of its package)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing
        return False


def device_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why their kernels cannot run on `device` in `dtype`, or None."""
    if device.type != "cuda":
        return f"it needs CUDA (device {device})"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        return f"it needs compute capability 9.0 or newer (this GPU is {capability[0]}.{capability[1]})"
    if dtype not in DTYPES:
        return f"it needs bfloat16 or float16 (dtype {dtype})"
    return None


def set_cache_dirs() -> None:
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", str(default_cache_dir() / "flash-attn-4"))
    os.environ.setdefault("QUACK_CACHE_DIR", str(default_cache_dir() / "quack"))


def import_from(module: str, name: str, package: str, probe: str | None = None) -> Any | str:
    """`module.name`, or why it cannot be had (one line): the PyPI `package` absent (`probe`, default `module`,
    not found), or the exception its import raised (a broken install, a missing CuTe DSL library)."""
    if not present(probe or module):
        return f"the {package} package is not installed (pip install 'cbd[flash]')"
    set_cache_dirs()
    try:
        return getattr(importlib.import_module(module), name)
    except Exception as exc:  # a reason, not a crash
        return f"{package} failed to import: {type(exc).__name__}: {exc}"
