"""The host KV tier: idle sessions' KV offloaded under GPU pressure and restored for their next turn,
retention hints, failures, and nothing leaked. The oracle: the same agents on a GPU pool big enough
for all of them (greedy answers must be equal)."""

from __future__ import annotations

import random
import time

import pytest
import torch

from cbd.engine.core import EngineCore
from cbd.engine.device.streams import DeviceStreams
from cbd.engine.kv.copier import KvCopier
from cbd.engine.sampling_params import SamplingParams
from cbd.engine.sessions.records import RETENTION_HIGH, RETENTION_LOW
from helpers import checked_step, make_core

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
AGENTS, TURNS = 6, 4


def _turn(core: EngineCore, session_id: str, tokens: list[int], **kw) -> tuple[list[int], int, int]:
    """Run one turn to its end: (answer, prompt tokens, cached prompt tokens)."""
    request = core.add_session_turn(session_id, tokens, GREEDY, **kw)
    answer: list[int] = []
    usage = None
    while core.has_work():
        for out in checked_step(core):
            if out.request_id == request.request_id:
                answer += [t for d in out.candidates for t in d.token_ids]
                usage = out.usage if out.finished else usage
    assert usage is not None
    return answer, usage.prompt_tokens, usage.cached_prompt_tokens


def _scripts(seed: int = 7) -> list[list[list[int]]]:
    rng = random.Random(seed)
    return [[[rng.randrange(2, 256) for _ in range(rng.randrange(8, 30))] for _ in range(TURNS)] for _ in range(AGENTS)]


def _play(core: EngineCore, scripts: list[list[list[int]]]) -> tuple[list[list[list[int]]], int]:
    """Every agent's turn k, round robin (the others idle meanwhile); returns the answers and the prompt
    tokens computed (not reused) over all turns. Closes the sessions and checks nothing is left."""
    sessions = [core.sessions.open().session_id for _ in scripts]
    answers: list[list[list[int]]] = [[] for _ in scripts]
    computed = 0
    for k in range(TURNS):
        for i, sid in enumerate(sessions):
            answer, prompt, cached = _turn(core, sid, scripts[i][k])
            answers[i].append(answer)
            computed += prompt - cached
    for sid in sessions:
        core.sessions.close(sid)
    core.check_integrity()
    assert core.block_manager.num_used_blocks == 0
    assert core.host_tier is None or core.host_tier.pool.num_used_blocks == 0
    return answers, computed


def test_a_host_tier_that_fits_the_agents_restores_instead_of_recomputing(tiny_loaded) -> None:
    scripts = _scripts()
    ideal = make_core(tiny_loaded, block_size=4, num_kv_blocks=512, num_host_kv_blocks=0)
    tiered = make_core(tiny_loaded, block_size=4, num_kv_blocks=40, num_host_kv_blocks=400)
    dropped = make_core(tiny_loaded, block_size=4, num_kv_blocks=40, num_host_kv_blocks=0)
    (want, ideal_computed), (got, tiered_computed), (again, dropped_computed) = (
        _play(ideal, scripts),
        _play(tiered, scripts),
        _play(dropped, scripts),
    )
    assert got == want and again == want
    assert tiered.host_tier is not None
    assert tiered.host_tier.num_offloaded_blocks > 0 and tiered.host_tier.num_restored_blocks > 0
    assert tiered.sessions.hits["host"] > 0
    # Restored, not recomputed: the prompt tokens computed are the ideal run's (a restored turn also
    # recomputes nothing the resident one would not), far fewer than when evicted KV is released.
    assert tiered_computed == ideal_computed, (tiered_computed, ideal_computed)
    assert dropped_computed > 2 * ideal_computed
    assert tiered.stats().host is not None
    assert tiered.stats().host.num_restored_tokens == tiered.host_tier.num_restored_tokens > 0  # type: ignore[union-attr]


def test_a_host_tier_too_small_spills_to_recompute_with_the_same_answers(tiny_loaded) -> None:
    scripts = _scripts(11)
    want, _ = _play(make_core(tiny_loaded, block_size=4, num_kv_blocks=512, num_host_kv_blocks=0), scripts)
    small = make_core(tiny_loaded, block_size=4, num_kv_blocks=40, num_host_kv_blocks=14)
    got, _ = _play(small, scripts)  # checks that nothing is left in either pool
    assert got == want
    assert small.host_tier is not None
    assert small.host_tier.num_offloaded_blocks > 0 and small.host_tier.num_host_evictions > 0


def _pressure(core: EngineCore) -> None:
    """Make the engine need one block more than is free (idle sessions must give some up)."""
    core.sessions.eviction.evict(core.block_manager.num_free_blocks + 1)


def test_retention_hints_set_the_order_in_which_sessions_leave_the_gpu(tiny_loaded) -> None:
    core = make_core(tiny_loaded, block_size=4, num_kv_blocks=200, num_host_kv_blocks=400)
    rng = random.Random(3)
    ids = {}
    # Opened (and run) oldest first: b, a, low, high. Plain LRU would offload b first. The class is
    # the session's (from OpenSession); the expected idle time is said by the turn it follows.
    for name, retention, idle in (("b", 0, None), ("a", 0, 60.0), ("low", RETENTION_LOW, None),
                                  ("high", RETENTION_HIGH, 60.0)):  # fmt: skip
        ids[name] = core.sessions.open(retention=retention).session_id
        _turn(core, ids[name], [rng.randrange(2, 256) for _ in range(20)], expected_idle=idle)
        time.sleep(0.01)
    order = []
    for _ in range(4):
        _pressure(core)
        tiers = {name: core.sessions.info(core.sessions.get(sid)).tier for name, sid in ids.items()}
        order += [name for name, tier in tiers.items() if tier == "host" and name not in order]
    # LOW first; NORMAL: the one that said it will be away a minute before the one merely idle; HIGH last.
    assert order == ["low", "a", "b", "high"]
    # A turn's hint holds after the turn: b says it will be back at once, a stays away.
    _turn(core, ids["b"], [5, 6, 7], expected_idle=0.0)
    _turn(core, ids["a"], [5, 6, 7], expected_idle=60.0)
    assert [s.session_id for s in core.sessions.eviction.order([core.sessions.get(ids["a"]),
                                                                 core.sessions.get(ids["b"])])] == [ids["a"], ids["b"]]  # fmt: skip


def _offloaded_session(core: EngineCore, tokens: int = 30) -> tuple[str, list[int]]:
    sid = core.sessions.open().session_id
    answer, _, _ = _turn(core, sid, list(range(2, 2 + tokens)))
    _pressure(core)
    info = core.sessions.info(core.sessions.get(sid))
    assert info.tier == "host" and info.host_blocks > 0 and info.resident_blocks == 0
    return sid, answer


def _assert_empty(core: EngineCore) -> None:
    while core.has_work():
        checked_step(core)
    core.check_integrity()
    assert core.block_manager.num_used_blocks == 0
    assert core.host_tier is not None and core.host_tier.pool.num_used_blocks == 0


def test_abort_during_restore_close_after_offload_and_expiry_leave_nothing(tiny_loaded) -> None:
    core = make_core(tiny_loaded, block_size=4, num_kv_blocks=200, num_host_kv_blocks=400)
    tier = core.host_tier
    assert tier is not None
    # Abort while the restore is in flight (the copy is held incomplete).
    sid, _ = _offloaded_session(core)
    tier.copier.is_done = lambda ticket, block: False  # type: ignore[method-assign]
    request = core.add_session_turn(sid, [7, 8, 9], GREEDY)
    checked_step(core)
    assert len(tier.restoring) == 1
    restoring_blocks = list(tier.restoring[0].seq.block_table)
    core.abort_request(request.request_id)
    assert not tier.restoring
    assert all(b in core.block_manager.fences for b in restoring_blocks)  # reuse waits for the copy
    del tier.copier.is_done
    core.sessions.close(sid)
    _assert_empty(core)
    # Close right after the offload; expiry of an offloaded session.
    sid, _ = _offloaded_session(core)
    core.sessions.close(sid)
    _assert_empty(core)
    sid, _ = _offloaded_session(core)
    assert core.sessions.expire(time.monotonic() + 10_000) == [sid]
    _assert_empty(core)


def test_failed_copies_fall_back_to_recompute_with_the_same_answer(tiny_loaded) -> None:
    def run(fail: str | None) -> list[int]:
        core = make_core(tiny_loaded, block_size=4, num_kv_blocks=200, num_host_kv_blocks=400)
        sid = core.sessions.open().session_id
        _turn(core, sid, list(range(2, 32)))
        assert core.host_tier is not None

        def broken(*args: object) -> int:
            raise RuntimeError("copy failed")

        if fail == "offload":
            core.host_tier.copier.offload = broken  # type: ignore[method-assign]

        _pressure(core)
        tier = core.sessions.info(core.sessions.get(sid)).tier
        assert tier == ("recompute" if fail == "offload" else "host")
        if fail == "restore":
            core.host_tier.copier.restore = broken  # type: ignore[method-assign]
        answer, prompt, cached = _turn(core, sid, [40, 41, 42])
        if fail is None:
            assert cached > 0
        core.sessions.close(sid)
        _assert_empty(core)
        return answer

    assert run("offload") == run("restore") == run(None)


def test_the_copier_moves_blocks_both_ways_in_chunks() -> None:
    torch.manual_seed(0)
    layers, blocks, bs = 3, 12, 4
    kv = torch.randn(layers, (blocks + 1) * bs, 2, 2, 8)
    original = kv.clone()
    streams = DeviceStreams(torch.device("cpu"))
    copier = KvCopier(kv, bs, num_host_blocks=8, streams=streams, chunk_bytes=2 * KvCopier.block_bytes(kv, bs))
    gpu, host = [9, 2, 5, 11, 0], [1, 2, 3, 6, 7]  # runs of host ids: 1-3 (split in chunks of 2), 6-7
    assert copier.is_done(copier.offload(gpu, host))
    kv.zero_()
    assert copier.is_done(copier.restore(host, [1, 3, 4, 6, 7]))
    view = kv.view(layers, blocks + 1, bs, 2, 2, 8)
    before = original.view(layers, blocks + 1, bs, 2, 2, 8)
    for src, dst in zip(gpu, [1, 3, 4, 6, 7], strict=True):
        assert torch.equal(view[:, dst], before[:, src])
    assert torch.count_nonzero(view[:, [0, 2, 5, 8, 9, 10, 11, 12]]) == 0  # nothing else written
    assert len(copier.drain_latencies()) == 1  # the one restore


@pytest.mark.parametrize("overlap", ["on"])
def test_the_overlap_loop_restores_with_the_same_answers(tiny_loaded, overlap: str) -> None:
    scripts = _scripts(5)
    want, _ = _play(make_core(tiny_loaded, block_size=4, num_kv_blocks=512, num_host_kv_blocks=0), scripts)
    core = make_core(tiny_loaded, block_size=4, num_kv_blocks=40, num_host_kv_blocks=400, overlap=overlap)
    got, _ = _play(core, scripts)
    assert got == want and core.host_tier is not None and core.host_tier.num_restored_blocks > 0


def test_through_the_daemon_tiers_hints_stats_and_metrics(tiny_daemon) -> None:
    import urllib.request

    import grpc

    from cbd_client import CbdError, Client
    from cbd_client.address import free_port
    from cbd_client.v1 import cbd_pb2 as pb
    from cbd_client.v1 import cbd_pb2_grpc

    port = free_port()
    d = tiny_daemon("--block-size", "4", "--num-kv-blocks", "40", "--num-host-kv-blocks", "400",
                    "--metrics-port", str(port))  # fmt: skip
    rng = random.Random(2)
    with Client(d.address, timeout=60) as client:
        first = client.session(retention="high", expected_idle_ms=5000)
        info = client.get_session(first.session_id)
        assert (info.kv_tier, info.retention, info.expected_idle_ms) == ("none", "high", 5000)
        first.send([rng.randrange(2, 256) for _ in range(30)], max_tokens=8, temperature=0, ignore_eos=True,
                   expected_idle_ms=120_000, retention="low")  # fmt: skip
        info = client.get_session(first.session_id)
        assert (info.kv_tier, info.retention, info.expected_idle_ms) == ("gpu", "low", 120_000)
        others = [client.session() for _ in range(5)]
        for s in others:  # more than the GPU pool holds: the low-retention session leaves first
            s.send([rng.randrange(2, 256) for _ in range(30)], max_tokens=8, temperature=0, ignore_eos=True)
        info = client.get_session(first.session_id)
        assert info.kv_tier == "host" and info.host_blocks > 0 and info.resident_blocks == 0
        reply = first.send([9, 10, 11], max_tokens=4, temperature=0, ignore_eos=True)
        assert reply.usage.cached_prompt_tokens >= 30  # restored, not recomputed
        stats = client.stats()
        assert stats.host_kv_blocks_total == 400 and stats.kv_blocks_offloaded > 0 and stats.kv_blocks_restored > 0
        assert stats.restored_prompt_tokens >= 30
        with pytest.raises(CbdError) as bad:
            client.generate([5, 6, 7], max_tokens=2, expected_idle_ms=10)
        assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT and "session_id" in bad.value.details
        with pytest.raises(CbdError) as bad:
            client.session(retention="sometimes")
        assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with grpc.insecure_channel(d.address) as channel:
        with pytest.raises(grpc.RpcError) as raw:
            cbd_pb2_grpc.CbdStub(channel).OpenSession(pb.OpenSessionRequest(retention=9), timeout=30)  # type: ignore[arg-type]
        assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "retention" in (raw.value.details() or "")
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line and line[0] != "#"}
    assert values["cbd_host_kv_blocks_total"] == 400 and values["cbd_kv_offloaded_blocks_total"] > 0
    assert values["cbd_kv_restored_bytes_total"] > 0 and values["cbd_kv_restore_seconds_count"] >= 1
    assert values['cbd_session_turns_by_tier_total{tier="host"}'] >= 1
    assert values["cbd_kv_restored_prompt_tokens_total"] >= 30
    assert values['cbd_engine_step_phase_seconds_count{phase="launch"}'] >= 1  # from the engine process


def test_a_prefix_sessions_share_is_on_the_host_once(tiny_loaded) -> None:
    core = make_core(tiny_loaded, block_size=4, num_kv_blocks=200, num_host_kv_blocks=400)
    system = list(range(2, 42))  # 10 full blocks every session starts with
    ids = [core.sessions.open(token_ids=system).session_id for _ in range(3)]
    for i, sid in enumerate(ids):
        _turn(core, sid, [50 + i] * 6)
    held = [core.sessions.info(core.sessions.get(sid)).resident_blocks for sid in ids]
    core.sessions.eviction.evict(core.block_manager.num_blocks)  # everything idle leaves the GPU
    host = [core.sessions.info(core.sessions.get(sid)).host_blocks for sid in ids]
    assert host == held and all(h > 10 for h in host)
    assert core.host_tier is not None
    assert core.host_tier.pool.num_used_blocks == sum(held) - 2 * 10  # the 10 shared blocks once, not three times
    answers = [_turn(core, sid, [7, 8])[0] for sid in ids]  # restored: answers as if they had stayed
    fresh = make_core(tiny_loaded, block_size=4, num_kv_blocks=200, num_host_kv_blocks=0)
    fresh_ids = [fresh.sessions.open(token_ids=system).session_id for _ in range(3)]
    for i, sid in enumerate(fresh_ids):
        _turn(fresh, sid, [50 + i] * 6)
    assert answers == [_turn(fresh, sid, [7, 8])[0] for sid in fresh_ids]
    for sid in ids:
        core.sessions.close(sid)
    _assert_empty(core)
