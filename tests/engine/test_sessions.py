"""Sessions: resident KV between turns, fan-out branches, fork, eviction under pressure, expiry, no leaks.

The oracle is a stateless engine (prefix caching off) fed the whole history every turn.
"""

from __future__ import annotations

import random
import time

import pytest

from cbd.engine.core import EngineCore
from cbd.engine.sampling_params import SamplingParams
from cbd.engine.sessions.records import TurnInput
from cbd.errors import InvalidRequest, SessionBusy, UnknownSession
from helpers import checked_step, make_core, run_all

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _turn(core: EngineCore, session_id: str, tokens: list[int], params: SamplingParams = GREEDY, **kw) -> dict:
    request = core.add_session_turn(session_id, tokens, params, **kw)
    result = {"tokens": {}, "usage": None, "finish": {}}
    while request.request_id in core.requests:
        for out in checked_step(core):
            if out.request_id != request.request_id:
                continue
            for d in out.candidates:
                result["tokens"].setdefault(d.index, []).extend(d.token_ids)
                if d.finish_reason is not None:
                    result["finish"][d.index] = d.finish_reason
            if out.finished:
                result["usage"] = out.usage
    while core.has_work():  # a step may still be in flight (overlap)
        checked_step(core)
    return result


def _stateless(loaded, history: list[int], params: SamplingParams = GREEDY) -> dict:
    core = make_core(loaded, enable_prefix_caching=False, block_size=4)
    return run_all(core, [history], params)[0]


def _turns(rng: random.Random, count: int) -> list[list[int]]:
    return [[rng.randrange(2, 256) for _ in range(rng.randrange(3, 30))] for _ in range(count)]


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_five_turns_equal_stateless_and_reuse_the_history(tiny_loaded, overlap: str) -> None:
    core = make_core(tiny_loaded, block_size=4, overlap=overlap)
    session = core.sessions.open()
    history: list[int] = []
    for k, turn in enumerate(_turns(random.Random(1), 5)):
        result = _turn(core, session.session_id, turn)
        expected = _stateless(tiny_loaded, history + turn)
        assert result["tokens"] == expected["tokens"], k
        if k:  # every earlier token was resident but the previous reply's last (its KV comes with this turn)
            assert result["usage"].cached_prompt_tokens in (len(history) - 1, len(history)), k
        history += turn + result["tokens"][0]
        assert session.token_ids == history and session.busy is None
    assert core.sessions.info(session).resident_blocks >= len(history) // 4
    core.sessions.close(session.session_id)
    assert core.block_manager.num_used_blocks == 0


def test_fan_out_turn_then_continue_from_a_candidate(tiny_loaded) -> None:
    core = make_core(tiny_loaded, block_size=4)
    session = core.sessions.open()
    first = [5, 6, 7, 8, 9, 10, 11]
    sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=3, n=4, ignore_eos=True)
    fan = _turn(core, session.session_id, first, sampled)
    assert len(fan["tokens"]) == 4 and core.sessions.info(session).pending_candidates == 4
    with pytest.raises(SessionBusy):  # the next turn must name the candidate that continues
        core.add_session_turn(session.session_id, [20, 21], GREEDY)
    result = _turn(core, session.session_id, [20, 21], parent_candidate=2)
    history = first + fan["tokens"][2] + [20, 21]
    assert result["tokens"] == _stateless(tiny_loaded, history)["tokens"]
    assert result["usage"].cached_prompt_tokens >= len(first + fan["tokens"][2]) - 1
    assert core.sessions.info(session).pending_candidates == 0
    core.sessions.close(session.session_id)
    assert core.block_manager.num_used_blocks == 0


def test_fork_isolation(tiny_loaded) -> None:
    core = make_core(tiny_loaded, block_size=4)
    trunk = core.sessions.open()
    base = [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    reply = _turn(core, trunk.session_id, base)["tokens"][0]
    branch = core.sessions.fork(trunk.session_id)
    a = _turn(core, trunk.session_id, [40, 41, 42])
    b = _turn(core, branch.session_id, [50, 51])
    a2 = _turn(core, trunk.session_id, [43])
    assert a["tokens"] == _stateless(tiny_loaded, base + reply + [40, 41, 42])["tokens"]
    assert b["tokens"] == _stateless(tiny_loaded, base + reply + [50, 51])["tokens"]
    assert a2["tokens"] == _stateless(tiny_loaded, base + reply + [40, 41, 42] + a["tokens"][0] + [43])["tokens"]
    assert branch.token_ids == base + reply + [50, 51] + b["tokens"][0]
    for s in (trunk, branch):
        core.sessions.close(s.session_id)
    assert core.block_manager.num_used_blocks == 0


def test_after_a_one_candidate_turn_candidate_zero_names_the_history(tiny_loaded) -> None:
    """Fork and turn alike: 0 is the last turn's one candidate (the history); any other is INVALID_ARGUMENT."""
    core = make_core(tiny_loaded, block_size=4)
    trunk = core.sessions.open()
    _turn(core, trunk.session_id, [3, 4, 5, 6])
    branch = core.sessions.fork(trunk.session_id, candidate=0)
    assert branch.token_ids == trunk.token_ids
    for bad in (lambda: core.sessions.fork(trunk.session_id, candidate=1),
                lambda: core.add_session_turn(trunk.session_id, [7], GREEDY, parent_candidate=1)):  # fmt: skip
        with pytest.raises(InvalidRequest, match="names a candidate of the last turn, and it had only one"):
            bad()
    assert (
        _turn(core, branch.session_id, [7], parent_candidate=0)["tokens"]
        == _turn(core, trunk.session_id, [7])["tokens"]
    )
    for s in (trunk, branch):
        core.sessions.close(s.session_id)
    assert core.block_manager.num_used_blocks == 0


def test_eviction_under_a_small_pool_keeps_every_answer(tiny_loaded) -> None:
    rng = random.Random(7)
    scripts = [_turns(rng, 4) for _ in range(6)]

    def play(core: EngineCore) -> list[list[list[int]]]:
        sessions = [core.sessions.open() for _ in scripts]
        answers: list[list[list[int]]] = [[] for _ in scripts]
        for k in range(4):  # round-robin: every agent's turn k, then k + 1 (sessions idle in between)
            for i, (session, script) in enumerate(zip(sessions, scripts)):
                answers[i].append(_turn(core, session.session_id, script[k])["tokens"][0])
        for session in sessions:
            core.sessions.close(session.session_id)
        assert core.block_manager.num_used_blocks == 0
        return answers

    roomy = make_core(tiny_loaded, block_size=4, num_kv_blocks=512)
    tight = make_core(tiny_loaded, block_size=4, num_kv_blocks=40)
    assert play(tight) == play(roomy)
    assert tight.sessions.eviction.num_evictions > 0 and roomy.sessions.eviction.num_evictions == 0


@pytest.mark.slow
def test_fan_out_memory_shares_the_prompt(default_model) -> None:
    core = make_core(default_model, block_size=8, num_kv_blocks=400, max_num_batched_tokens=1024)
    prompt = [random.Random(2).randrange(2, 20000) for _ in range(1000)]
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=1, n=8, ignore_eos=True)
    core.add_request(prompt, params)
    peak = 0
    while core.has_work():
        checked_step(core)
        peak = max(peak, core.block_manager.num_used_blocks)
    prompt_blocks = -(-1000 // 8)
    # the prompt once, plus per candidate its copy of the partial last block and the blocks of its new tokens
    assert peak <= prompt_blocks + 8 * (1 + -(-4 // 8))
    assert core.block_manager.num_used_blocks == 0


def test_busy_unknown_expired_and_aborted_turns(tiny_loaded) -> None:
    core = make_core(tiny_loaded, block_size=4)
    session = core.sessions.open(ttl=5.0)
    request = core.add_session_turn(session.session_id, [5, 6, 7], GREEDY)
    with pytest.raises(SessionBusy):
        core.add_session_turn(session.session_id, [8], GREEDY)
    checked_step(core)
    core.abort_request(request.request_id)  # an aborted turn leaves the session as it was
    while core.has_work():
        checked_step(core)
    assert session.token_ids == [] and session.busy is None
    _turn(core, session.session_id, [5, 6, 7])
    assert len(session.token_ids) == 3 + GREEDY.max_tokens
    with pytest.raises(UnknownSession):
        core.add_session_turn("nope", [1], GREEDY)
    with pytest.raises(InvalidRequest):
        core.add_session_turn(session.session_id, [], GREEDY)
    with pytest.raises(InvalidRequest):  # too long for the context: nothing changes
        core.add_session_turn(session.session_id, [3] * 10_000, GREEDY)
    assert session.busy is None
    assert core.sessions.expire(now=session.last_used + 6.0) == [session.session_id]
    with pytest.raises(UnknownSession):
        core.sessions.get(session.session_id)
    assert core.block_manager.num_used_blocks == 0


def test_session_cap(tiny_loaded) -> None:
    from cbd.errors import CapacityExceeded

    core = make_core(tiny_loaded, max_sessions=2)
    first = core.sessions.open(ttl=30.0)
    core.sessions.open(ttl=float("inf"))
    with pytest.raises(CapacityExceeded, match="2 sessions are open, the limit is 2; retry in") as info:
        core.sessions.open()
    # The hint: when the first idle session with a TTL expires (its seat frees then).
    assert info.value.retry_after is not None and 29.0 < info.value.retry_after <= 30.0
    first.last_used -= 29.5
    with pytest.raises(CapacityExceeded) as info:
        core.sessions.open()
    assert info.value.retry_after is not None and info.value.retry_after <= 0.6
    core.sessions.close(first.session_id)
    core.sessions.open(ttl=float("inf"))
    with pytest.raises(CapacityExceeded) as info:  # none can expire: only a close frees a seat
        core.sessions.open()
    assert info.value.retry_after == 1.0


@pytest.mark.parametrize("num_blocks", [24, 32, 40])
def test_concurrent_turns_of_sessions_that_pin_most_of_the_pool_all_finish(tiny_loaded, num_blocks) -> None:
    """Busy sessions' resident history is released too when the pool runs dry, else turns waiting to be
    recomputed can never be admitted (each session pins the blocks its own turn needs to grow)."""
    rng = random.Random(num_blocks)
    histories = [[rng.randrange(2, 256) for _ in range(rng.randrange(16, 29))] for _ in range(4)]
    rounds = [[[rng.randrange(2, 256) for _ in range(rng.randrange(3, 11))] for _ in histories] for _ in range(2)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def play(core: EngineCore) -> list[list[int]]:
        sessions = [core.sessions.open() for _ in histories]
        answers = [_turn(core, s.session_id, h, params)["tokens"][0] for s, h in zip(sessions, histories)]
        for turns in rounds:  # every session's next turn at once
            ids = [core.add_session_turn(s.session_id, t, params).request_id for s, t in zip(sessions, turns)]
            tokens: dict[str, list[int]] = {rid: [] for rid in ids}
            steps = 0
            while core.has_work():
                for out in checked_step(core):
                    tokens[out.request_id].extend(t for d in out.candidates for t in d.token_ids)
                steps += 1
                assert steps < 5_000, f"no progress: {core.stats()}"
            answers += [tokens[rid] for rid in ids]
        for s in sessions:
            core.sessions.close(s.session_id)
        assert core.block_manager.num_used_blocks == 0
        return answers

    roomy = make_core(tiny_loaded, block_size=4, num_kv_blocks=1024)
    tight = make_core(tiny_loaded, block_size=4, num_kv_blocks=num_blocks)
    assert play(tight) == play(roomy)
    assert tight.scheduler.num_preemptions > 0


class AheadClock:
    """Stands in for the `time` module inside the session table only: the real clock plus what the test
    has advanced it by. Never behind the real clock, so the engine loop's own expiry pass (which reads the
    real clock) cannot expire a session early; only the test's advances age it."""

    def __init__(self) -> None:
        self.offset = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.offset


def test_a_session_whose_turns_are_refused_for_now_does_not_expire(tiny_loaded, monkeypatch) -> None:
    """Admission refusing a turn (RESOURCE_EXHAUSTED) counts as use: the client is retrying, not gone."""
    from cbd.config import EngineConfig
    from cbd.engine.engine import Engine
    from cbd.engine.sessions import manager as session_manager
    from cbd.errors import CapacityExceeded

    clock = AheadClock()
    monkeypatch.setattr(session_manager, "time", clock)
    engine = Engine(EngineConfig(block_size=4, num_kv_blocks=256, max_queued_requests=1), loaded=tiny_loaded)

    def expire() -> list[str]:  # the engine's expiry pass, by the session table's clock
        return engine.call(lambda core: core.sessions.expire()).result(timeout=10)

    try:
        session = engine.open_session(ttl=1.2).result(timeout=10)
        engine.admission.reserve("seat-holder", 3)  # the one seat is taken
        for _ in range(8):  # 2.4 s of refusals, twice the TTL
            with pytest.raises(CapacityExceeded):
                engine.submit_turn(session.session_id, TurnInput([8, 9]), GREEDY)
            clock.offset += 0.3
        assert expire() == []
        assert engine.get_session(session.session_id).result(timeout=10).session_id == session.session_id
        engine.admission.release("seat-holder")
        clock.offset += 2.5  # left alone, it expires
        assert expire() == [session.session_id]
        with pytest.raises(UnknownSession):
            engine.get_session(session.session_id).result(timeout=10)
    finally:
        engine.shutdown()


def test_a_session_prefix_must_leave_room_for_a_turn(tiny_loaded) -> None:
    """The prefix, a turn's input and one new token must fit: a prefix of at most max_model_len - 2 tokens,
    and the refusal names the prefix's own length."""
    from cbd.config import EngineConfig
    from cbd.engine.engine import Engine

    engine = Engine(EngineConfig(block_size=4, num_kv_blocks=64, max_model_len=40), loaded=tiny_loaded)
    try:
        engine.close_session(engine.open_session(token_ids=list(range(2, 40))).result(timeout=10).session_id)
        with pytest.raises(InvalidRequest, match="the session prefix has 39 tokens; .* at most 40 .* at most 38"):
            engine.open_session(token_ids=list(range(2, 41)))
        with pytest.raises(InvalidRequest, match=r"prefix token ids must be in \[0, "):
            engine.open_session(token_ids=[2, 10**6])
    finally:
        engine.shutdown()
