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
