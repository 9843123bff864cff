"""Who holds the GIL in a running daemon: py-spy samples, summarised per thread (bench/daemon_gpu.py).

py-spy samples the process without pausing it (--nonblocking) and keeps only the samples in which a
thread holds the GIL (--gil). Per thread: the share of the window in which it held the GIL, and the
functions it was in then (self time). A thread that needs the interpreter all the time (the engine
loop on a GPU, which must prepare each step while the previous one runs) is slowed by every share of
the window that another thread of its process holds.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

_LINE = re.compile(r"^(?P<stack>.*) (?P<count>\d+)$")


def _program() -> str | None:
    """py-spy on PATH, or beside this interpreter's packages (a wheel installed with --target)."""
    found = shutil.which("py-spy")
    if found:
        return found
    for entry in sys.path:
        candidate = Path(entry) / "bin" / "py-spy"
        if candidate.exists():
            return str(candidate)
    return None


def available() -> bool:
    return _program() is not None


def record(pid: int, seconds: float, rate: int, out: Path) -> subprocess.Popen:
    args = [_program() or "py-spy", "record", "--pid", str(pid), "--duration", str(int(seconds)),
            "--rate", str(rate), "--format", "raw", "--threads", "--nonblocking", "--gil", "--output", str(out)]  # fmt: skip
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
        threads[frames[0]][frames[-1] if len(frames) > 1 else "?"] += int(m["count"])
    return threads


def summarise(path: Path, seconds: float, rate: int, top: int = 6) -> list[str]:
    slots = seconds * rate
    threads = _read(path)
    held = sum(sum(c.values()) for c in threads.values())
    lines = [f"  GIL held in {100 * held / slots:.0f}% of {int(slots)} sample slots"]
    for thread, leaves in sorted(threads.items(), key=lambda kv: -sum(kv[1].values())):
        n = sum(leaves.values())
        if n >= 0.02 * slots:
            hot = ", ".join(f"{leaf} {100 * c / n:.0f}%" for leaf, c in leaves.most_common(top))
            lines.append(f"  {thread}: holds the GIL {100 * n / slots:.0f}% | {hot}")
    return lines
