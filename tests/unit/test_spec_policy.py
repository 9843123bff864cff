"""The speculation policy: measured step costs and each sequence's acceptance decide whether a decode
step verifies drafts (engine/spec/policy.py); outputs never depend on it."""

from __future__ import annotations

import pytest

from cbd.engine.sampling_params import SamplingParams
from cbd.engine.sequence import Sequence
from cbd.engine.spec.policy import StepCosts, expected_kept
from helpers import make_core, run_all

# Milliseconds per step: decode graphs (q = 1) and verifying graphs (q = 3, 9) of batch buckets 1, 8, 32.
COSTS = {(1, 1): 4.7, (1, 3): 4.8, (1, 9): 4.8, (8, 1): 5.0, (8, 3): 5.2, (8, 9): 5.6,
         (32, 1): 5.5, (32, 3): 6.6, (32, 9): 9.0}  # fmt: skip


def test_expected_kept_is_the_sum_of_the_chances_of_each_run() -> None:
    assert expected_kept(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert expected_kept(1.0, 8) == 8 and expected_kept(0.0, 8) == 0 and expected_kept(0.9, 0) == 0


def test_a_step_verifies_drafts_when_its_tokens_per_millisecond_beat_a_plain_step() -> None:
    costs = StepCosts(COSTS)
    assert costs.max_batch == 32 and costs.queries == [3, 9]
    assert costs.worth(1, 0.05, 9)  # batch 1: a verifying step costs about a decode step
    assert not costs.worth(1, 0.0, 9)  # nothing expected: never
    # Batch 20 runs the graphs of bucket 32: 20 + E tokens at 9.0 ms vs 20 at 5.5 ms: E > 12.7 needed.
    assert not costs.worth(20, 12.0, 9) and costs.worth(20, 13.0, 9)
    assert costs.worth(20, 4.5, 3) and not costs.worth(20, 3.5, 3)  # fewer drafts: the cheaper graph
    assert not costs.worth(33, 100.0, 3)  # no verifying graph that large: eager verifying is not weighed
    assert not costs.worth(1, 5.0, 17)  # no graph of that many queries
    # A verifying bucket that is no decode bucket (a cap of 6): the plain step's cost is its decode bucket's.
    capped = StepCosts({(4, 1): 4.0, (8, 1): 5.0, (6, 3): 5.0})
    assert capped.worth(6, 0.1, 3) and not capped.worth(
        4, 0.1, 3
    )  # 6.1 / 5.0 beat 6 / 5.0; 4.1 / 5.0 do not beat 4 / 4.0
    # Steps whose device time is mostly outside the graph (a small model): verifying costs relatively less.
    for _ in range(200):
        costs.observe(32, 1, 20.0)
    costs.observe(32, 9, 100.0)  # a verifying step's time teaches nothing about the shared part
    assert costs.outside[32] == pytest.approx(14.5, rel=1e-3)
    assert costs.worth(20, 5.0, 9)  # 25 tokens in 23.5 ms beat 20 in 20 ms


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
