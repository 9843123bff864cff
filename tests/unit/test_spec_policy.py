"""The speculation policy: measured step costs and each sequence's acceptance decide whether a decode
step verifies drafts (engine/spec/policy.py); outputs never depend on it."""

from __future__ import annotations

import pytest

from cbd.engine.sampling_params import SamplingParams
from cbd.engine.sequence import Sequence
from cbd.engine.spec.policy import StepCosts, expected_kept, observed_accept
from helpers import make_core, run_all

# Milliseconds per step: decode graphs (q = 1) and verifying graphs (q = 3, 9) of batch buckets 1, 8, 32.
COSTS = {(1, 1): 4.7, (1, 3): 4.8, (1, 9): 4.8, (8, 1): 5.0, (8, 3): 5.2, (8, 9): 5.6,
         (32, 1): 5.5, (32, 3): 6.6, (32, 9): 9.0}  # fmt: skip


def test_expected_kept_is_the_sum_of_the_chances_of_each_run() -> None:
    assert expected_kept(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert expected_kept(1.0, 8) == 8 and expected_kept(0.0, 8) == 0 and expected_kept(0.9, 0) == 0


def test_a_verification_counts_only_the_drafts_it_tried() -> None:
    assert observed_accept(4, 8) == pytest.approx(4 / 5)  # the 5th was rejected, the last 3 never tried
    assert (
        observed_accept(8, 8) == 1.0 and observed_accept(0, 8) == 0.0 and observed_accept(2, 3) == pytest.approx(2 / 3)
    )


def test_a_step_verifies_the_drafts_that_make_the_most_tokens_per_millisecond() -> None:
    costs = StepCosts(COSTS)
    assert costs.max_batch == 32 and costs.queries == [3, 9]
    sure, half, never = (1.0, 8), (0.5, 8), (0.0, 8)
    assert costs.best_queries(1, [sure]) == 9  # batch 1: a verifying step costs about a decode step
    assert costs.best_queries(1, [never]) == 1  # nothing expected: never
    assert costs.best_queries(1, []) == 1 and costs.best_queries(1, [(1.0, 0)]) == 1
    # Batch 20 runs the graphs of bucket 32: 20 at 5.5 ms = 3.64 tokens/ms. Eight sequences sure of 8
    # drafts: q = 9 gives 84 / 9.0 = 9.3, q = 3 gives 36 / 6.6 = 5.5.
    assert costs.best_queries(20, [sure] * 8) == 9
    # Each of 20 sequences keeps a draft with chance one half: q = 3 gives (20 + 15) / 6.6 = 5.3 tokens/ms,
    # q = 9 (20 + 19.9) / 9.0 = 4.4: fewer drafts in the cheaper graph.
    assert costs.best_queries(20, [half] * 20) == 3
    assert costs.best_queries(20, [half] * 2) == 1  # 23 / 6.6 < 20 / 5.5
    assert costs.best_queries(8, [(1.0, 2)]) == 3  # two drafts asked for: the graph of 3 queries at most
    assert costs.best_queries(33, [sure] * 33) == 1  # no verifying graph that large: eager verifying is not weighed
    # A verifying bucket that is no decode bucket (a cap of 6): the plain step's cost is its decode bucket's.
    capped = StepCosts({(4, 1): 4.0, (8, 1): 5.0, (6, 3): 5.0})
    assert capped.best_queries(6, [(0.5, 2)]) == 3  # 6.75 / 5.0 beat 1.1 x 6 / 5.0
    assert capped.best_queries(4, [(0.5, 2)]) == 1  # 4.75 / 5.0 do not beat 1.1 x 4 / 4.0
    # The margin: a verifying step promising less than 1.1 times a plain step's rate is not taken.
    assert capped.best_queries(6, [(0.1, 2)]) == 1  # 6.11 / 5.0 beat 6 / 5.0, but not by 1.1


def test_step_costs_follow_the_steps_as_they_run() -> None:
    costs = StepCosts(COSTS)
    # Steps whose device time is mostly outside the graph (a small model): before a verifying step has
    # run, its cost is its graph's plus the decode steps' time outside theirs.
    for _ in range(200):
        costs.observe(32, 1, 20.0)
    assert costs.outside[32] == pytest.approx(14.5, rel=1e-3)
    assert costs.cost(32, 9, 32) == pytest.approx(23.5, rel=1e-3)
    assert costs.best_queries(20, [(0.9, 8)] * 10) == 9  # (20 + 51.3) / 23.5 beat (20 + 17.1) / 21.1 and 20 / 20
    # Verifying steps that turn out dearer (their sampling grows with the queries) are weighed as they ran.
    for _ in range(200):
        costs.observe(32, 9, 60.0)
    assert costs.cost(32, 9, 32) == pytest.approx(60.0, rel=1e-3)
    assert costs.outside[32] == pytest.approx(14.5, rel=1e-3)  # a verifying step teaches nothing about it
    assert costs.best_queries(20, [(0.9, 8)] * 10) == 3  # the cheaper graph now: (20 + 17.1) / 21.1 beat 71.3 / 60
    costs.observe(16, 9, 1.0)  # a graph never captured: ignored
    assert (16, 9) not in costs.seen


class _Drafter:
    """Proposes the same token at every step (rarely what the model says)."""

    def propose(self, seq: Sequence, k: int, end: int | None = None) -> list[int]:
        return [7] * k


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_the_policy_decides_whether_drafts_are_made_and_outputs_are_the_same(tiny_loaded, overlap: str) -> None:  # type: ignore[no-untyped-def]
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16], [17, 18, 19, 20]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    off = [r["tokens"] for r in run_all(make_core(tiny_loaded, speculative="off"), prompts, params)]
    drafted = {}
    for name, costs in (("cheap", COSTS), ("dear", {k: v * (10 if k[1] > 1 else 1) for k, v in COSTS.items()})):
        core = make_core(tiny_loaded, speculative="auto", speculative_max_batch=8, overlap=overlap)
        speculator = core.scheduler.speculator
        speculator.drafter, speculator.costs = _Drafter(), StepCosts(costs)
        assert [r["tokens"] for r in run_all(core, prompts, params)] == off
        stats = core.stats().speculation
        assert stats is not None
        drafted[name] = stats.num_draft_tokens
        assert core.block_manager.num_used_blocks == 0
    assert drafted["cheap"] > 0 and drafted["dear"] == 0, drafted
