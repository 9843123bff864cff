"""The engine's subpackages never import upward: sched/, spec/, kv/, sessions/, grammar/ and device/ import neither the core, the
threaded engine nor anything of the layers above the engine (ARCHITECTURE.md, "Engine: one file per
concept"). Read from the source (every import statement, TYPE_CHECKING ones included), so nothing is run."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ENGINE = Path(__file__).resolve().parents[2] / "daemon" / "cbd" / "engine"
UPWARD = ("cbd.engine.core", "cbd.engine.engine", "cbd.engine.engine_loop", "cbd.engine.build",
          "cbd.engine.emitter", "cbd.engine.stats", "cbd.ipc", "cbd.server", "cbd.gateway")  # fmt: skip


def imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
    return names


@pytest.mark.parametrize("package", ["sched", "spec", "kv", "sessions", "grammar", "device"])
def test_a_subpackage_imports_nothing_above_it(package: str) -> None:
    files = sorted((ENGINE / package).glob("*.py"))
    assert files, package
    upward = [(f.name, name) for f in files for name in imports(f)
              if any(name == u or name.startswith(u + ".") for u in UPWARD)]  # fmt: skip
    assert not upward
