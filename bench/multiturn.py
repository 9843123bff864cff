"""The public multi-turn workload of SGLang's hierarchical-cache benchmark, against cbd through its client.

The workload (the shape of sgl-project/sglang `benchmark/hicache/bench_multiturn.py`, re-implemented
here): C clients, R rounds each. A client's first request is a random prompt of L tokens; after each
answer (O tokens, greedy, EOS ignored) it appends a new random L-token question and is ready again.
One sender picks a random ready client at Poisson intervals (rate r requests/s) while fewer than P
requests are in flight. Request rates run from high to low (16 ... 1 by default), each on a daemon
started afresh (nothing cached from the previous rate).

cbd runs it the way its users would: each client is a session, so a round sends only its new
question (SGLang's clients resend the whole history and rely on the radix cache). Each rate runs
on two daemons that differ only in the host KV tier (`--host-kv-gib 0` vs the given size), with a
GPU KV pool smaller than all the clients' histories. Reported per rate and mode, as SGLang prints
them: TTFT average / p90 / median, latency average / p90 / median, throughput in requests/s; and the
prompt tokens the daemon reused (cached) out of those it was sent.

    python bench/multiturn.py --model DIR --rates 4,2 --clients 16 --rounds 3 --request-length 128 \\
        --output-length 16 --max-parallel 8 --daemon-flags "--num-kv-blocks 600"          # CPU, scaled down
    python bench/multiturn.py --model DIR --daemon-flags "--device cuda --kv-cache-gib 8" --host-kv-gib 40
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from cbd_client import AsyncClient  # noqa: E402
from cbd_client.session import AsyncSession  # noqa: E402
from daemon_process import DaemonProcess  # noqa: E402


@dataclass
class Client:
    index: int
    questions: list[list[int]]
    round: int = 0
    session: AsyncSession | None = None


@dataclass
class Metrics:
    ttft: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0


async def run_rate(address: str, args: argparse.Namespace, rate: float, seed: int) -> dict:
    rng = random.Random(seed)
    vocab = args.vocab
    clients = [
        Client(i, [[rng.randrange(100, vocab) for _ in range(args.request_length)] for _ in range(args.rounds)])
        for i in range(args.clients)
    ]
    metrics = Metrics()
    ready = list(clients)
    in_flight: set[asyncio.Task] = set()
    done = 0
    total = args.clients * args.rounds
    async with AsyncClient(address, timeout=3600) as client:
        for c in clients:
            c.session = await client.session()

        async def one(c: Client) -> None:
            nonlocal done
            start = time.perf_counter()
            first = None
            usage = None
            assert c.session is not None
            async for delta in c.session.stream(
                c.questions[c.round], max_tokens=args.output_length, temperature=0, ignore_eos=True
            ):
                if first is None and delta.token_ids:
                    first = time.perf_counter() - start
                if delta.usage is not None:
                    usage = delta.usage
            metrics.ttft.append(first if first is not None else time.perf_counter() - start)
            metrics.latency.append(time.perf_counter() - start)
            if usage is not None:
                metrics.prompt_tokens += usage.prompt_tokens
                metrics.cached_tokens += usage.cached_prompt_tokens
            c.round += 1
            done += 1
            if c.round < args.rounds:
                ready.append(c)

        started = time.perf_counter()
        while done < total:
            if len(in_flight) < args.max_parallel and ready:
                c = ready.pop(rng.randrange(len(ready)))
                task = asyncio.ensure_future(one(c))
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
                await asyncio.sleep(rng.expovariate(rate))
            else:
                await asyncio.sleep(0.05)
        await asyncio.gather(*in_flight)
        elapsed = time.perf_counter() - started
        stats = await client.stats()
        for c in clients:
            if c.session is not None:
                await c.session.close()
    t, lat = sorted(metrics.ttft), sorted(metrics.latency)
    return {
        "rate": rate,
        "requests": len(t),
        "ttft_avg": statistics.fmean(t),
        "ttft_p90": t[int(0.9 * len(t))],
        "ttft_median": t[len(t) // 2],
        "latency_avg": statistics.fmean(lat),
        "latency_p90": lat[int(0.9 * len(lat))],
        "latency_median": lat[len(lat) // 2],
        "throughput_rps": total / elapsed,
        "prompt_tokens": metrics.prompt_tokens,
        "cached_tokens": metrics.cached_tokens,
        "restored_prompt_tokens": stats.restored_prompt_tokens,
        "kv_blocks_offloaded": stats.kv_blocks_offloaded,
        "session_evictions": stats.session_evictions,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="checkpoint directory or .gguf the daemons serve")
    parser.add_argument("--daemon-flags", default="", help="flags for both daemons (device, KV pool size ...)")
    parser.add_argument("--host-kv-gib", default="8", help="the host tier of the second daemon")
    parser.add_argument("--clients", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--request-length", type=int, default=512)
    parser.add_argument("--output-length", type=int, default=64)
    parser.add_argument("--max-parallel", type=int, default=128)
    parser.add_argument("--rates", default="16,14,12,10,9,8,7,6,5,4,3,2,1")
    parser.add_argument("--vocab", type=int, default=49152, help="token ids are drawn below this")
    parser.add_argument("--modes", default="recompute,host")
    args = parser.parse_args()
    results: list[dict] = []
    tiers = {"recompute": ["--host-kv-gib", "0"], "host": ["--host-kv-gib", args.host_kv_gib]}
    with tempfile.TemporaryDirectory() as tmp:
        for rate in [float(r) for r in args.rates.split(",")]:
            for mode in args.modes.split(","):
                flags = ["--model", args.model, *shlex.split(args.daemon_flags), *tiers[mode]]
                daemon = DaemonProcess(Path(tmp) / f"cbd-{mode}.sock", *flags)
                try:
                    daemon.wait_serving(900)
                    result = asyncio.run(run_rate(daemon.address, args, rate, seed=int(rate * 1000)))
                finally:
                    daemon.stop()
                result["mode"] = mode
                results.append(result)
                print(json.dumps(result), flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "multiturn.json"), "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    print(f"\n{args.clients} clients x {args.rounds} rounds, {args.request_length} new input / {args.output_length} "
          f"output tokens per round, at most {args.max_parallel} in flight; seconds, requests/s")  # fmt: skip
    print(f"{'rate':>5s} {'mode':10s} {'TTFT avg':>9s} {'p90':>7s} {'median':>7s} {'lat avg':>8s} {'p90':>7s} "
          f"{'median':>7s} {'req/s':>6s} {'reused':>7s}")  # fmt: skip
    for r in results:
        reused = r["cached_tokens"] / max(1, r["prompt_tokens"])
        print(f"{r['rate']:5.0f} {r['mode']:10s} {r['ttft_avg']:9.2f} {r['ttft_p90']:7.2f} {r['ttft_median']:7.2f} "
              f"{r['latency_avg']:8.2f} {r['latency_p90']:7.2f} {r['latency_median']:7.2f} "
              f"{r['throughput_rps']:6.2f} {reused:7.1%}")  # fmt: skip


if __name__ == "__main__":
    main()
