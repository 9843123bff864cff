"""The OpenAI-compatible gateway vs the daemon's own client, on the same daemon and workload (CPU).

32 chat prompts x 64 greedy new tokens (EOS ignored), all streamed at once: through `cbd openai` with the
official `openai` package (AsyncOpenAI, stream=True, include_usage), and straight to the daemon with
cbd's AsyncClient. Rounds alternate between the two so that machine drift hits both; the table shows
each path's median.

    python bench/openai_cpu.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from grpc_cpu import messages, through_grpc  # noqa: E402

from cbd_client.address import free_port  # noqa: E402
from daemon_process import DaemonProcess  # noqa: E402


async def through_gateway(url: str, prompts: list, new_tokens: int) -> float:
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)

    async def one(prompt) -> int:  # type: ignore[no-untyped-def]
        stream = await client.chat.completions.create(
            model="cbd", messages=prompt, max_tokens=new_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        tokens = 0
        async for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return tokens

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts))
    seconds = time.perf_counter() - start
    await client.close()
    return sum(counts) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    chats = messages(args.prompts)
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        daemon = DaemonProcess(Path(tmp) / "cbd.sock")
        gateway = subprocess.Popen([sys.executable, "-m", "cbd.cli", "openai", "--daemon", daemon.address,
                                    "--listen", f"127.0.0.1:{port}", "--log-level", "warning"])  # fmt: skip
        try:
            daemon.wait_serving()
            while True:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.2)
            url = f"http://127.0.0.1:{port}/v1"
            asyncio.run(through_grpc(daemon.address, chats[:2], 4))  # warm-up, both paths
            asyncio.run(through_gateway(url, chats[:2], 4))
            direct, gw = [], []
            for r in range(args.rounds):
                order = (0, 1) if r % 2 == 0 else (1, 0)
                for which in order:
                    if which == 0:
                        direct.append(asyncio.run(through_grpc(daemon.address, chats, args.new_tokens)))
                    else:
                        gw.append(asyncio.run(through_gateway(url, chats, args.new_tokens)))
        finally:
            gateway.terminate()
            gateway.wait(30)
            daemon.stop()
    d, g = statistics.median(direct), statistics.median(gw)
    print(f"\n{args.prompts} concurrent streams x {args.new_tokens} greedy tokens, {args.rounds} alternating rounds")
    print(f"{'path':44s} {'tok/s':>8s}   rounds")
    print(f"{'daemon, cbd AsyncClient (gRPC)':44s} {d:8.1f}   {', '.join(f'{x:.1f}' for x in direct)}")
    print(f"{'gateway, openai AsyncOpenAI (HTTP + SSE)':44s} {g:8.1f}   {', '.join(f'{x:.1f}' for x in gw)}")
    print(f"gateway / own client: {g / d:.3f}")


if __name__ == "__main__":
    main()
