"""A daemon's start on the CPU: seconds until it serves, and what each of its two processes spent getting there.

Starts a real `cbd serve` (the embedded default model, and a tiny random-weight Llama with no tokenizer) on a
temporary socket, waits until its health check says SERVING, then reads from /proc each process's CPU time
(user + system: the frontend's and the engine process's), the frontend's resident memory and whether it has
torch loaded; then stops it. The default model's converted checkpoint is in the cache already (a first start
converts the GGUF file once). Medians over --rounds. `--before DIR` runs the same from another source tree
(its daemon/ and client/ first on PYTHONPATH), the two trees alternating round by round.

    python bench/startup_cpu.py [--rounds 5] [--before DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from conftest import build_tiny_checkpoint  # noqa: E402
from daemon_process import DaemonProcess, cpu_seconds, rss_bytes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def start_once(tree: Path, model: list[str], directory: Path) -> dict[str, float]:
    env = {"PYTHONPATH": f"{tree / 'daemon'}:{tree / 'client'}"}
    began = time.monotonic()
    d = DaemonProcess(directory / "cbd.sock", *model, env=env)
    try:
        d.wait_serving(300)
        serving = time.monotonic() - began
        front = d.process.pid
        return {
            "serving_s": serving,
            "frontend_cpu_s": cpu_seconds(front),
            "engine_cpu_s": cpu_seconds(d.engine_pid()),
            "frontend_rss_mib": rss_bytes(front) / 2**20,
            "frontend_torch": float("libtorch" in Path(f"/proc/{front}/maps").read_text()),
        }
    finally:
        assert d.stop() == 0, d.log()[-3000:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--before", type=Path, default=None, help="another source tree to compare with")
    args = parser.parse_args()
    trees = [("this tree", ROOT)] + ([("before", args.before.resolve())] if args.before else [])
    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_tiny_checkpoint(Path(tmp) / "tiny", "llama")
        models = [("default", []), ("tiny", ["--model", str(tiny)])]
        results: dict[tuple[str, str], list[dict[str, float]]] = {}
        for _ in range(args.rounds):
            for model_name, model in models:
                for tree_name, tree in trees:
                    with tempfile.TemporaryDirectory() as directory:
                        row = start_once(tree, model, Path(directory))
                    results.setdefault((tree_name, model_name), []).append(row)
    print(f"median of {args.rounds} starts; CPU seconds until the daemon serves, per process")
    print(f"{'tree':>10} {'model':>8} {'serving s':>10} {'frontend cpu s':>15} {'engine cpu s':>13} "
          f"{'total cpu s':>12} {'frontend MiB':>13} {'torch in frontend':>18}")  # fmt: skip
    for (tree_name, model_name), rows in results.items():

        def med(key: str, rows: list[dict[str, float]] = rows) -> float:
            return statistics.median(r[key] for r in rows)

        total = statistics.median(r["frontend_cpu_s"] + r["engine_cpu_s"] for r in rows)
        torch_loaded = "yes" if any(r["frontend_torch"] for r in rows) else "no"
        print(f"{tree_name:>10} {model_name:>8} {med('serving_s'):10.2f} {med('frontend_cpu_s'):15.2f} "
              f"{med('engine_cpu_s'):13.2f} {total:12.2f} {med('frontend_rss_mib'):13.0f} {torch_loaded:>18}")  # fmt: skip


if __name__ == "__main__":
    main()
