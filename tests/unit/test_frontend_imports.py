"""The frontend process imports no torch (nor xgrammar, which imports torch): its entry and what it
imports are torch-free, so its start and memory are those of a gRPC server. Checked in a fresh
interpreter, since this test process has torch loaded already."""

from __future__ import annotations

import subprocess
import sys


def test_the_frontend_entry_imports_no_torch() -> None:
    code = "import sys, cbd.server.app; print(sorted(m for m in ('torch', 'xgrammar') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stderr
