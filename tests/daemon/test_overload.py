"""Overload through the daemon: a KV pool far too small for the offered load loses and duplicates nothing.

The same mixed workload (plain requests, greedy and sampled fan-outs, multi-turn sessions; more calls
at once than the admission cap) runs against two daemons on the same tiny model: one whose KV pool
holds about one request at a time, one with room for everything. The small one must preempt and
refuse (RESOURCE_EXHAUSTED with a retry hint, which the clients honour), yet every call ends exactly
once with exactly its tokens, greedy outputs equal the unconstrained run token for token, and
afterwards no block, request or session is left behind.
"""

from __future__ import annotations

import asyncio
import random
import time

import grpc

from cbd_client import AsyncClient, CbdError
from daemon_process import DaemonProcess

PLAIN, FANOUT, SAMPLED, SESSIONS, TURNS = 48, 10, 8, 4, 3


def workload(seed: int = 5) -> list[dict]:
    rng = random.Random(seed)

    def prompt(lo: int = 4, hi: int = 60) -> list[int]:
        return [rng.randrange(2, 250) for _ in range(rng.randrange(lo, hi))]

    calls: list[dict] = []
    for _ in range(PLAIN):
        calls.append(dict(kind="plain", prompt=prompt(), n=1, max_tokens=rng.randrange(8, 80), temperature=0.0))
    for _ in range(FANOUT):  # greedy candidates must all equal the single greedy answer
        calls.append(dict(kind="plain", prompt=prompt(4, 30), n=3, max_tokens=rng.randrange(8, 40), temperature=0.0))
    for i in range(SAMPLED):
        calls.append(dict(kind="plain", prompt=prompt(4, 30), n=2, max_tokens=rng.randrange(8, 40),
                          temperature=0.8, seed=i))  # fmt: skip
    for _ in range(SESSIONS):
        turns = [dict(prompt=prompt(4, 20), max_tokens=rng.randrange(8, 24)) for _ in range(TURNS)]
        calls.append(dict(kind="session", turns=turns))
    rng.shuffle(calls)
    return calls


async def run_workload(address: str) -> tuple[dict, int]:
    """Run every call at once; returns {call index: output} and how many submissions were refused."""
    refused = 0

    async def retrying(make_stream):
        nonlocal refused
        while True:
            tokens: dict[int, list[int]] = {}
            finishes: dict[int, str] = {}
            try:
                async for delta in make_stream():
                    assert delta.index not in finishes, "a delta after its candidate finished"
                    tokens.setdefault(delta.index, []).extend(delta.token_ids)
                    if delta.finish_reason:
                        finishes[delta.index] = delta.finish_reason
                        assert delta.usage is not None and delta.usage.completion_tokens == len(tokens[delta.index])
                return tokens, finishes
            except CbdError as e:
                assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                assert not tokens, "refused after streaming tokens"
                assert e.retry_after is not None and 0 < e.retry_after <= 30, e
                refused += 1
                await asyncio.sleep(e.retry_after)

    async with AsyncClient(address, timeout=300) as client:

        async def one(call: dict) -> object:
            if call["kind"] == "plain":
                kw = {k: v for k, v in call.items() if k not in ("kind", "prompt", "n")}
                return await retrying(lambda: client.stream(call["prompt"], n=call["n"], ignore_eos=True, **kw))
            session = await client.session(ttl=300)
            outputs = []
            for turn in call["turns"]:
                outputs.append(await retrying(
                    lambda turn=turn: session.stream(turn["prompt"], max_tokens=turn["max_tokens"], temperature=0.0,
                                                     ignore_eos=True)))  # fmt: skip
            await session.close()
            return outputs

        calls = workload()
        results = await asyncio.gather(*(one(c) for c in calls))
        deadline = time.monotonic() + 30
        while True:
            stats = await client.stats()
            if (stats.running, stats.waiting, stats.live_requests, stats.kv_blocks_used, stats.open_sessions) == (
                0, 0, 0, 0, 0,
            ):  # fmt: skip
                break
            assert time.monotonic() < deadline, stats
            await asyncio.sleep(0.1)
        return dict(enumerate(results)), refused, stats  # type: ignore[return-value]


def check_complete(calls: list[dict], results: dict) -> None:
    """Every candidate ended once, with 'length' and exactly max_tokens tokens (EOS is ignored)."""
    for i, call in enumerate(calls):
        if call["kind"] == "plain":
            tokens, finishes = results[i]
            assert sorted(finishes) == list(range(call["n"])) and set(finishes.values()) == {"length"}
            assert all(len(tokens[c]) == call["max_tokens"] for c in range(call["n"]))
        else:
            for turn, (tokens, finishes) in zip(call["turns"], results[i], strict=True):
                assert finishes == {0: "length"} and len(tokens[0]) == turn["max_tokens"]


def test_a_pool_far_too_small_completes_everything_exactly_once_with_unconstrained_greedy_outputs(
    tiny_checkpoint, tmp_path
) -> None:
    model = str(tiny_checkpoint("llama"))
    exact = ("--cpu-packed-gemm", "false")  # BLAS GEMMs: a row's logits do not depend on the batch
    small = DaemonProcess(tmp_path / "small.sock", "--model", model, *exact, "--num-kv-blocks", "24",
                          "--max-num-seqs", "32", "--max-queued-requests", "40")  # fmt: skip
    large = DaemonProcess(tmp_path / "large.sock", "--model", model, *exact, "--num-kv-blocks", "4096")
    try:
        small.wait_serving(120)
        large.wait_serving(120)
        calls = workload()
        constrained, refused, small_stats = asyncio.run(run_workload(small.address))
        reference, _, _ = asyncio.run(run_workload(large.address))
        assert small.process.poll() is None and large.process.poll() is None
    finally:
        small.stop()
        large.stop()

    assert small_stats.num_preemptions > 0, "the small pool never ran out: the test does not test overload"
    assert refused > 0, "admission never refused: the test does not test the cap"
    check_complete(calls, constrained)
    check_complete(calls, reference)
    for i, call in enumerate(calls):
        if call["kind"] == "session":
            assert [t for t, _ in constrained[i]] == [t for t, _ in reference[i]], f"session {i} differs"
        elif call["temperature"] == 0.0:
            assert constrained[i][0] == reference[i][0], f"greedy call {i} differs"
            assert all(constrained[i][0][c] == constrained[i][0][0] for c in range(call["n"]))
