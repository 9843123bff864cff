"""A real daemon (the embedded model, two bearer tokens: two tenants) and a real `cbd openai` gateway
in front of it, with its state directory in a temporary folder: the agent API tests' stack."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from daemon_process import DaemonProcess, free_port

TOKEN = "alice-token"
OTHER_TOKEN = "bob-token"


class Stack:
    def __init__(self, daemon: DaemonProcess, tmp: Path) -> None:
        self.daemon, self.tmp = daemon, tmp
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.gateway: subprocess.Popen | None = None

    def start_gateway(self) -> None:
        log = open(self.tmp / "gateway.log", "a")
        self.gateway = subprocess.Popen(
            [sys.executable, "-m", "cbd.cli", "openai", "--daemon", self.daemon.address,
             "--listen", f"127.0.0.1:{self.port}", "--state-dir", str(self.tmp / "state")],
            stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy(),
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and self.gateway.poll() is None, self.log()
            time.sleep(0.2)

    def stop_gateway(self) -> None:
        if self.gateway is not None:
            self.gateway.terminate()
            self.gateway.wait(30)
            self.gateway = None

    def log(self) -> str:
        return (self.tmp / "gateway.log").read_text()


def stack(tmp: Path) -> Iterator[Stack]:
    (tmp / "tokens").write_text(f"alice {TOKEN}\nbob {OTHER_TOKEN}\n")
    daemon = DaemonProcess(tmp / "cbd.sock", "--auth-token-file", str(tmp / "tokens"))
    s = Stack(daemon, tmp)
    try:
        daemon.wait_serving()
        s.start_gateway()
        yield s
    finally:
        s.stop_gateway()
        assert daemon.stop() == 0, daemon.log()
