"""Start a real `cbd openai` process in front of a daemon, wait until it serves, read its memory."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from cbd_client.address import free_port


class GatewayProcess:
    def __init__(self, daemon_address: str, log_path: Path, *flags: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "a")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "cbd.cli", "openai", "--daemon", daemon_address,
             "--listen", f"127.0.0.1:{self.port}", *flags],
            stdout=self._log, stderr=subprocess.STDOUT, env=os.environ.copy(),
        )  # fmt: skip

    def wait_serving(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(f"{self.base}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and self.process.poll() is None, self.log()
            time.sleep(0.2)

    def rss_bytes(self) -> int:
        """The gateway process's resident memory, from /proc."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS line")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        finally:
            self._log.close()
