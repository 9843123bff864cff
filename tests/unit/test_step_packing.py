"""Packing a step: the plain-decode path gathers exactly the arrays the general one-chunk-at-a-time path does,
and only plain decode steps take it."""

from __future__ import annotations

import itertools
import random

import pytest

from cbd.engine.device.step_inputs import gather_chunks, gather_decodes, is_plain_decode
from cbd.engine.sampling_params import SamplingParams
from cbd.engine.sched.plan import SampleRow, ScheduledChunk, StepPlan
from cbd.engine.sequence import Request, Sequence

_ids = itertools.count()


def _seq(rng: random.Random) -> Sequence:
    tokens = [rng.randrange(1000) for _ in range(rng.randrange(1, 60))]
    request = Request(f"r{next(_ids)}", tokens, SamplingParams(), seed=0)
    seq = Sequence(next(_ids), request, 0, list(tokens), len(tokens))
    seq.block_table = [rng.randrange(500) for _ in range(-(-len(tokens) // 8))]
    return seq


def _decode_plan(rng: random.Random, num_seqs: int) -> StepPlan:
    plan = StepPlan()
    for _ in range(num_seqs):
        seq = _seq(rng)
        chunk = ScheduledChunk(seq, 1, start=len(seq.token_ids) - 1, samples=True)
        if rng.random() < 0.7:  # its newest token is still being sampled by the step in flight
            chunk.carry_row = rng.randrange(4 * num_seqs)
        plan.chunks.append(chunk)
        plan.samples.append(SampleRow(seq, seq, len(seq.token_ids)))
    return plan


@pytest.mark.parametrize("num_seqs", [1, 2, 7, 64])
def test_a_plain_decode_step_gathers_what_the_general_path_gathers(num_seqs: int) -> None:
    rng = random.Random(num_seqs)
    for _ in range(20):
        plan = _decode_plan(rng, num_seqs)
        assert is_plain_decode(plan)
        assert gather_decodes(plan) == gather_chunks(plan)


@pytest.mark.parametrize("change", ["longer chunk", "drafts", "after drafts in flight", "a fork", "no sample"])
def test_other_steps_take_the_general_path(change: str) -> None:
    rng = random.Random(0)
    plan = _decode_plan(rng, 5)
    chunk = plan.chunks[2]
    if change == "longer chunk":
        chunk.num_new_tokens, chunk.start = 3, chunk.start - 2
    elif change == "drafts":
        chunk.num_draft = 1
    elif change == "after drafts in flight":
        chunk.carry_row, chunk.carry_group = 0, 0
    elif change == "a fork":
        plan.samples.insert(3, SampleRow(chunk.seq, _seq(rng), plan.samples[2].position))
    else:
        chunk.samples = False
    assert not is_plain_decode(plan)
