"""The daemon process: listen first, load and warm the engine, then serve until SIGTERM/SIGINT.

Health (grpc.health.v1, service "" and "cbd.v1.Cbd") is NOT_SERVING until warm-up has finished and
again from the moment shutdown begins. On shutdown, new calls get UNAVAILABLE, live requests get
`shutdown_grace` seconds to finish, and whatever is still running then ends its stream with finish
reason ABORT, so no caller is left hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import os
import shutil
import signal
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cbd import __version__, gc_heap
from cbd.config import EngineConfig
from cbd.engine.api import ErrorKind
from cbd.ipc.engine_process import EngineStartFailed
from cbd.ipc.remote import RemoteEngine
from cbd.model.files import default_cache_dir
from cbd.server import memory, session_saving
from cbd.server.auth import BearerTokenInterceptor, read_tokens
from cbd.server.background import detach
from cbd.server.background import stop as stop_daemon
from cbd.server.logs import configure as configure_logging
from cbd.server.methods import add_cbd_service
from cbd.server.metrics import Metrics
from cbd.server.metrics_http import MetricsEndpoint
from cbd.server.notify import sd_notify
from cbd.server.preflight import preflight
from cbd.server.service import CbdService
from cbd.server.settings import (
    EX_CONFIG,
    ServerConfig,
    build_parser,
    default_listen,
    load_settings,
    render_defaults,
    setting_sources,
)
from cbd.server.sockets import AddressInUse, UnixSocketClaim, describe_bind_failure, tcp_port_taken, unix_path
from cbd_client.v1 import cbd_pb2

log = logging.getLogger("cbd")
SERVICE_NAME = cbd_pb2.DESCRIPTOR.services_by_name["Cbd"].full_name


class StartupError(Exception):
    """The daemon cannot start as configured; `status` is its exit status (78: fix the configuration)."""

    def __init__(self, message: str, status: int = EX_CONFIG) -> None:
        super().__init__(message)
        self.status = status


class EngineDied(Exception):
    """The engine process failed while serving (a crash or a device error): exit non-zero, to be restarted."""


async def serve(
    engine_config: EngineConfig, server_config: ServerConfig, on_listening: Callable[[list[str]], None] | None = None
) -> None:
    interceptors = []
    tokens = read_tokens(server_config.auth_token_file) if server_config.auth_token_file else None
    if tokens is not None:
        interceptors.append(BearerTokenInterceptor(tokens))
    limit = server_config.max_message_bytes
    # No SO_REUSEPORT: a second daemon on the same port must fail to bind, not share the port.
    options = [
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
        ("grpc.so_reuseport", 0),
    ]
    server = grpc.aio.server(interceptors=interceptors, options=options)
    service = CbdService(
        tokens=tokens, admin_token_name=server_config.admin_token_name, stream_interval=server_config.stream_interval,
        idle_trim_seconds=engine_config.idle_trim_seconds,
    )  # fmt: skip
    add_cbd_service(service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    claims = [UnixSocketClaim(a) for a in server_config.addresses() if unix_path(a) is not None]
    metrics_server = None
    try:
        await _listen(server, server_config, claims)
        if server_config.metrics_port:
            metrics_server = await _serve_metrics(service.metrics, server_config)
    except BaseException:
        await server.stop(None)
        for claim in claims:
            claim.release()
        raise
    if server_config.pid_file:
        Path(server_config.pid_file).write_text(f"{os.getpid()}\n")
    if on_listening is not None:
        on_listening(server_config.addresses())
    await _set_health(health_servicer, health_pb2.HealthCheckResponse.NOT_SERVING)
    log.info("listening on %s; loading the model", ", ".join(server_config.addresses()))
    sd_notify("STATUS=loading the model")

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if stop.is_set():  # a second signal: exit at once, leaving no socket or pid file behind
            log.warning("second signal: exiting now")
            _remove_files(claims, server_config.pid_file)
            os._exit(1)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, on_signal)

    engine = None
    watchdog = trimmer = saver = None
    saving = engine_config.session_dir() is not None
    if saving and not engine_config.disk_kv_owner:  # the same daemon restarted finds its folder again
        engine_config = replace(engine_config, disk_kv_owner=session_saving.owner_name(server_config.addresses()))
    try:
        load = asyncio.ensure_future(
            RemoteEngine.start(engine_config, _engine_program(server_config), server_config.warmup)
        )
        await asyncio.wait([load, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set() and not load.done():
            load.cancel()
            with contextlib.suppress(asyncio.CancelledError, EngineStartFailed):
                await load
        if not stop.is_set():
            engine = _loaded(load)
            service.attach(engine)
            if saving:
                await session_saving.restore_transcripts(engine, service.chats)
            gc_heap.freeze()
            await _set_health(health_servicer, health_pb2.HealthCheckResponse.SERVING)
            sd_notify(f"READY=1\nSTATUS=serving {engine.facts.name}")
            log.info("serving %s (engine process %d)", engine.facts.name, engine.pid)
            watchdog = asyncio.ensure_future(_watch(engine, health_servicer, server_config.stall_seconds, stop))
            if saving:
                saver = asyncio.ensure_future(
                    session_saving.save_in_background(engine, service.chats, server_config.session_save_idle)
                )
            trimmer = asyncio.ensure_future(
                memory.trim_when_idle(lambda: (engine.num_live_requests, engine.stats().num_steps), service.idle_trim)
            )
            await stop.wait()
    finally:
        if engine is not None or stop.is_set():
            log.info("shutting down: no new requests; %.1fs for live ones", server_config.shutdown_grace)
        sd_notify("STOPPING=1\nSTATUS=draining")
        for task in (watchdog, trimmer, saver):
            if task is not None:
                task.cancel()
        service.detach()  # new calls get UNAVAILABLE, from before health says NOT_SERVING
        await _set_health(health_servicer, health_pb2.HealthCheckResponse.NOT_SERVING)
        if engine is not None:
            if not await engine.drain(server_config.shutdown_grace) and engine.fatal is None:
                log.info("the grace is over: %d live requests end with ABORT", engine.num_live_requests)
            if saving and engine.fatal is None:
                await session_saving.save_at_shutdown(engine, service.chats, server_config.session_save_seconds)
            await engine.shutdown()  # what is left finishes with ABORT, streamed out
        await server.stop(5.0)
        if metrics_server is not None:
            metrics_server.close()
        _remove_files(claims, server_config.pid_file)
    if engine is not None and engine.fatal is not None:
        raise EngineDied(str(engine.fatal))


async def _listen(server: grpc.aio.Server, config: ServerConfig, claims: list[UnixSocketClaim]) -> None:
    """Bind every address (refusing one that another daemon serves) with the sockets' final permissions."""
    for claim in claims:
        claim.acquire()
    credentials = _server_credentials(config)
    for address in config.addresses():
        if unix_path(address) is None and tcp_port_taken(address):
            raise StartupError(describe_bind_failure(address, None))
        try:
            if credentials is not None and unix_path(address) is None:
                port = server.add_secure_port(address, credentials)
            else:
                port = server.add_insecure_port(address)
        except RuntimeError as exc:
            raise StartupError(describe_bind_failure(address, exc)) from None
        if port == 0 and unix_path(address) is None:
            raise StartupError(describe_bind_failure(address, None))
    # The sockets are created by start(): a umask gives them their mode from the first moment.
    umask = os.umask(0o777 & ~int(config.socket_mode, 8))
    try:
        await server.start()
    finally:
        os.umask(umask)
    for claim in claims:
        claim.bound()
        _restrict_unix_socket(claim.path, config.socket_mode, config.socket_group)


async def _serve_metrics(metrics: Metrics, config: ServerConfig) -> asyncio.Server:
    path = config.metrics_auth_token_file
    tokens = read_tokens(path, "metrics_auth_token_file") if path else None
    endpoint = MetricsEndpoint(metrics.registry, config.metrics_max_connections, config.metrics_read_timeout, tokens)
    try:
        return await endpoint.start(config.metrics_address, config.metrics_port)
    except OSError as exc:
        where = f"{config.metrics_address}:{config.metrics_port}"
        raise StartupError(f"metrics_port: cannot listen on {where}: {exc.strerror or exc}") from None


def _loaded(load: asyncio.Future[RemoteEngine]) -> RemoteEngine:
    try:
        return load.result()
    except EngineStartFailed as exc:
        if exc.kind is ErrorKind.LOAD:  # a model that cannot be read as configured
            raise StartupError(f"could not load the model: {exc}") from exc
        if exc.kind is ErrorKind.SETTING:
            raise StartupError(str(exc)) from exc
        raise StartupError(f"could not start the engine: {exc}", status=1) from exc


def _engine_program(config: ServerConfig) -> list[str]:
    """The engine process's command line (it logs where and how the daemon does)."""
    return [
        sys.executable, "-m", "cbd.server.engine_main", "--log-level", config.log_level,
        "--log-file", config.log_file,
    ]  # fmt: skip


def _remove_files(claims: list[UnixSocketClaim], pid_file: str) -> None:
    for claim in claims:
        claim.release()
    if pid_file:
        Path(pid_file).unlink(missing_ok=True)


async def _watch(
    engine: RemoteEngine, health_servicer: health.aio.HealthServicer, stall_seconds: float, stop_on_fatal: asyncio.Event
) -> None:
    """Feed systemd's watchdog only while the engine loop turns; report NOT_SERVING while it is wedged."""
    usec = os.environ.get("WATCHDOG_USEC")
    interval = min(1.0, int(usec) / 2e6) if usec and usec.isdigit() else 1.0
    stalled = False
    while True:
        if engine.fatal is not None:  # the engine failed: exit non-zero so that systemd restarts us
            sd_notify("STATUS=engine failed")
            stop_on_fatal.set()
            return
        now_stalled = engine.stalled(stall_seconds)
        if now_stalled != stalled:
            stalled = now_stalled
            status = health_pb2.HealthCheckResponse.NOT_SERVING if stalled else health_pb2.HealthCheckResponse.SERVING
            await _set_health(health_servicer, status)
            log.error("engine loop stalled for over %.0fs with work pending", stall_seconds) if stalled else log.info(
                "engine loop running again")  # fmt: skip
            sd_notify("STATUS=engine stalled" if stalled else "STATUS=serving")
        if usec and not stalled:
            sd_notify("WATCHDOG=1")
        await asyncio.sleep(interval)


async def _set_health(servicer: health.aio.HealthServicer, status: int) -> None:
    for name in ("", SERVICE_NAME):
        await servicer.set(name, status)


def _server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    if not config.tls_cert_file:
        return None
    key, chain = Path(config.tls_key_file).read_bytes(), Path(config.tls_cert_file).read_bytes()
    ca = Path(config.tls_client_ca_file).read_bytes() if config.tls_client_ca_file else None
    return grpc.ssl_server_credentials([(key, chain)], root_certificates=ca, require_client_auth=ca is not None)


def _restrict_unix_socket(path: Path, mode: str, group: str) -> None:
    if group:
        shutil.chown(path, group=group)
    os.chmod(path, int(mode, 8))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "config":
        if args.sources:
            try:
                print("\n".join(setting_sources()))
            except (ValueError, OSError) as exc:
                print(f"cbd: configuration error: {exc}", file=sys.stderr)
                return EX_CONFIG
            return 0
        if not args.print_defaults:
            parser.parse_args(["config", "--help"])  # prints the subcommand's help and exits 0
        print(render_defaults())
        return 0
    if args.command == "stop":
        return stop_daemon(args.address or default_listen(), args.pid_file, args.timeout)
    try:
        engine_config, server_config = load_settings(argv)
        preflight(engine_config, server_config)
        _server_credentials(server_config)  # unreadable certificate files are configuration errors
    except (ValueError, OSError) as exc:  # a configuration error: do not let systemd restart-loop on it
        print(f"cbd: configuration error: {exc}", file=sys.stderr)
        return EX_CONFIG
    report = None
    if args.detach:
        if not server_config.log_file:
            default_cache_dir().mkdir(parents=True, exist_ok=True)
            server_config = replace(server_config, log_file=str(default_cache_dir() / "cbd.log"))
        report = detach(server_config.log_file)
    configure_logging(server_config.log_level, log_file=server_config.log_file or None)
    memory.configure(engine_config)

    def on_listening(addresses: list[str]) -> None:
        # Logged once the addresses are this daemon's: a start refused before (another daemon serves the
        # address) says so in one line.
        log.info("cbd %s, pid %d, torch %s", __version__, os.getpid(), importlib.metadata.version("torch"))
        log.info(
            "settings given (by file, environment or flag; the rest are defaults): %s", "; ".join(setting_sources(argv))
        )
        if report is not None:
            report(0, ", ".join(addresses))

    try:
        asyncio.run(serve(engine_config, server_config, on_listening))
    except (StartupError, AddressInUse) as exc:
        status = exc.status if isinstance(exc, StartupError) else EX_CONFIG
        log.error("cbd cannot start: %s", exc)
        if report is not None:
            report(status, str(exc))
        elif server_config.log_file:  # otherwise the log line above, on stderr, is the one line
            print(f"cbd: {exc}", file=sys.stderr)
        return status
    except EngineDied as exc:
        log.error("cbd exits: %s", exc)
        return 1
    except Exception as exc:
        log.exception("cbd failed: %s", exc)
        if report is not None:
            report(1, f"cbd failed: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
