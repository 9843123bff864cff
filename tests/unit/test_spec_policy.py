"""The speculation policy: measured step costs and each sequence's acceptance decide whether a decode
step verifies drafts (engine/spec/policy.py); outputs never depend on it."""

from __future__ import annotations

import pytest

from cbd.engine.kv.blocks import BlockManager
from cbd.engine.sampling_params import SamplingParams
from cbd.engine.sched.plan import ScheduledChunk, StepPlan
from cbd.engine.sequence import Request, Sequence
from cbd.engine.spec.drafter import NgramDrafter
from cbd.engine.spec.policy import COMPLETE, DELIVER, LAUNCH, StepCosts, observed_accept
from cbd.engine.spec.speculator import Speculator
from helpers import eager_graphs, make_core, run_all

# Milliseconds per step: decode graphs (batch, batch) and verifying graphs (batch, tokens) of buckets 1, 8, 32.
COSTS = {(1, 1): 4.7, (1, 3): 4.8, (1, 9): 4.8,
         (8, 8): 5.0, (8, 10): 5.1, (8, 16): 5.2, (8, 72): 5.6,
         (32, 32): 5.5, (32, 34): 5.6, (32, 40): 5.8, (32, 64): 6.6, (32, 160): 8.0, (32, 288): 9.0}  # fmt: skip


def test_a_verification_counts_only_the_drafts_it_tried() -> None:
    assert observed_accept(4, 8) == pytest.approx(4 / 5)  # the 5th was rejected, the last 3 never tried
    assert (
        observed_accept(8, 8) == 1.0 and observed_accept(0, 8) == 0.0 and observed_accept(2, 3) == pytest.approx(2 / 3)
    )


def test_a_step_verifies_the_drafts_that_make_the_most_tokens_per_millisecond() -> None:
    costs = StepCosts(COSTS, 8, overlap=True)
    assert costs.max_batch == 32 and costs.tokens[32] == [34, 40, 64, 160, 288]
    sure, half, never = (1.0, 8, 1.0), (0.5, 8, 1.0), (0.0, 8, 1.0)
    assert costs.plan_drafts(1, [sure]) == [8]  # batch 1: a verifying step costs about a decode step
    assert costs.plan_drafts(1, [never]) == [0]  # nothing expected: never
    assert costs.plan_drafts(1, []) == [] and costs.plan_drafts(1, [(1.0, 0, 1.0)]) == [0]
    # Batch 20 runs the graphs of bucket 32: 20 at 5.5 ms = 3.64 tokens/ms. Eight sequences sure of 8
    # drafts: 160 rows give 84 / 8.0 = 10.5, 64 rows (44 drafts) 64 / 6.6 = 9.7.
    assert costs.plan_drafts(20, [sure] * 8) == [8] * 8
    # The rows are ragged: one sequence's drafts cost its own rows (28 / 5.6 = 5.0 tokens/ms), not the batch
    # padded to its run (28 / 9.0 = 3.1, less than a plain step).
    assert costs.plan_drafts(20, [sure]) == [8]
    # Drafts that follow drafts still in flight count only as likely as those are all kept: (20 + 0.8) / 5.6.
    assert costs.plan_drafts(20, [(1.0, 8, 0.1)]) == [0]
    # Each of 20 sequences keeps a draft with chance one half: 44 drafts (64 rows) give (20 + 15.5) / 6.6 =
    # 5.4 tokens/ms, all 140 (160 rows) (20 + 19.8) / 8.0 = 5.0: two or three each, the cheaper graph.
    half_plan = costs.plan_drafts(20, [half] * 20)
    assert sum(half_plan) == 44 and set(half_plan) == {2, 3}
    assert costs.plan_drafts(20, [half] * 2) == [0, 0]  # 21 / 5.6 < 1.1 x 20 / 5.5
    # The better sequence's drafts first: its eight (13.1 / 5.2) beat both's sixteen (13.6 / 5.6).
    assert costs.plan_drafts(8, [(0.9, 8, 1.0), (0.3, 8, 1.0)]) == [8, 0]
    assert costs.plan_drafts(8, [(1.0, 2, 1.0)]) == [2]  # two drafts found: two verified
    assert costs.plan_drafts(33, [sure] * 33) == [0] * 33  # no verifying graph that large: eager is not weighed
    # A verifying bucket that is no decode bucket (a cap of 6): the plain step's cost is its decode bucket's.
    capped = StepCosts({(4, 4): 4.0, (8, 8): 5.0, (6, 8): 5.0}, 2, overlap=True)
    assert capped.plan_drafts(6, [(0.5, 2, 1.0)]) == [2]  # 6.75 / 5.0 beat 1.1 x 6 / 5.0
    assert capped.plan_drafts(4, [(0.5, 2, 1.0)]) == [0]  # 4.75 / 5.0 do not beat 1.1 x 4 / 4.0
    assert capped.plan_drafts(6, [(0.5, 8, 1.0)]) == [2]  # at most max_drafts a sequence
    # The margin: a verifying step promising less than 1.1 times a plain step's rate is not taken.
    assert capped.plan_drafts(6, [(0.1, 2, 1.0)]) == [0]  # 6.11 / 5.0 beat 6 / 5.0, but not by 1.1


def test_a_sequence_without_its_own_estimate_is_weighed_skeptically_beside_others() -> None:
    """The engine's recent acceptance is held up by the sequences that copy: beside other sequences (whose step
    a wrongly taken verification slows too) a sequence that has no estimate of its own is weighed at
    NEWCOMER times it; alone, at all of it."""
    speculator = Speculator(BlockManager(64, 4), 1024, NgramDrafter(), 8)
    speculator.costs = StepCosts(COSTS, 8, overlap=True)
    speculator.accept_prior = 0.95  # a copying engine, verifying lately
    request = Request("r", [1, 2, 3], SamplingParams(), 0)
    seqs = [Sequence(i, request, 0, [1, 2, 3, 4], 3) for i in range(20)]
    newcomer, known = seqs[0], seqs[1]
    known.draft_accept = 0.95
    drafts = [7] * 8
    batch = StepPlan(chunks=[ScheduledChunk(seq, 1) for seq in seqs])
    # At 0.95 eight drafts are worth 6.4 tokens: (20 + 6.4) / 5.6 beat 1.1 x 20 / 5.5; at half, 0.9 do not.
    assert speculator._draft_caps(batch, [(batch.chunks[1], drafts)]) == [8]
    assert speculator._draft_caps(batch, [(batch.chunks[0], drafts)]) == [0]
    alone = StepPlan(chunks=[ScheduledChunk(newcomer, 1)])
    assert speculator._draft_caps(alone, [(alone.chunks[0], drafts)]) == [8]
    assert speculator.prior() == 0.95  # the estimate a verification starts from is not lowered


def test_step_costs_follow_the_steps_as_they_run() -> None:
    costs = StepCosts(COSTS, 8, overlap=True)
    # Steps whose device time is mostly outside the graph (a small model): before a verifying step has
    # run, its cost is its graph's plus the decode steps' time outside theirs.
    for _ in range(200):
        costs.observe(32, 32, 20.0)
    assert costs.outside[32] == pytest.approx(14.5, rel=1e-3)
    assert costs.cost(32, 288, 32) == pytest.approx(23.5, rel=1e-3)
    # All 80 drafts (160 rows): (20 + 51.3) / 22.5 beat 44 of them (64 rows): 53.3 / 21.1, and 20 / 20.
    assert costs.plan_drafts(20, [(0.9, 8, 1.0)] * 10) == [8] * 10
    # Verifying steps that turn out dearer (their sampling grows with the rows) are weighed as they ran.
    for _ in range(200):
        costs.observe(32, 160, 60.0)
    assert costs.cost(32, 160, 32) == pytest.approx(60.0, rel=1e-3)
    assert costs.outside[32] == pytest.approx(14.5, rel=1e-3)  # a verifying step teaches nothing about it
    assert sum(costs.plan_drafts(20, [(0.9, 8, 1.0)] * 10)) == 44  # the cheaper graph now: 53.3 / 21.1 beat 71.3 / 60
    costs.observe(16, 24, 1.0)  # a graph never captured: ignored
    assert (16, 24) not in costs.seen


def test_a_step_lasts_the_longer_of_its_device_and_host_time() -> None:
    half = [(0.5, 8, 1.0)] * 20

    def host(costs: StepCosts, tokens: int, ms: float, times: int = 200) -> None:
        """Steps of the graph (32, tokens) whose host work takes ms: a third of it in each part."""
        for _ in range(times):
            for part in (LAUNCH, COMPLETE, DELIVER):
                costs.observe_host(32, tokens, part, ms / 3)

    # A large model: the device's time is the longer, so the host's changes nothing.
    large = StepCosts(COSTS, 8, overlap=True)
    host(large, 32, 2.0)
    host(large, 64, 3.0)
    assert large.cost(32, 32, 32) == 5.5 and large.cost(32, 64, 32) == 6.6
    assert sum(large.plan_drafts(20, half)) == 44  # as in the test above
    # A small model at a large batch: the engine thread's turn (12 ms) is the step. Before a verifying step
    # has run, its host time is the plain step's, so even the largest graph (288 rows: 9.0 ms on the device)
    # costs no more than a plain step, and every draft is taken: (20 + 20) / 12 against 1.1 x 20 / 12.
    small = StepCosts(COSTS, 8, overlap=True)
    host(small, 32, 12.0)
    assert small.cost(32, 32, 32) == pytest.approx(12.0) and small.cost(32, 288, 32) == pytest.approx(12.0)
    assert small.plan_drafts(20, half) == [8] * 20
    # One slow turn (a collection, say) counts for at most twice the estimate: the graph is not shut out.
    host(small, 288, 500.0, times=1)
    assert small.cost(32, 288, 32) == pytest.approx(0.9 * 12.0 + 0.1 * 24.0)
    # Verifying turns that cost the host 40 ms: no count of these drafts pays for that.
    for tokens in small.tokens[32]:
        host(small, tokens, 40.0)
    assert small.cost(32, 160, 32) == pytest.approx(40.0, rel=1e-3)
    assert small.plan_drafts(20, half) == [0] * 20
    assert small.plan_drafts(20, [(1.0, 8, 1.0)] * 20) == [8] * 20  # sure drafts still do: 180 / 40 > 22 / 12
    small.observe_host(16, 24, LAUNCH, 1.0)  # a graph never captured: ignored
    assert all((16, 24) not in table for table in small.host)
    # Without the overlap loop a step takes the device's time and then the host's.
    serial = StepCosts(COSTS, 8, overlap=False)
    host(serial, 32, 2.0)
    assert serial.cost(32, 32, 32) == pytest.approx(7.5) and serial.cost(32, 64, 32) == pytest.approx(8.6)


class _Drafter:
    """Proposes the same token at every step (rarely what the model says)."""

    def propose(self, seq: Sequence, k: int, end: int | None = None) -> list[int]:
        return [7] * k


def test_the_engine_times_each_part_of_a_steps_host_work_on_that_steps_graph(tiny_loaded) -> None:
    """The verifying graphs' layout run eagerly on the CPU (as the layout test in test_speculative.py does):
    every step runs on a graph, and each part of its host work (launch, completion, delivery) is filed
    under that graph, decode and verifying steps alike."""

    core = make_core(tiny_loaded, speculative="auto", speculative_max_batch=8, overlap="on", block_size=4)
    eager_graphs(core, 4)
    speculator = core.scheduler.speculator
    width = 4 * (core.config.num_speculative_tokens + 1)
    cheap = {(4, t): 1.0 for t in range(4, width + 1)}  # verifying as cheap as decoding: drafts are verified
    speculator.drafter, speculator.costs = _Drafter(), StepCosts(cheap, 8, overlap=True)
    outputs: list = []
    for prompt in ([5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16], [17, 18, 19, 20]):
        core.add_request(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                         on_output=outputs.append)  # fmt: skip
    while core.has_work():
        core.step()
        core.deliver()
    host = speculator.costs.host
    assert outputs and (4, 4) in host[LAUNCH] and any(t > 4 for _, t in host[LAUNCH]), host
    assert set(host[LAUNCH]) == set(host[COMPLETE]) and set(host[DELIVER]) <= set(host[COMPLETE])
    assert (4, 4) in host[DELIVER] and all(ms > 0 for table in host for ms in table.values())


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_the_policy_decides_whether_drafts_are_made_and_outputs_are_the_same(tiny_loaded, overlap: str) -> None:
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16], [17, 18, 19, 20]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    off = [r["tokens"] for r in run_all(make_core(tiny_loaded, speculative="off"), prompts, params)]
    drafted = {}
    for name, costs in (("cheap", COSTS), ("dear", {k: v * (10 if k[1] > k[0] else 1) for k, v in COSTS.items()})):
        core = make_core(tiny_loaded, speculative="auto", speculative_max_batch=8, overlap=overlap)
        speculator = core.scheduler.speculator
        speculator.drafter, speculator.costs = _Drafter(), StepCosts(costs, 8, overlap=overlap == "on")
        assert [r["tokens"] for r in run_all(core, prompts, params)] == off
        stats = core.stats().speculation
        assert stats is not None
        drafted[name] = stats.num_draft_tokens
        assert core.block_manager.num_used_blocks == 0
    assert drafted["cheap"] > 0 and drafted["dear"] == 0, drafted
