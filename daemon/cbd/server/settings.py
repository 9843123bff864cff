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

    def __post_init__(self) -> None:
        if self.shutdown_grace < 0:
            raise ValueError(f"shutdown_grace must be >= 0, got {self.shutdown_grace}")
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cbd", description="cbd: continuous-batching LLM daemon")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="load the model and serve gRPC until SIGTERM/SIGINT")
    serve.add_argument("--config", help="TOML file with [engine] and [server] tables")
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
    if args.config:
        with open(args.config, "rb") as fh:
            document = tomllib.load(fh)
        unknown = sorted(set(document) - set(_SECTIONS))
        if unknown:
            raise ValueError(f"unknown tables in {args.config}: {unknown}; known: {sorted(_SECTIONS)}")
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
