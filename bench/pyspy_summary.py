"""Sampling profiles of a running daemon with py-spy, summarised per thread (used by bench/daemon_gpu.py).

Two windows per process, sampled without pausing it (--nonblocking): every sample of every thread that
is running or runnable (py-spy's default leaves out threads blocked in a wait), and only the samples
in which the thread holds the GIL (--gil). Per thread: the share of the window it was active, the share
it held the GIL (active without the GIL is waiting for it, or running native code that released it),
and the functions where its active samples were (self time).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections import Counter, defaultdict
from pathlib import Path

_LINE = re.compile(r"^(?P<stack>.*) (?P<count>\d+)$")


def _program() -> str | None:
    """py-spy on PATH, or beside this interpreter's packages (a wheel installed with --target)."""
    found = shutil.which("py-spy")
    if found:
        return found
    import sys

    for entry in sys.path:
        candidate = Path(entry) / "bin" / "py-spy"
        if candidate.exists():
            return str(candidate)
    return None


def available() -> bool:
    return _program() is not None


def record(pid: int, seconds: float, rate: int, out: Path, gil: bool) -> subprocess.Popen:
    args = [_program() or "py-spy", "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", str(rate),
            "--format", "raw", "--threads", "--nonblocking", "--output", str(out)]  # fmt: skip
    if gil:
        args.append("--gil")
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _read(path: Path) -> dict[str, Counter[str]]:
    """thread -> leaf function -> samples."""
    threads: dict[str, Counter[str]] = defaultdict(Counter)
    if not path.exists():
        return threads
    for line in path.read_text().splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        frames = m["stack"].split(";")
        thread, leaf = frames[0], frames[-1] if len(frames) > 1 else "?"
        threads[thread][leaf] += int(m["count"])
    return threads


def summarise(active: Path, gil: Path, seconds: float, rate: int, top: int = 6) -> list[str]:
    total = seconds * rate
    act, held = _read(active), _read(gil)
    lines = []
    for thread, leaves in sorted(act.items(), key=lambda kv: -sum(kv[1].values())):
        n = sum(leaves.values())
        if n < 0.02 * total:
            continue
        g = sum(held.get(thread, Counter()).values())
        hot = ", ".join(f"{leaf} {100 * c / n:.0f}%" for leaf, c in leaves.most_common(top))
        lines.append(f"  {thread}: active {100 * n / total:.0f}%, holds GIL {100 * g / total:.0f}% | {hot}")
    return lines
