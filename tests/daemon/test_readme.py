"""Every Python block of README.md runs as written against a real daemon serving the default model.

Each block runs in a fresh interpreter with `CBD_ADDRESS` pointing at the test's daemon (so `Client()`
finds it as it finds the default socket) and, for blocks that talk HTTP, the README's gateway address
127.0.0.1:8000 replaced by the test gateway's. Nothing else in a block is changed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon_process import DaemonProcess
from gateway_process import GatewayProcess

pytestmark = [pytest.mark.slow, pytest.mark.first]
README = Path(__file__).resolve().parents[2] / "README.md"
GATEWAY = "127.0.0.1:8000"


def python_blocks() -> list[tuple[int, str]]:
    """(line number, code) of each ```python block."""
    text = README.read_text()
    return [
        (text[: m.start()].count("\n") + 1, m.group(1))
        for m in re.finditer(r"^```python\n(.*?)^```$", text, flags=re.MULTILINE | re.DOTALL)
    ]


def test_readme_has_python_blocks() -> None:
    assert len(python_blocks()) >= 8


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, shared_daemon: DaemonProcess
) -> Iterator[tuple[DaemonProcess, GatewayProcess]]:
    gateway = GatewayProcess(shared_daemon.address, tmp_path_factory.mktemp("readme") / "gateway.log")
    try:
        gateway.wait_serving()
        yield shared_daemon, gateway
    finally:
        gateway.stop()


@pytest.mark.parametrize("line,code", python_blocks(), ids=[f"line{n}" for n, _ in python_blocks()])
def test_readme_block_runs(stack, tmp_path, line: int, code: str) -> None:
    daemon, gateway = stack
    env = {**os.environ, "CBD_ADDRESS": daemon.address}
    program = code.replace(GATEWAY, gateway.base.removeprefix("http://"))
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path
    )
    assert done.returncode == 0, f"README line {line}:\n{done.stdout}\n{done.stderr}"
    assert done.stdout.strip(), f"README line {line} printed nothing"
