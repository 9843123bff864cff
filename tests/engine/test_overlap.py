"""The overlap loop (one step in flight, placeholders, carry-over) gives exactly what the sync loop gives.

On CPU the stream/event operations are no-ops but the bookkeeping is the same as on CUDA: step N+1
is scheduled and launched before step N's tokens are processed.
"""

from __future__ import annotations

import random

import pytest

from cbd.engine.core import EngineCore
from cbd.engine.sampling_params import SamplingParams
from cbd.engine.sequence import FinishReason
from helpers import checked_step, collect, make_core, run_all


def _drive(core: EngineCore, arrivals: dict[int, list[tuple[list[int], SamplingParams]]],
           aborts: dict[int, list[int]]) -> list[dict]:  # fmt: skip
    """Step to completion; at step k submit arrivals[k] and abort the aborts[k]-th submitted requests."""
    ids: list[str] = []
    results: dict[str, dict] = {}
    step = 0
    while step <= max(arrivals) or core.has_work():
        for prompt, params in arrivals.get(step, []):
            rid = core.add_request(prompt, params).request_id
            ids.append(rid)
            results[rid] = {"tokens": {}, "text": {}, "finish": {}, "usage": None, "outputs": []}
        for index in aborts.get(step, []):
            if ids[index] in core.requests:
                collect(results[ids[index]], core.abort_request(ids[index]))
        for out in checked_step(core):
            collect(results[out.request_id], out)
        step += 1
        assert step < 10_000
    return [results[rid] for rid in ids]


def _workload(tokenizer) -> dict[int, list[tuple[list[int], SamplingParams]]]:
    questions = [
        "What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
        "Explain gravity to a child.", "Say hello.", "What is 2 + 2?", "Name a color.", "Tell me a joke.",
    ]  # fmt: skip
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_dict=True)[
            "input_ids"
        ]
        for q in questions
    ]
    g = dict(temperature=0.0)
    params = [
        SamplingParams(max_tokens=24, **g),
        SamplingParams(max_tokens=40, stop=(".",), **g),  # stop string: the token in flight is dropped
        SamplingParams(max_tokens=1, **g),  # finishes on its first token
        SamplingParams(max_tokens=30, n=3, temperature=0.8, seed=7),  # fan-out, seeded
        SamplingParams(max_tokens=16, n=2, **g),
        SamplingParams(max_tokens=48, logprobs=2, **g),
        SamplingParams(max_tokens=20, stop=("\n", "blue"), **g),
        SamplingParams(max_tokens=64, **g),  # aborted in flight
    ]
    arrivals = list(zip(prompts, params))
    return {0: arrivals[:5], 3: arrivals[5:7], 6: arrivals[7:]}  # later arrivals join a running batch


@pytest.mark.slow
def test_overlap_equals_sync_on_the_default_model(default_model) -> None:
    runs = {}
    for mode in ("off", "on"):
        core = make_core(default_model, overlap=mode, block_size=8, max_num_batched_tokens=64)
        assert core.overlap == (mode == "on")
        runs[mode] = _drive(core, _workload(default_model.tokenizer), aborts={9: [7]})
        assert core.block_manager.num_used_blocks == 0 and not core.requests
    sync, overlap = runs["off"], runs["on"]
    for index, (a, b) in enumerate(zip(sync, overlap)):
        if index == 7:  # aborted: both streamed a prefix of the same greedy continuation, then ABORT
            assert a["finish"] == b["finish"] == {0: FinishReason.ABORT}
            short, long = sorted((a["tokens"][0], b["tokens"][0]), key=len)
            assert long[: len(short)] == short and len(short) > 0
            continue
        assert a["tokens"] == b["tokens"], index
        assert a["text"] == b["text"], index
        assert a["finish"] == b["finish"], index
        assert a["usage"] == b["usage"], index
        if index == 5:
            assert [d.logprobs for o in a["outputs"] for d in o.candidates] == [
                d.logprobs for o in b["outputs"] for d in o.candidates
            ]
    assert overlap[1]["finish"][0] == FinishReason.STOP and "." not in overlap[1]["text"][0]  # stop text withheld
    assert overlap[2]["usage"].completion_tokens == 1


def test_overlap_with_preemption_and_stops_equals_sync(tiny_loaded) -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(2, 256) for _ in range(rng.randrange(3, 50))] for _ in range(12)]
    params = [
        SamplingParams(
            max_tokens=rng.randrange(1, 40),
            temperature=0.0 if i % 3 else 0.9,
            seed=i,
            n=1 + i % 3,
            ignore_eos=True,
            stop_token_ids=(17, 33) if i % 4 == 0 else (),
        )  # fmt: skip
        for i in range(12)
    ]
    results = {}
    for mode in ("off", "on"):
        core = make_core(tiny_loaded, overlap=mode, num_kv_blocks=30, block_size=4, max_num_batched_tokens=40)
        results[mode] = run_all(core, prompts, params)
        assert core.scheduler.num_preemptions > 0
        assert core.block_manager.num_used_blocks == 0 and not core.has_work()
    for a, b, p in zip(results["off"], results["on"], params):
        assert a["tokens"] == b["tokens"] and a["finish"] == b["finish"] and a["usage"] == b["usage"]
        for tokens in b["tokens"].values():  # nothing is streamed after a stop token
            stops = [i for i, t in enumerate(tokens) if t in p.stop_token_ids]
            assert not stops or stops[0] == len(tokens) - 1


def test_overlap_aborts_at_every_point_free_everything(tiny_loaded) -> None:
    rng = random.Random(4)
    for abort_step in range(0, 12):
        core = make_core(tiny_loaded, overlap="on", block_size=4, max_num_batched_tokens=24)
        prompts = [[rng.randrange(2, 256) for _ in range(rng.randrange(3, 40))] for _ in range(6)]
        arrivals = {0: [(p, SamplingParams(max_tokens=20, n=1 + i % 3, temperature=0.5, seed=i, ignore_eos=True))
                        for i, p in enumerate(prompts)]}  # fmt: skip
        results = _drive(core, arrivals, aborts={abort_step: [0, 2, 4]})
        assert core.block_manager.num_used_blocks == 0 and not core.requests and not core.has_work()
        for i, r in enumerate(results):
            assert r["usage"] is not None and len(r["finish"]) == 1 + i % 3
            for c, tokens in r["tokens"].items():
                assert r["usage"].completion_tokens >= len(tokens)
                if i % 2:
                    assert len(tokens) == 20 and r["finish"][c] == FinishReason.LENGTH
