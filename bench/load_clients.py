"""A load generator of many client processes: one fixed batch of streaming Generate calls, all at once.

The calls are dealt round-robin to P processes; each process opens its own channel, builds its requests,
reports ready, and on the go signal starts all of its calls together (asyncio), reading every stream to
its end. One Python client process can read only so many messages per second; with P processes the
client is never the limit. Given an http(s) URL instead of a gRPC address, the same calls go through the
OpenAI-compatible gateway (streamed /v1/completions on token ids, httpx). Times are CLOCK_MONOTONIC, one clock for every process of the host.

    from load_clients import Call, run
    result = run("unix:/tmp/cbd.sock", [Call(prompt_ids, max_tokens=256)] * 128, processes=8)
    result.tokens / result.seconds
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Call:
    prompt: list[int]
    max_tokens: int
    temperature: float = 0.0
    ignore_eos: bool = True
    stream_interval: int | None = None  # tokens per stream message (gRPC only; None: the daemon's default)


@dataclass(slots=True)
class Result:
    tokens: int  # generated tokens received, all streams
    messages: int  # stream messages received
    seconds: float  # from the go signal to the last stream's end
    errors: list[str] = field(default_factory=list)


def _http_client(url: str, calls: list[Call], ready: mp.Queue, go: mp.Event, done: mp.Queue) -> None:  # type: ignore[type-arg]
    """The same calls through the OpenAI-compatible gateway: streamed /v1/completions on token ids."""
    import json

    import httpx

    async def main() -> tuple[int, int, float, list[str]]:
        bodies = [
            {"model": "cbd", "prompt": c.prompt, "max_tokens": c.max_tokens, "temperature": c.temperature,
             "ignore_eos": c.ignore_eos, "stream": True, "stream_options": {"include_usage": True}}
            for c in calls
        ]  # fmt: skip
        limits = httpx.Limits(max_connections=len(calls) + 1, max_keepalive_connections=len(calls) + 1)
        async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
            await client.get("/models")
            ready.put(None)
            await asyncio.to_thread(go.wait)
            errors: list[str] = []

            async def one(body: dict) -> tuple[int, int]:  # type: ignore[type-arg]
                tokens = messages = 0
                async with client.stream("POST", "/completions", json=body) as response:
                    if response.status_code != 200:
                        errors.append(f"{response.status_code}: {(await response.aread())[:200]!r}")
                        return 0, 0
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            messages += 1
                            usage = json.loads(line[6:]).get("usage")
                            if usage:
                                tokens = usage["completion_tokens"]
                return tokens, messages

            counts = await asyncio.gather(*(one(b) for b in bodies))
            end = time.monotonic()
        return sum(t for t, _ in counts), sum(m for _, m in counts), end, errors

    done.put(asyncio.run(main()))


def _client(address: str, calls: list[Call], ready: mp.Queue, go: mp.Event, done: mp.Queue) -> None:  # type: ignore[type-arg]
    import grpc

    from cbd_client.v1 import cbd_pb2 as pb
    from cbd_client.v1 import cbd_pb2_grpc

    async def main() -> tuple[int, int, float, list[str]]:
        requests = [
            pb.GenerateRequest(
                tokens=pb.TokenIds(ids=c.prompt),
                sampling=pb.SamplingParams(max_tokens=c.max_tokens, temperature=c.temperature, ignore_eos=c.ignore_eos),
                stream_interval=c.stream_interval,
            )
            for c in calls
        ]
        options = [("grpc.max_receive_message_length", 64 << 20)]
        async with grpc.aio.insecure_channel(address, options=options) as channel:
            stub = cbd_pb2_grpc.CbdStub(channel)
            await channel.channel_ready()
            ready.put(None)
            await asyncio.to_thread(go.wait)
            errors: list[str] = []

            async def one(request: pb.GenerateRequest) -> tuple[int, int]:
                tokens = messages = 0
                try:
                    async for response in stub.Generate(request, timeout=3600):
                        messages += 1
                        tokens += sum(len(c.token_ids) for c in response.candidates)
                except grpc.aio.AioRpcError as exc:
                    errors.append(f"{exc.code().name}: {exc.details()}")
                return tokens, messages

            counts = await asyncio.gather(*(one(r) for r in requests))
            end = time.monotonic()
        return sum(t for t, _ in counts), sum(m for _, m in counts), end, errors

    done.put(asyncio.run(main()))


def run(address: str, calls: list[Call], processes: int = 8, timeout: float = 3600.0) -> Result:
    """address: the daemon's gRPC address, or the gateway's base URL (http://host:port/v1)."""
    ctx = mp.get_context("spawn")
    ready, done, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    shares = [calls[i::processes] for i in range(processes)]
    target = _http_client if address.startswith("http") else _client
    procs = [ctx.Process(target=target, args=(address, s, ready, go, done), daemon=True) for s in shares if s]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=timeout)
    start = time.monotonic()
    go.set()
    results = [done.get(timeout=timeout) for _ in procs]
    for p in procs:
        p.join(timeout)
    errors = [e for r in results for e in r[3]]
    return Result(sum(r[0] for r in results), sum(r[1] for r in results), max(r[2] for r in results) - start, errors)
