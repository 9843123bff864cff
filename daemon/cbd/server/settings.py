"""Daemon settings from one source: the config dataclasses' fields become CLI flags, env vars and TOML keys.

Precedence, lowest first: dataclass defaults < TOML file (`--config`, tables [engine] and [server])
< environment (CBD_<FIELD>) < command-line flags (--<field-with-dashes>). Unknown keys are errors.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from dataclasses import MISSING, dataclass, fields
from typing import Any

from cbd.config import EngineConfig, config_from_dict
from cbd_client.address import default_address


@dataclass(frozen=True, slots=True)
class ServerConfig:
    # Addresses to listen on: unix:/path or host:port; several separated by commas.
    listen: str = ""
    # Seconds in-flight streams get to finish on shutdown before they are aborted.
    shutdown_grace: float = 10.0
    # Run one short generation before reporting SERVING.
    warmup: bool = True
    log_level: str = "INFO"
    # Prometheus metrics over HTTP on this port (0: off), bound to metrics_address.
    metrics_port: int = 0
    metrics_address: str = "127.0.0.1"
    # Permissions (octal) and group of unix sockets the daemon creates; "" keeps the process's group.
    socket_mode: str = "0660"
    socket_group: str = ""
    # File holding a bearer token every RPC but health must present ("authorization: Bearer <token>"); "" = off.
    auth_token_file: str = ""
    # Largest gRPC message accepted or sent, in bytes (a bigger request is refused with RESOURCE_EXHAUSTED).
    max_message_bytes: int = 8 * 1024 * 1024
    # TLS for TCP addresses (unix sockets rely on their permissions): PEM certificate chain and key;
    # with tls_client_ca_file, clients must present a certificate signed by that CA (mutual TLS).
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_client_ca_file: str = ""
    # Seconds the engine loop may go without a step while work is pending before health turns NOT_SERVING
    # and the systemd watchdog stops being fed.
    stall_seconds: float = 30.0

    def __post_init__(self) -> None:
        if self.shutdown_grace < 0:
            raise ValueError(f"shutdown_grace must be >= 0, got {self.shutdown_grace}")
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        try:
            mode = int(self.socket_mode, 8)
        except ValueError:
            raise ValueError(f"socket_mode must be octal, e.g. '0660', got {self.socket_mode!r}") from None
        if not 0 <= mode <= 0o777:
            raise ValueError(f"socket_mode must be in 0000..0777, got {self.socket_mode!r}")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file go together")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ValueError("tls_client_ca_file (mutual TLS) needs tls_cert_file and tls_key_file")
        if self.stall_seconds <= 0:
            raise ValueError(f"stall_seconds must be > 0, got {self.stall_seconds}")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ValueError(f"log_level must be DEBUG, INFO, WARNING or ERROR, got {self.log_level!r}")

    def addresses(self) -> list[str]:
        return [a.strip() for a in (self.listen or default_address()).split(",") if a.strip()]


_SECTIONS = {"engine": EngineConfig, "server": ServerConfig}


def _parse(annotation: str, text: str) -> Any:
    base = annotation.replace(" | None", "")
    if annotation.endswith("| None") and text.lower() in ("", "none"):
        return None
    if base == "bool":
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"not a boolean: {text!r}")
    return {"int": int, "float": float, "str": str}[base](text)


DEFAULT_CONFIG_FILE = "/etc/cbd/cbd.toml"
EX_CONFIG = 78  # sysexits.h: configuration error (systemd does not restart-loop on it with RestartPreventExitStatus)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cbd", description="cbd: continuous-batching LLM daemon")
    sub = parser.add_subparsers(dest="command", required=True)
    config = sub.add_parser("config", help="configuration helpers")
    config.add_argument("--print-defaults", action="store_true", help="print a documented default cbd.toml")
    serve = sub.add_parser("serve", help="load the model and serve gRPC until SIGTERM/SIGINT")
    serve.add_argument(
        "--config", help=f"TOML file with [engine] and [server] tables (default {DEFAULT_CONFIG_FILE} if it exists)"
    )
    for section, cls in _SECTIONS.items():
        group = serve.add_argument_group(section)
        for f in fields(cls):
            default = None if f.default is MISSING else f.default
            flag = "--" + f.name.replace("_", "-")
            help_text = f"{f.type}, default {default!r}; env CBD_{f.name.upper()}"
            group.add_argument(flag, dest=f"{section}.{f.name}", metavar=f.name.upper(), help=help_text)
    return parser


def load_settings(argv: list[str] | None = None) -> tuple[EngineConfig, ServerConfig]:
    args = build_parser().parse_args(argv)
    values: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
    path = args.config or os.environ.get("CBD_CONFIG") or (DEFAULT_CONFIG_FILE if os.path.exists(DEFAULT_CONFIG_FILE) else None)
    if path:
        try:
            with open(path, "rb") as fh:
                document = tomllib.load(fh)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path} is not valid TOML: {exc}") from None
        unknown = sorted(set(document) - set(_SECTIONS))
        if unknown:
            raise ValueError(f"unknown tables in {path}: {unknown}; known: {sorted(_SECTIONS)}")
        for section, table in document.items():
            values[section].update(table)
    for section, cls in _SECTIONS.items():
        for f in fields(cls):
            env = os.environ.get(f"CBD_{f.name.upper()}")
            if env is not None:
                values[section][f.name] = _parse(str(f.type), env)
            flag = getattr(args, f"{section}.{f.name}")
            if flag is not None:
                values[section][f.name] = _parse(str(f.type), flag)
    return EngineConfig.from_dict(values["engine"]), config_from_dict(ServerConfig, values["server"], "server config")


def render_defaults() -> str:
    """A cbd.toml holding every setting at its default, each with the comment from its definition."""
    import inspect

    out = ["# cbd configuration (TOML). Every key is optional; shown at its default.",
           "# Precedence: defaults < this file < CBD_<KEY> environment variables < command-line flags.", ""]  # fmt: skip
    for section, cls in _SECTIONS.items():
        comments = _field_comments(inspect.getsource(cls))
        out.append(f"[{section}]")
        for f in fields(cls):
            out += [f"# {line}" for line in comments.get(f.name, [])]
            value = f.default
            if value is None:
                out.append(f"# {f.name} =   (unset)")
            else:
                out.append(f"{f.name} = {_toml_value(value)}")
        out.append("")
    return "\n".join(out)


def _field_comments(source: str) -> dict[str, list[str]]:
    comments: dict[str, list[str]] = {}
    pending: list[str] = []
    for line in source.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("# ").rstrip())
        elif ":" in stripped and not stripped.startswith(("def ", "class ", "@", '"')) and "=" in stripped:
            trailing = stripped.split("  # ", 1)[1:] if "  # " in stripped else []
            comments[stripped.split(":")[0].strip()] = pending + trailing
            pending = []
        else:
            pending = []
    return comments


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)
