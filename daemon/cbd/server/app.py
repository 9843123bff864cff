"""The daemon process: listen first, load and warm the engine, then serve until SIGTERM/SIGINT.

Health (grpc.health.v1, service "" and "cbd.v1.Cbd") is NOT_SERVING until warm-up has finished and
again from the moment shutdown begins. On shutdown, new calls get UNAVAILABLE, live requests get
`shutdown_grace` seconds to finish, and whatever is still running then ends its stream with finish
reason ABORT, so no caller is left hanging.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cbd.config import EngineConfig
from cbd.engine.engine import Engine
from cbd.engine.sampling_params import SamplingParams
from cbd.server.notify import sd_notify
from cbd.server.service import CbdService
from cbd.server.settings import ServerConfig, load_settings
from cbd_client.v1 import cbd_pb2, cbd_pb2_grpc

log = logging.getLogger("cbd")
SERVICE_NAME = cbd_pb2.DESCRIPTOR.services_by_name["Cbd"].full_name


async def serve(engine_config: EngineConfig, server_config: ServerConfig) -> None:
    server = grpc.aio.server()
    service = CbdService()
    cbd_pb2_grpc.add_CbdServicer_to_server(service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    for address in server_config.addresses():
        _prepare_unix_socket(address)
        server.add_insecure_port(address)
    await _set_health(health_servicer, health_pb2.HealthCheckResponse.NOT_SERVING)
    if server_config.metrics_port:
        service.metrics.serve(server_config.metrics_port, server_config.metrics_address)
    await server.start()
    log.info("listening on %s; loading the model", ", ".join(server_config.addresses()))

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    engine = None
    try:
        load = asyncio.ensure_future(asyncio.to_thread(_start_engine, engine_config, server_config.warmup))
        await asyncio.wait([load, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        if not stop.is_set():
            engine = load.result()
            service.attach(engine)
            await _set_health(health_servicer, health_pb2.HealthCheckResponse.SERVING)
            sd_notify("READY=1")
            log.info("serving %s", engine.loaded.name)
            await stop.wait()
    finally:
        log.info("shutting down: no new requests; %.1fs for live ones", server_config.shutdown_grace)
        sd_notify("STOPPING=1")
        await _set_health(health_servicer, health_pb2.HealthCheckResponse.NOT_SERVING)
        service.detach()  # new calls get UNAVAILABLE
        if engine is not None:
            await asyncio.to_thread(engine.drain, server_config.shutdown_grace)
            await asyncio.to_thread(engine.shutdown)  # what is left finishes with ABORT, streamed out
        await server.stop(5.0)


def _start_engine(config: EngineConfig, warmup: bool) -> Engine:
    engine = Engine(config)
    if warmup:
        prompt = [engine.loaded.eos_token_ids[0] if engine.loaded.eos_token_ids else 0] * 4
        engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    return engine


async def _set_health(servicer: health.aio.HealthServicer, status: int) -> None:
    for name in ("", SERVICE_NAME):
        await servicer.set(name, status)


def _prepare_unix_socket(address: str) -> None:
    if not address.startswith("unix:"):
        return
    path = Path(address.removeprefix("unix:").removeprefix("//"))
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_socket():
        path.unlink()  # a stale socket from an earlier run


def main(argv: list[str] | None = None) -> int:
    try:
        engine_config, server_config = load_settings(argv)
    except (ValueError, OSError) as exc:
        print(f"cbd: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=server_config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        asyncio.run(serve(engine_config, server_config))
    except Exception as exc:
        log.exception("cbd failed: %s", exc)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
