"""Start-up checks that turn a doomed start into one clear line and exit status 78 (EX_CONFIG).

They run before the daemon binds anything, so a failed start leaves no socket or pid file behind, and
systemd (RestartPreventExitStatus=78) does not restart it in a loop.
"""

from __future__ import annotations

import grp
import json
from pathlib import Path

from cbd.config import EngineConfig, physical_memory
from cbd.engine.kv.owner_lock import LOCK_WAIT, hold
from cbd.model.files import default_gguf_path
from cbd.server.auth import read_tokens
from cbd.server.session_saving import owner_name
from cbd.server.settings import ServerConfig


def preflight(engine: EngineConfig, server: ServerConfig) -> None:
    """Raise ValueError or OSError naming the setting that cannot work on this host."""
    _check_model(engine.model)
    _check_device(engine)
    _check_session_dir(engine, server)
    if engine.host_kv_gib is not None and engine.host_kv_gib * 2**30 > physical_memory():
        raise ValueError(
            f"host_kv_gib: {engine.host_kv_gib:.12g} GiB is more than this host's RAM ({physical_memory() / 2**30:.1f} GiB)"
        )
    if server.socket_group:
        try:
            grp.getgrnam(server.socket_group)
        except KeyError:
            raise ValueError(f"socket_group: there is no group named {server.socket_group!r} on this host") from None
    if server.auth_token_file:
        tokens = read_tokens(server.auth_token_file)
        if server.admin_token_name and server.admin_token_name not in tokens:
            raise ValueError(
                f"admin_token_name: {server.auth_token_file} has no token named {server.admin_token_name!r}"
            )
    if server.metrics_auth_token_file:
        read_tokens(server.metrics_auth_token_file, "metrics_auth_token_file")
    for name in ("tls_cert_file", "tls_key_file", "tls_client_ca_file"):
        path = getattr(server, name)
        if path and not Path(path).is_file():
            raise ValueError(f"{name}: {path} does not exist or is not a file")
    for name in ("log_file", "pid_file"):
        path = getattr(server, name)
        if path and not Path(path).expanduser().parent.is_dir():
            raise ValueError(f"{name}: the directory of {path} does not exist")


def _check_model(model: str | None) -> None:
    if model is None:
        default_gguf_path()  # FileNotFoundError says which package to install
        return
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"model: {model} does not exist (give a checkpoint directory or a .gguf file)")
    if path.is_dir() and not (path / "config.json").is_file():
        raise ValueError(f"model: {model} is a directory without config.json, not a checkpoint directory")
    if path.is_file() and path.suffix != ".gguf":
        raise ValueError(f"model: {model} is a file but not a .gguf file")
    if path.is_file() and _head(path, 4) != b"GGUF":
        raise ValueError(f"model: {model} is not a GGUF file (it does not begin with the GGUF magic)")
    if path.is_dir():
        try:
            config = json.loads((path / "config.json").read_text())
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise ValueError(f"model: {path / 'config.json'} is not readable JSON: {exc}") from None
        if not isinstance(config, dict) or "model_type" not in config:
            raise ValueError(f"model: {path / 'config.json'} names no model_type, not a checkpoint's config")


def _head(path: Path, size: int) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(size)
    except OSError as exc:
        raise ValueError(f"model: {path} cannot be read: {exc.strerror}") from None


def _check_session_dir(engine: EngineConfig, server: ServerConfig) -> None:
    """The session directory can be this daemon's: a directory (made if missing) whose owner folder no other
    live daemon holds (the engine takes the same lock for its life once the model is loaded)."""
    directory = engine.session_dir()
    if directory is None:
        return
    root = Path(directory).expanduser()
    if root.exists() and not root.is_dir():
        raise ValueError(f"disk_kv_dir: {root} is not a directory")
    owner = engine.disk_kv_owner or owner_name(server.addresses())
    lock = hold(root, owner, LOCK_WAIT)
    if lock is None:
        raise ValueError(f"disk_kv_owner: another cbd daemon holds the owner name {owner!r} in {root}; give each "
                         "daemon its own (--disk-kv-owner)")  # fmt: skip
    lock.close()  # released: the engine takes it again


def _check_device(engine: EngineConfig) -> None:
    if not engine.device.startswith("cuda"):
        return
    import torch  # only for a CUDA device: the frontend otherwise never imports torch

    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise ValueError(
            f"device: {engine.device!r} but CUDA is not available here (torch {torch.__version__}, {build}); "
            "use --device cpu or auto"
        )
    suffix = engine.device.removeprefix("cuda").removeprefix(":")
    if suffix and not suffix.isdigit():
        raise ValueError(f"device: {engine.device!r} is not 'cuda' or 'cuda:N'")
    index = int(suffix or 0)
    needed = index + engine.tensor_parallel_size
    if needed > torch.cuda.device_count():
        raise ValueError(
            f"device: {engine.device!r} with tensor_parallel_size {engine.tensor_parallel_size} needs {needed} GPUs, "
            f"this host has {torch.cuda.device_count()}"
        )
