"""Soak: repeated bursts of streaming clients, and the daemon's memory after each (does it plateau?).

Each burst is bench/load.py's client mix (plain calls, fan-outs, session agent loops, tool calls),
with a fraction of calls cancelled by the client at a random moment. After each burst, once the daemon
is idle (no requests, no sessions), the RSS of both daemon processes (the frontend and the engine
process) is read from /proc; after the last burst the daemon idles a while and is read again.

Floors: from the second burst to the last, each process's post-burst RSS stays within +10% of its
post-burst-2 level (a plateau); after the idle wait it is within +20% of its idle baseline (before the
first burst).

    python bench/soak.py                                  # 6 bursts x 200 clients x 40 s, default model
    python bench/soak.py --bursts 20 --clients 300 --duration 60 --json soak.json
    python bench/soak.py --daemon-args "--malloc-arena-max 0"     # the allocator settings off
    python bench/soak.py --gpu --tokenizer DIR --clients 512 --max-batch 256    # H200, Llama-3-8B shape
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from load import LoadGenerator, rss_mib  # noqa: E402

from cbd_client import AsyncClient  # noqa: E402


def daemon_pids(frontend: int) -> dict[str, int]:
    """The frontend's pid and its engine process's (the one child that runs cbd.server.engine_main)."""
    pids = {"frontend": frontend}
    for child in Path(f"/proc/{frontend}/task/{frontend}/children").read_text().split():
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        if b"engine_main" in cmdline:
            pids["engine"] = int(child)
    return pids


class Burst(LoadGenerator):
    """LoadGenerator whose calls are cancelled by the client with probability --cancel-fraction."""

    def __init__(self, address: str, args: argparse.Namespace, burst: int) -> None:
        super().__init__(address, args, None)
        self.rng = random.Random(args.seed * 7919 + burst)
        self.cancels = 0

    async def call(self, make_stream, n: int) -> str | None:  # type: ignore[no-untyped-def]
        if self.rng.random() >= self.args.cancel_fraction:
            return await super().call(make_stream, n)
        self.started += 1

        async def consume() -> None:
            async for _ in make_stream():
                pass

        try:
            await asyncio.wait_for(consume(), timeout=self.rng.uniform(0.05, 3.0))
        except TimeoutError:
            self.cancels += 1
            return "cancelled"  # a session job stops here: its session is as before this turn
        except Exception as e:  # noqa: BLE001 - a refusal or error of a call about to be cancelled anyway
            self.error(type(e).__name__, str(e))
            return type(e).__name__
        return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bursts", type=int, default=6)
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--duration", type=float, default=40.0, help="seconds of each burst")
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument("--cancel-fraction", type=float, default=0.35)
    parser.add_argument("--tool-weight", type=float, default=1.0, help="weight of tool-call jobs (plain is 6)")
    parser.add_argument("--idle", type=float, default=60.0, help="seconds to idle after the last burst")
    parser.add_argument("--daemon-args", default="")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json")
    parser.add_argument("--gpu", action="store_true", help="CUDA, Llama-3-8B shape (random weights; needs --tokenizer)")
    parser.add_argument("--tokenizer", help="a directory with the default model's tokenizer files (--gpu)")
    parser.add_argument("--checkpoint", default="/tmp/cbd-8b-shape", help="where the --gpu checkpoint is written")
    parser.add_argument("--max-batch", type=int, default=256, help="max_num_seqs and CUDA graphs (--gpu)")
    args = parser.parse_args(argv)
    # what LoadGenerator reads
    args.grace, args.ramp, args.call_timeout, args.session_ttl = 120.0, 2.0, 300.0, 300.0
    args.sample_every, args.verbose = 5.0, False
    return args


def rss(pids: dict[str, int]) -> dict[str, float]:
    return {name: round(rss_mib(pid) or 0.0, 1) for name, pid in pids.items()}


def soak(address: str, frontend: int, args: argparse.Namespace) -> dict[str, object]:
    pids = daemon_pids(frontend)
    rows: list[dict[str, object]] = [{"when": "idle baseline", **rss(pids)}]
    print(rows[-1], file=sys.stderr)
    for b in range(args.bursts):
        burst = Burst(address, args, b)
        report = asyncio.run(burst.run())
        rows.append({"when": f"after burst {b + 1}", **rss(pids), "completed": report.requests_completed,
                     "cancelled": burst.cancels, "errors": sum(report.errors.values()),
                     "leaked_blocks": report.leaked_blocks, "error_examples": report.error_examples})  # fmt: skip
        print(rows[-1], file=sys.stderr)
    time.sleep(args.idle)
    rows.append({"when": f"after {args.idle:.0f} s idle", **rss(pids)})
    verdict: dict[str, object] = {}
    for name in pids:
        base = float(rows[0][name])  # type: ignore[arg-type]
        second = float(rows[2][name]) if len(rows) > 3 else float(rows[1][name])  # type: ignore[arg-type]
        worst = max(float(r[name]) for r in rows[2:-1]) if len(rows) > 3 else second  # type: ignore[arg-type]
        verdict[name] = {
            "plateau": round(worst / second, 3),
            "idle_vs_baseline": round(float(rows[-1][name]) / base, 3),
        }  # type: ignore[arg-type]
    return {"rows": rows, "verdict": verdict}


def main() -> None:
    args = parse_args()
    from daemon_process import DaemonProcess

    with tempfile.TemporaryDirectory() as tmp:
        flags = args.daemon_args.split()
        if args.gpu:  # the checkpoint and settings of bench/daemon_gpu.py
            from daemon_gpu import build_checkpoint, engine_settings

            build_checkpoint(Path(args.checkpoint), Path(args.tokenizer), 32)
            settings = engine_settings(Path(args.checkpoint), args.max_batch)
            (Path(tmp) / "cbd.toml").write_text(
                "[engine]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items())
            )
            flags += ["--config", str(Path(tmp) / "cbd.toml")]
        daemon = DaemonProcess(Path(tmp) / "cbd.sock", *flags)
        try:
            daemon.wait_serving(600)
            asyncio.run(_warm(daemon.address))
            result = soak(daemon.address, daemon.process.pid, args)
        finally:
            daemon.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"{'when':<22} {'frontend MiB':>13} {'engine MiB':>11} {'completed':>10} {'cancelled':>10} {'errors':>7}")
    for r in result["rows"]:  # type: ignore[union-attr]
        print(f"{r['when']:<22} {r['frontend']:>13} {r.get('engine', '-'):>11} {r.get('completed', ''):>10} "
              f"{r.get('cancelled', ''):>10} {r.get('errors', ''):>7}")  # fmt: skip
    print(json.dumps(result["verdict"]))


async def _warm(address: str) -> None:
    async with AsyncClient(address) as c:
        await c.generate([{"role": "user", "content": "hi"}], max_tokens=4)


if __name__ == "__main__":
    main()
