"""CPU threads on a shared host: the daemon's default against explicit thread counts and OpenMP wait
settings, alone and beside a CPU-bound neighbour process.

For each setting, a fresh `cbd serve` (the default model) answers the same requests through the client:
three one-shot greedy questions and a three-turn chat session (32 new tokens each), with `--neighbours`
busy-looping processes beside the daemon the whole time or none. Settings: the default (all cores,
libgomp's own spin-then-sleep), each `--num-threads` in `--threads`, and the default with idle OpenMP
threads sleeping sooner (GOMP_SPINCOUNT=5000) or at once (OMP_WAIT_POLICY=PASSIVE). Prints one table:
median seconds per request for each setting, alone and beside the neighbours, and each one's ratio to
the default, from the same run.

    python bench/threads_cpu.py [--threads 1 2] [--neighbours 1] [--rounds 2] [--no-waits]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cbd_client import Client

QUESTIONS = ["What is the capital of France?", "Name three primary colours.", "What is 12 times 12?"]
TURNS = ["Plan a picnic in one line.", "What food should I bring?", "And drinks?"]


def _spin() -> None:
    while True:
        pass


def run_requests(address: str) -> list[float]:
    times = []
    with Client(address, timeout=600) as client:
        client.wait_ready(600)
        client.generate("warm up", max_tokens=4)
        for q in QUESTIONS:
            start = time.perf_counter()
            client.generate([{"role": "user", "content": q}], max_tokens=32, temperature=0, ignore_eos=True)
            times.append(time.perf_counter() - start)
        with client.session([{"role": "system", "content": "You are terse."}]) as chat:
            for t in TURNS:
                start = time.perf_counter()
                chat.send([{"role": "user", "content": t}], max_tokens=32, temperature=0, ignore_eos=True)
                times.append(time.perf_counter() - start)
    return times


WAITS = {"GOMP_SPINCOUNT=5000": {"GOMP_SPINCOUNT": "5000"}, "OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"}}


def measure(setting: str, neighbours: int, directory: Path) -> float:
    """Median seconds per request for a daemon started with `setting`: "default", a thread count, or a
    key of WAITS (the default threads with that OpenMP wait setting)."""
    socket = directory / f"cbd-{len(list(directory.iterdir()))}.sock"
    flags = ["--num-threads", setting] if setting.isdigit() else []
    env = {**os.environ, **WAITS.get(setting, {})}
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(neighbours)]
    for s in spinners:
        s.start()
    daemon = subprocess.Popen(
        [sys.executable, "-m", "cbd.cli", "serve", "--listen", f"unix:{socket}", *flags],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
    )  # fmt: skip
    try:
        while not socket.exists():  # it listens within seconds; then wait_ready waits for the model
            if daemon.poll() is not None:
                raise RuntimeError(f"cbd serve exited with {daemon.returncode}")
            time.sleep(0.1)
        return statistics.median(run_requests(f"unix:{socket}"))
    finally:
        daemon.terminate()
        daemon.wait(120)
        for s in spinners:
            s.terminate()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--neighbours", type=int, default=1, help="busy processes beside the daemon")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--waits", action=argparse.BooleanOptionalAction, default=True,
                        help="also the default threads with the OpenMP wait settings")  # fmt: skip
    args = parser.parse_args()
    settings = ["default", *map(str, args.threads), *(WAITS if args.waits else ())]
    results: dict[tuple[str, int], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for neighbours in (0, args.neighbours):
                for setting in settings:
                    results.setdefault((setting, neighbours), []).append(measure(setting, neighbours, Path(tmp)))
    cores = len(os.sched_getaffinity(0))
    print(f"\n{cores} cores; median s/request over {args.rounds} rounds (3 questions + 3 chat turns, 32 tokens)")
    print(f"{'setting':>24} {'alone':>8} {'vs default':>10} {f'+{args.neighbours} busy':>10} {'vs default':>10}")
    base = [statistics.median(results["default", n]) for n in (0, args.neighbours)]
    for setting in settings:
        row = [statistics.median(results[setting, n]) for n in (0, args.neighbours)]
        name = setting if not setting.isdigit() else f"--num-threads {setting}"
        print(f"{name:>24} {row[0]:>8.2f} {row[0] / base[0]:>9.2f}x {row[1]:>10.2f} {row[1] / base[1]:>9.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
