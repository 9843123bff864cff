"""EngineCore on a tiny model: budget, chunked prefill, preemption, fan-out, seeds, abort, validation."""

from __future__ import annotations

import random

import pytest

from cbd.engine.core import EngineCore
from cbd.engine.outputs import RequestOutput
from cbd.engine.sampling_params import SamplingParams
from cbd.engine.sched.plan import StepPlan
from cbd.engine.sequence import FinishReason
from cbd.errors import InvalidRequest, UnknownRequest
from cbd.model.loader import LoadedModel
from helpers import checked_step, collect, make_core, poll_until, run_all

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def prompts(count: int, seed: int = 3, lo: int = 5, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 256) for _ in range(rng.randrange(lo, hi))] for _ in range(count)]


def recorded_plans(core: EngineCore) -> list[StepPlan]:
    """The plan of every step the engine runs from now on, in order (the scheduler's answers, recorded; the
    cores here do not speculate, so each plan is what `scheduler.schedule()` alone would give)."""
    plans: list[StepPlan] = []
    schedule = core.scheduler.schedule

    def recording(*args, **kwargs) -> StepPlan:
        plan = schedule(*args, **kwargs)
        if plan:
            plans.append(plan)
        return plan

    core.scheduler.schedule = recording  # type: ignore[method-assign]
    return plans


def test_step_respects_token_budget_and_chunks_long_prompts(tiny_loaded) -> None:
    core = make_core(tiny_loaded, max_num_batched_tokens=16, block_size=4, speculative="off")
    core.add_request(list(range(2, 52)), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    plans = recorded_plans(core)
    while core.has_work():
        checked_step(core)
    steps = [plan.num_tokens for plan in plans]
    assert all(n <= 16 for n in steps)
    assert steps == [16, 16, 16, 2, 1]  # 50-token prompt in 4 chunks (the last also samples), then a decode


def test_max_num_seqs_caps_the_running_set(tiny_loaded) -> None:
    core = make_core(tiny_loaded, max_num_seqs=3)
    for p in prompts(7):
        core.add_request(p, GREEDY)
    while core.has_work():
        checked_step(core)
        assert len(core.scheduler.running) <= 3


def test_preemption_loses_nothing_and_changes_nothing(tiny_loaded) -> None:
    ps = prompts(10)
    params = [
        SamplingParams(max_tokens=30, temperature=0.0 if i % 2 else 0.9, seed=i, ignore_eos=True) for i in range(10)
    ]
    big = run_all(make_core(tiny_loaded, num_kv_blocks=512, block_size=4), ps, params)
    small_core = make_core(tiny_loaded, num_kv_blocks=24, block_size=4)  # ~96 tokens for 10 x up to 70
    small = run_all(small_core, ps, params)
    assert small_core.scheduler.num_preemptions > 0
    assert [r["tokens"] for r in small] == [r["tokens"] for r in big]
    assert all(r["finish"] == {0: FinishReason.LENGTH} for r in small)
    assert small_core.block_manager.num_used_blocks == 0


def test_fan_out_prefills_once_and_forks(tiny_loaded) -> None:
    core = make_core(tiny_loaded, block_size=4, speculative="off")
    prompt = list(range(2, 22))  # 20 tokens = 5 full blocks
    request = core.add_request(prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=42, n=4))
    plans = recorded_plans(core)
    checked_step(core)
    (plan,) = plans
    assert plan.num_tokens == 20 and len(plan.chunks) == 1  # one prefill for all candidates
    assert len(request.sequences) == 4
    shared = request.sequences[0].block_table[:5]
    assert all(s.block_table[:5] == shared for s in request.sequences)
    assert all(core.block_manager.blocks[b].ref_count == 4 for b in shared)
    while core.has_work():
        checked_step(core)
    assert core.block_manager.num_used_blocks == 0


def test_seeded_fan_out_is_reproducible_and_candidates_differ(tiny_loaded) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7, n=4, ignore_eos=True)
    prompt = list(range(2, 30))
    first = run_all(make_core(tiny_loaded), [prompt], params)[0]["tokens"]
    mixed = run_all(make_core(tiny_loaded), [prompts(1)[0], prompt, prompts(2)[1]], [GREEDY, params, GREEDY])
    assert mixed[1]["tokens"] == first
    assert len(first) == 4 and len({tuple(t) for t in first.values()}) == 4
    other = run_all(make_core(tiny_loaded), [prompt], SamplingParams(max_tokens=12, seed=8, n=4, ignore_eos=True))
    assert other[0]["tokens"] != first


def test_seeded_sample_same_alone_and_in_a_mixed_batch(tiny_loaded) -> None:
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, top_k=50, seed=99, ignore_eos=True)
    target = prompts(1, seed=11)[0]
    alone = run_all(make_core(tiny_loaded), [target], params)[0]["tokens"][0]
    others = prompts(5, seed=12)
    mixed_params = [SamplingParams(max_tokens=9, temperature=1.2, seed=i, ignore_eos=True) for i in range(5)]
    mixed = run_all(
        make_core(tiny_loaded), others[:2] + [target] + others[2:], mixed_params[:2] + [params] + mixed_params[2:]
    )
    assert mixed[2]["tokens"][0] == alone
    differ = run_all(
        make_core(tiny_loaded), [target], SamplingParams(max_tokens=16, temperature=0.8, seed=100, ignore_eos=True)
    )
    assert differ[0]["tokens"][0] != alone


def test_abort_frees_blocks_at_once_and_reports_every_candidate(tiny_loaded) -> None:
    core = make_core(tiny_loaded)
    a = core.add_request(list(range(2, 40)), SamplingParams(max_tokens=50, n=3, ignore_eos=True))
    b = core.add_request(list(range(2, 40)), SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        checked_step(core)
    out = core.abort_request(a.request_id)
    assert out.finished and sorted(d.index for d in out.candidates) == [0, 1, 2]
    assert all(d.finish_reason is FinishReason.ABORT for d in out.candidates)
    waiting = core.add_request([5, 6, 7], GREEDY)  # aborted before it ever ran (pending forks too)
    out = core.abort_request(waiting.request_id)
    assert out.finished and out.usage.completion_tokens == 0
    core.abort_request(b.request_id)
    assert core.block_manager.num_used_blocks == 0 and not core.has_work()
    with pytest.raises(UnknownRequest):
        core.abort_request(a.request_id)


def test_usage_counts_cached_prompt_tokens(tiny_loaded) -> None:
    core = make_core(tiny_loaded, block_size=4)
    prompt = list(range(2, 30))
    first = run_all(core, [prompt], GREEDY)[0]["usage"]
    second = run_all(core, [prompt], GREEDY)[0]["usage"]
    assert (first.prompt_tokens, first.cached_prompt_tokens, first.completion_tokens) == (28, 0, 20)
    assert second.cached_prompt_tokens == 24  # 6 full blocks; the last token's block is recomputed


def test_context_length_ends_a_sequence_with_length(tiny_loaded) -> None:
    core = make_core(tiny_loaded, max_model_len=32)
    result = run_all(core, [list(range(2, 22))], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))[0]
    assert len(result["tokens"][0]) == 12 and result["finish"][0] is FinishReason.LENGTH


def test_stop_token_ids_finish_with_stop(tiny_loaded) -> None:
    core = make_core(tiny_loaded)
    free_run = run_all(core, [list(range(2, 12))], GREEDY)[0]["tokens"][0]
    stop_at = free_run[5]
    first = free_run.index(stop_at)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop_token_ids=(stop_at,))
    result = run_all(core, [list(range(2, 12))], params)[0]
    assert result["tokens"][0] == free_run[: first + 1] and result["finish"][0] is FinishReason.STOP


@pytest.mark.parametrize(
    "prompt, params, error, match",
    [
        ([], GREEDY, InvalidRequest, "empty"),
        ([1, 2, 999], GREEDY, InvalidRequest, r"\[0, 256\)"),
        (list(range(2, 250)) * 3, GREEDY, InvalidRequest, "context holds at most"),
        ([1, 2], SamplingParams(stop=("x",)), InvalidRequest, "need a tokenizer"),
    ],
)
def test_bad_requests_are_refused_with_a_clear_error(tiny_loaded, prompt, params, error, match) -> None:
    with pytest.raises(error, match=match):
        make_core(tiny_loaded).add_request(prompt, params)


def test_more_candidates_than_the_engine_runs_at_once_are_refused_not_queued_forever(tiny_loaded) -> None:
    """A request's candidates run together: n above max_num_seqs could never be admitted, and would hold
    every request behind it at the head of the queue."""
    core = make_core(tiny_loaded, max_num_seqs=2)
    with pytest.raises(InvalidRequest, match="n must be at most 2"):
        core.add_request([1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0, n=3))
    result = run_all(core, [[1, 2, 3], [4, 5]], SamplingParams(max_tokens=2, temperature=0.0, n=2))
    assert [len(r["tokens"]) for r in result] == [2, 2]  # n at the limit runs, and nothing was left queued


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=2), "min_p"),
        (dict(n=0), "n must be"),
        (dict(logprobs=99), "logprobs"),
        (dict(stop=("",)), "stop"),
        (dict(seed=-1), "seed"),
    ],
)
def test_sampling_params_validate(kw, match) -> None:
    with pytest.raises(InvalidRequest, match=match):
        SamplingParams(**kw)


def test_requests_sharing_a_prefix_in_one_step_compute_it_once(tiny_loaded) -> None:
    core = make_core(tiny_loaded, block_size=4, speculative="off")
    shared = list(range(2, 14))  # 3 full blocks
    a = core.add_request(shared + [40, 41], GREEDY)
    b = core.add_request(shared + [50, 51, 52], GREEDY)
    plans = recorded_plans(core)
    checked_step(core)
    assert [c.seq.request for c in plans[0].chunks] == [a]  # b waits a step for a's blocks
    checked_step(core)
    chunk_b = next(c for c in plans[1].chunks if c.seq.request is b)
    assert chunk_b.start == 12 and chunk_b.num_new_tokens == 3  # its first 12 tokens revived, not computed
    while core.has_work():
        checked_step(core)
    assert b.num_cached_prompt_tokens == 12


def test_an_engine_that_can_schedule_nothing_reports_a_stall_without_spinning(tiny_loaded) -> None:
    """A loop that turns but computes nothing is no heartbeat: health and the watchdog see the stall."""
    import time

    from cbd.config import EngineConfig
    from cbd.engine.engine import Engine
    from cbd.engine.sched.plan import StepPlan

    engine = Engine(EngineConfig(block_size=4, num_kv_blocks=64), loaded=tiny_loaded)
    try:
        calls = 0

        def schedule_nothing(speculate: bool = False) -> StepPlan:
            nonlocal calls
            calls += 1
            return StepPlan()

        result = engine.call(lambda core: setattr(core.scheduler, "schedule", schedule_nothing))
        result.result(timeout=10)
        submitted = time.monotonic()
        engine.submit([5, 6, 7], SamplingParams(max_tokens=4))
        poll_until(lambda: engine.stalled(0.3), 30, what="the stall is reported")
        # It waited (at least 5 ms) between attempts instead of spinning: a slow machine only makes fewer calls.
        assert calls < (time.monotonic() - submitted) / 0.005 + 10
        del engine.core.scheduler.schedule  # the real scheduler again: the request runs, the stall clears
        engine._wake.set()
        deadline = time.monotonic() + 10
        while engine.num_live_requests and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.num_live_requests == 0 and not engine.stalled(0.3)
    finally:
        engine.shutdown()


def test_a_finished_request_is_out_of_the_stats_its_callback_reads(tiny_loaded) -> None:
    """Outputs are delivered after the stats snapshot is refreshed: whoever has seen a request finish
    (a client that then asks GetStats) never reads stats that still count it."""
    import threading

    from cbd.config import EngineConfig
    from cbd.engine.engine import Engine

    engine = Engine(EngineConfig(block_size=4, num_kv_blocks=64), loaded=tiny_loaded)
    seen: list[tuple[int, int, int]] = []
    done = threading.Event()

    def on_output(out) -> None:  # in the engine thread
        if out.finished:
            s = engine.stats()
            seen.append((s.num_running, s.num_blocks_used, engine.num_live_requests))
            done.set()

    try:
        engine.submit([5, 6, 7, 8], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), on_output=on_output)
        assert done.wait(60)
    finally:
        engine.shutdown()
    assert seen == [(0, 0, 0)]


def test_stats_count_candidates_running_and_waiting(tiny_loaded) -> None:
    """A fan-out of n counts n (proto: Stats.running / waiting are sequences, i.e. candidates) before and
    after its prompt is computed and it forks."""
    core = make_core(tiny_loaded, max_num_seqs=8)
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=1, n=4, ignore_eos=True)
    for _ in range(3):
        core.add_request(list(range(2, 20)), params)
    stats = core.stats()
    assert (stats.num_running, stats.num_waiting) == (0, 12)
    seen_full = False
    while core.has_work():
        checked_step(core)
        stats = core.stats()
        assert stats.num_running <= 8 and stats.num_running + stats.num_waiting <= 12
        if stats.num_running == 8:
            assert stats.num_waiting == 4  # two fan-outs running (forked or not), the third waiting whole
            seen_full = True
    assert seen_full and (stats.num_running, stats.num_waiting) == (0, 0)


def test_each_step_files_its_host_time_by_phase_and_the_metrics_export_it(tiny_loaded) -> None:
    """Every step the engine loop runs is filed once per phase (an idle turn of the loop is not); the
    histograms reach Prometheus as cbd_engine_step_phase_seconds{phase}."""
    from prometheus_client import generate_latest

    from cbd.config import EngineConfig
    from cbd.engine.engine import Engine
    from cbd.engine.outputs import STEP_PHASES
    from cbd.server.metrics import Metrics

    engine = Engine(EngineConfig(block_size=4, num_kv_blocks=64), loaded=tiny_loaded)
    try:
        params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        results = engine.generate([[5, 6, 7, 8], [9, 10, 11]], params)
        assert [len(r.candidates[0].token_ids) for r in results] == [5, 5]
        stats = engine.stats()
        steps = stats.num_steps
    finally:
        engine.shutdown()
    phases = stats.step_phases
    assert phases is not None and steps >= 5
    counts = [sum(b) for b in phases.buckets]
    assert len(set(counts)) == 1 and steps - 1 <= counts[0] <= steps + 1  # the snapshot lags a step at most
    seconds = dict(zip(STEP_PHASES, phases.seconds, strict=True))
    assert all(v >= 0 for v in seconds.values()) and seconds["launch"] > 0 and seconds["emit"] > 0
    metrics = Metrics()
    metrics.watch_engine(lambda: stats, lambda: 0, dict, dict)
    text = generate_latest(metrics.registry).decode()
    for phase in STEP_PHASES:
        assert f'cbd_engine_step_phase_seconds_count{{phase="{phase}"}} {float(counts[0])}' in text


def test_outputs_gathered_by_the_stream_interval_lose_reorder_and_change_nothing(tiny_loaded: LoadedModel) -> None:
    """A request with an interval gets its first token at once, then an output per `interval` tokens of a
    candidate (or a candidate's end) with the same tokens and text, in order, as a request without one."""
    prompt = list(range(2, 30))
    base = dict(max_tokens=23, temperature=0.9, seed=5, n=3, ignore_eos=True)
    runs = {}
    for interval in (None, 4):
        core = make_core(tiny_loaded)
        outputs: list[RequestOutput] = []
        core.add_request(prompt, SamplingParams(**base, stream_interval=interval), on_output=outputs.append)
        while core.has_work():
            core.step()
            core.deliver()
        runs[interval] = outputs
    results = {interval: {"tokens": {}, "text": {}, "finish": {}, "usage": None, "outputs": []} for interval in runs}
    for interval, outputs in runs.items():
        for out in outputs:
            collect(results[interval], out)
    assert results[4]["tokens"] == results[None]["tokens"] and results[4]["text"] == results[None]["text"]
    assert all(len(t) == 23 for t in results[4]["tokens"].values())
    assert results[4]["usage"] == results[None]["usage"] and runs[4][-1].finished
    gathered = runs[4]
    assert any(d.token_ids for d in gathered[0].candidates) and gathered[0].queue_seconds is not None
    for out in gathered[1:]:
        assert (
            out.finished
            or any(d.finish_reason for d in out.candidates)
            or max(len(d.token_ids) for d in out.candidates) >= 4
        )
    assert len(gathered) < len(runs[None]) / 2
