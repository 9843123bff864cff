"""Start a real `cbd serve` process on a temporary unix socket and watch its health."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DaemonProcess:
    def __init__(self, socket_path: Path, *flags: str, env: dict[str, str] | None = None) -> None:
        self.address = f"unix:{socket_path}"
        self.log_path = socket_path.with_suffix(".log")
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "cbd.server.app", "serve", "--listen", self.address, *flags],
            stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
        )  # fmt: skip
        self.health_seen: list[str] = []

    def health(self, timeout: float = 1.0) -> str | None:
        with grpc.insecure_channel(self.address) as channel:
            try:
                response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            except grpc.RpcError:
                return None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def wait_serving(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.process.returncode}:\n{self.log()}")
            status = self.health()
            if status is not None and (not self.health_seen or self.health_seen[-1] != status):
                self.health_seen.append(status)
            if status == "SERVING":
                return
            time.sleep(0.05)
        raise TimeoutError(f"daemon not serving after {timeout}s:\n{self.log()}")

    def stop(self, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.terminate()
        try:
            return self.process.wait(timeout)
        finally:
            self._log.close()

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()
