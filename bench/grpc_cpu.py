"""Daemon overhead: the engine workload sent through gRPC by concurrent streaming clients vs in-process.

The same 32 chat prompts x 64 greedy new tokens (EOS ignored) as bench/engine_cpu.py. The daemon is a
real `cbd serve` process on a unix socket; each prompt is its own streaming Generate call from an
asyncio client, all in flight at once (the daemon renders the chat template itself). The in-process
figure is Engine.generate on token ids in this process, with the same engine config. Rounds alternate
between the two so that machine noise hits both; the table shows the median of each.

    python bench/grpc_cpu.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from engine_cpu import TOPICS  # noqa: E402

from cbd.config import EngineConfig  # noqa: E402
from cbd.engine.engine import Engine  # noqa: E402
from cbd.engine.sampling_params import SamplingParams  # noqa: E402
from cbd_client import AsyncClient  # noqa: E402
from daemon_process import DaemonProcess  # noqa: E402


def messages(count: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]}."}] for i in range(count)]


async def through_grpc(address: str, prompts: list, new_tokens: int) -> float:
    async with AsyncClient(address, timeout=600) as client:

        async def one(prompt) -> int:  # type: ignore[no-untyped-def]
            count = 0
            async for delta in client.stream(prompt, max_tokens=new_tokens, temperature=0, ignore_eos=True):
                count += len(delta.token_ids)
            return count

        start = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts))
        return sum(counts) / (time.perf_counter() - start)


def in_process(engine: Engine, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    return sum(len(r.candidates[0].token_ids) for r in results) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    chats = messages(args.prompts)
    with tempfile.TemporaryDirectory() as tmp:
        daemon = DaemonProcess(Path(tmp) / "cbd.sock")
        try:
            daemon.wait_serving()
            engine = Engine(EngineConfig())
            tok = engine.loaded.tokenizer
            ids = [tok.apply_chat_template(c, add_generation_prompt=True, return_dict=True)["input_ids"] for c in chats]
            in_process(engine, ids[:2], 4)  # warm-up
            asyncio.run(through_grpc(daemon.address, chats[:2], 4))
            local, remote = [], []
            for _ in range(args.rounds):
                local.append(in_process(engine, ids, args.new_tokens))
                remote.append(asyncio.run(through_grpc(daemon.address, chats, args.new_tokens)))
            engine.shutdown()
        finally:
            daemon.stop()

    lo, re_ = statistics.median(local), statistics.median(remote)
    print(
        f"\n{args.prompts} concurrent streams x {args.new_tokens} greedy tokens, {args.rounds} alternating rounds (median)"
    )
    print(f"{'path':40s} {'tok/s':>10s}   rounds")
    print(f"{'in-process Engine.generate':40s} {lo:10.1f}   {', '.join(f'{x:.1f}' for x in local)}")
    print(f"{'cbd daemon via gRPC (unix socket)':40s} {re_:10.1f}   {', '.join(f'{x:.1f}' for x in remote)}")
    print(f"daemon keeps {100 * re_ / lo:.1f}% of in-process throughput")


if __name__ == "__main__":
    main()
