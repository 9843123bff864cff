"""The committed generated code is exactly what `python proto/generate.py` produces."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_up_to_date() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "proto" / "generate.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def test_client_package_needs_no_torch() -> None:
    code = "import sys, cbd_client; assert 'torch' not in sys.modules and 'cbd' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_contracts_limits_are_the_engines() -> None:
    """What the gateway refuses up front (cbd_client/contract.py) is what the daemon would refuse."""
    from cbd.engine import sampling_params as engine
    from cbd_client import contract

    for name in ("MAX_LOGPROBS", "MAX_CANDIDATES", "MAX_STOP_STRINGS"):
        assert getattr(contract, name) == getattr(engine, name), name
