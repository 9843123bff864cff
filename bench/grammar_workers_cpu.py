"""Replacing a grammar compile worker killed over its budget, on the CPU: how long the next compile waits.

A real `cbd serve` (the embedded default model) with one compile worker and a 1 s compile budget: a schema
whose compile takes minutes is refused after 1 s (its worker killed), then a regex never compiled before is
asked for (4 tokens). The second request's wall time includes replacing the killed worker: a fork from the
pool's fork server in this tree, a fresh process start (imports of the grammar library, torch and
transformers) in a tree from before the fork server. `--before DIR` runs the same from another source tree
(its daemon/ and client/ first on PYTHONPATH), the trees alternating round by round; medians over --rounds.

    python bench/grammar_workers_cpu.py [--rounds 5] [--before DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from cbd_client import CbdError, Client  # noqa: E402
from daemon_process import DaemonProcess  # noqa: E402
from grammar_cases import schema_bomb  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ASK = [{"role": "user", "content": "Write a number."}]


def round_once(tree: Path, index: int) -> dict[str, float]:
    env = {"PYTHONPATH": f"{tree / 'daemon'}:{tree / 'client'}"}
    flags = ("--grammar-compile-workers", "1", "--grammar-compile-timeout", "1")
    d = DaemonProcess(Path(tempfile.mkdtemp()) / "cbd.sock", *flags, env=env)
    try:
        d.wait_serving(300)
        with Client(d.address, timeout=120) as client:
            first = {"type": "regex", "regex": "[0-9]{1,3}"}  # the worker started (and the library loaded)
            client.generate(ASK, max_tokens=4, temperature=0.0, response_format=first)
            began = time.monotonic()
            try:
                fmt = {"type": "json_schema", "json_schema": schema_bomb(f"round-{index}")}
                client.generate(ASK, max_tokens=4, response_format=fmt)
            except CbdError:
                pass
            refused = time.monotonic() - began
            began = time.monotonic()
            fresh = {"type": "regex", "regex": f"[0-9]{{1,{4 + index}}}"}  # never compiled: a worker runs it
            client.generate(ASK, max_tokens=4, temperature=0.0, response_format=fresh)
            return {"bomb_refused_s": refused, "next_compile_s": time.monotonic() - began}
    finally:
        d.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--before", type=Path, default=None, help="another source tree, measured alternately")
    args = parser.parse_args()
    trees = [("this tree", ROOT)] + ([("before", args.before)] if args.before else [])
    results: dict[str, list[dict[str, float]]] = {name: [] for name, _ in trees}
    for index in range(args.rounds):
        for name, tree in trees:
            results[name].append(round_once(tree, index))
    print(f"median of {args.rounds}; one compile worker, 1 s budget: a bomb refused, then a new regex")
    print(f"{'tree':>10} {'bomb refused s':>15} {'next request s':>15}")
    for name, rows in results.items():
        refused = statistics.median(r["bomb_refused_s"] for r in rows)
        nxt = statistics.median(r["next_compile_s"] for r in rows)
        print(f"{name:>10} {refused:>15.2f} {nxt:>15.2f}")


if __name__ == "__main__":
    main()
