"""The proxy hop: the engine workload through Envoy (deploy/) vs straight to the same daemon (CPU).

One replica behind Envoy (deploy/cluster.py). The same 32 chat prompts x 64 greedy new tokens as
bench/grpc_cpu.py, all streamed at once by cbd's AsyncClient, alternately to Envoy's address and to the
replica's own socket; medians of the rounds.

    python bench/envoy_cpu.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deploy"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from cluster import Cluster  # noqa: E402
from grpc_cpu import messages, through_grpc  # noqa: E402

from cbd_client.address import free_port  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    chats = messages(args.prompts)
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster(1, f"127.0.0.1:{port}", [], Path(tmp))
        try:
            cluster.start()
            paths = {"direct": cluster.addresses[0], "envoy": cluster.listen}
            for address in paths.values():
                asyncio.run(through_grpc(address, chats[:2], 4))  # warm-up
            rates: dict[str, list[float]] = {name: [] for name in paths}
            for r in range(args.rounds):
                for name in list(paths)[:: 1 if r % 2 == 0 else -1]:
                    rates[name].append(asyncio.run(through_grpc(paths[name], chats, args.new_tokens)))
        finally:
            cluster.stop()
    d, e = statistics.median(rates["direct"]), statistics.median(rates["envoy"])
    print(f"\n{args.prompts} concurrent streams x {args.new_tokens} greedy tokens, {args.rounds} alternating rounds")
    print(f"{'path':36s} {'tok/s':>8s}   rounds")
    for name, label in (
        ("direct", "straight to the daemon (unix socket)"),
        ("envoy", "through Envoy (TCP, then unix)"),
    ):
        print(f"{label:36s} {statistics.median(rates[name]):8.1f}   {', '.join(f'{x:.1f}' for x in rates[name])}")
    print(f"through Envoy / direct: {e / d:.3f}")


if __name__ == "__main__":
    main()
