"""Sessions saved to their files and listed again by a new engine on the same directory: the next turns
answer exactly as an engine that never stopped, with their KV read back from the files (not recomputed);
damaged files, another KV layout, a full disk and TTLs that ran out while down cost recomputing, never
a wrong answer. The oracle: the same sessions on an engine without session files, never restarted."""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from pathlib import Path

import pytest

from cbd.config import EngineConfig
from cbd.engine.core import EngineCore
from cbd.engine.engine import Engine
from cbd.engine.kv import disk_tier, session_file_save
from cbd.engine.kv import session_files as files
from cbd.engine.sampling_params import SamplingParams
from cbd.engine.sequence import Request
from cbd.engine.sessions.records import RETENTION_HIGH, Session, TurnInput
from cbd.errors import SessionExists, SettingError, UnknownSession
from helpers import checked_step, make_core, poll_until

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
FAN = SamplingParams(max_tokens=5, temperature=1.0, seed=3, n=2)
SIZES = {"block_size": 4, "num_kv_blocks": 512, "num_host_kv_blocks": 400}


def _turn(core: EngineCore, key: str, tokens: list[int], params: SamplingParams = GREEDY, **kw) -> tuple[list, int]:
    """One turn to its end: (each candidate's tokens, cached prompt tokens)."""
    return _until_done(core, core.add_session_turn(key, tokens, params, **kw))


def _until_done(core: EngineCore, request: Request) -> tuple[list, int]:
    """Step until nothing is left: the request's (each candidate's tokens, cached prompt tokens)."""
    answers: dict[int, list[int]] = {}
    cached = -1
    while core.has_work():
        for out in checked_step(core):
            if out.request_id == request.request_id:
                for d in out.candidates:
                    answers.setdefault(d.index, []).extend(d.token_ids)
                cached = out.usage.cached_prompt_tokens if out.finished and out.usage else cached
    return [answers[i] for i in sorted(answers)], cached


def _script(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 256) for _ in range(rng.randrange(9, 30))] for _ in range(3)]


def _first_turns(core: EngineCore) -> list[str]:
    """Six sessions with two greedy turns each (one with a pending fan-out), and two forks."""
    keys = []
    for i in range(6):
        key = core.sessions.open(session_id=f"t{i % 2}/agent-{i}", ttl=600 + i, retention=i % 3 - 1).session_id
        script = _script(i)
        _turn(core, key, script[0])
        _turn(core, key, script[1], FAN if i == 5 else GREEDY)
        keys.append(key)
    for i in (0, 3):
        keys.append(core.sessions.fork(keys[i], new_session_id=f"t{i % 2}/fork-{i}").session_id)
    return keys


def _third_turns(core: EngineCore, keys: list[str]) -> list[tuple[list, int]]:
    out = []
    for j, key in enumerate(keys):
        script = _script(j if j < 6 else (0, 3)[j - 6])
        out.append(_turn(core, key, script[2], parent_candidate=1 if j == 5 else None))
    return out


def _saved(tiny_loaded, directory: Path, **overrides) -> EngineCore:  # noqa: ANN001
    """An engine that runs the first turns, saves every session and stops (its directory lock released)."""
    core = make_core(tiny_loaded, disk_kv_dir=str(directory), **{**SIZES, **overrides})
    _first_turns(core)
    assert core.checkpoints is not None
    report = core.checkpoints.save_all(60.0)
    assert report.num_saved == 8 and report.num_failed == 0
    core.checkpoints.disk.close()
    return core


def _restarted(tiny_loaded, directory: Path, **overrides) -> EngineCore:  # noqa: ANN001
    core = make_core(tiny_loaded, disk_kv_dir=str(directory), **{**SIZES, **overrides})
    assert core.checkpoints is not None
    core.checkpoints.restore()
    return core


@pytest.fixture()
def oracle(tiny_loaded) -> list[tuple[list, int]]:  # noqa: ANN001
    core = make_core(tiny_loaded, **SIZES)
    return _third_turns(core, _first_turns(core))


def test_restored_sessions_answer_as_if_never_stopped_with_their_kv_from_disk(tiny_loaded, tmp_path, oracle) -> None:
    saved = _saved(tiny_loaded, tmp_path)
    before = {s.session_id: saved.sessions.info(s) for s in saved.sessions.sessions.values()}
    core = _restarted(tiny_loaded, tmp_path)
    infos = {s.session_id: core.sessions.info(s) for s in core.sessions.sessions.values()}
    assert set(infos) == set(before)
    for key, info in infos.items():  # settings and histories are back; the KV is on disk until used
        was = before[key]
        assert (info.num_tokens, info.ttl, info.retention, info.pending_candidates) == (
            was.num_tokens, was.ttl, was.retention, was.pending_candidates,
        )  # fmt: skip
        assert info.tier == "disk" and info.disk_blocks > 0 and info.resident_blocks == 0
    got = _third_turns(core, list(before))
    assert [answers for answers, _ in got] == [answers for answers, _ in oracle]
    # The KV came from the files: every third turn reused at least what a never-stopped engine reused (a
    # fork's turn may find more in the prefix cache: its source's turn had the same prompt).
    assert all(cached >= want > 0 for (_, cached), (_, want) in zip(got, oracle)), (got, oracle)
    assert core.sessions.hits["disk"] == 8 and core.sessions.hits["recompute"] == 0
    stats = core.stats().disk
    assert stats is not None and stats.num_sessions_restored == 8 and stats.num_kv_loads >= 8
    assert stats.num_kv_load_failures == 0 and stats.num_sessions_lost == 0
    for key in list(core.sessions.sessions):
        core.sessions.close(key)
    assert core.checkpoints is not None and core.checkpoints.disk.flush(10)
    assert not list((tmp_path / "engine").glob(f"*{files.SUFFIX}"))  # closing a session removes its file
    core.check_integrity()
    assert core.block_manager.num_used_blocks == 0 and core.host_tier is not None
    assert core.host_tier.pool.num_used_blocks == 0


def _record_gathers(monkeypatch) -> list[str]:  # noqa: ANN001
    """The thread of each gather from the GPU pool (`DiskTier.gather_gpu`), recorded from now on."""
    threads: list[str] = []
    gather = disk_tier.DiskTier.gather_gpu

    def recording(self, block_ids):  # type: ignore[no-untyped-def]
        threads.append(threading.current_thread().name)
        return gather(self, block_ids)

    monkeypatch.setattr(disk_tier.DiskTier, "gather_gpu", recording)
    return threads


def test_a_background_save_gathers_gpu_kv_on_the_writer_thread_and_holds_its_blocks_till_then(
    tiny_loaded, tmp_path, monkeypatch
) -> None:
    """save_idle names a session's GPU blocks and the disk tier's writer thread gathers them: the engine thread
    gathers nothing; the blocks stay referenced until the write is done, so a session evicted meanwhile and another
    turn that takes fresh blocks leave them unwritten; the file holds the KV the session had."""
    core = make_core(tiny_loaded, disk_kv_dir=str(tmp_path), block_size=4, num_kv_blocks=40, num_host_kv_blocks=40)
    key = core.sessions.open(session_id="saved").session_id
    rng = random.Random(9)
    _turn(core, key, [rng.randrange(2, 256) for _ in range(60)])
    session = core.sessions.sessions[key]
    assert core.checkpoints is not None
    disk = core.checkpoints.disk
    want = bytes(disk_tier.raw_bytes(disk.gather_gpu(list(session.block_table))))  # its KV as it is now
    threads = _record_gathers(monkeypatch)
    gate = threading.Event()
    disk._writer.submit(gate.wait, 30)  # the writer busy: the save waits in its queue
    assert core.checkpoints.save_idle(0.0) == 1
    assert threads == []  # nothing gathered on this thread
    held = sum(len(ids) for ids in core.checkpoints.held_blocks())
    assert held == len(session.block_table) > 0
    core.sessions.eviction.evict(core.block_manager.num_blocks)  # to the host tier: its GPU blocks released
    assert not session.block_table and session.host is not None and core.block_manager.num_used_blocks == held
    other = core.sessions.open(session_id="other").session_id
    _turn(core, other, [rng.randrange(2, 256) for _ in range(80)])  # takes every block not held
    core.check_integrity()
    gate.set()
    assert disk.flush(10) and threads and all(t.startswith("cbd-disk") for t in threads)
    saved, _ = files.read_header(tmp_path / "engine" / files.file_name(key))
    got = files.read_kv(tmp_path / "engine" / files.file_name(key), saved.branches[0])
    assert got is not None and bytes(got) == want
    core.sessions.close(other)
    core.sessions.eviction.evict(core.block_manager.num_blocks)  # looking for GPU blocks lets the held ones go
    assert core.checkpoints.held_blocks() == [] and core.block_manager.num_used_blocks == 0
    disk.close()


def test_saves_hold_at_most_hold_bytes_of_gpu_blocks_and_gather_the_rest_at_once(
    tiny_loaded, tmp_path, monkeypatch
) -> None:
    """Past HOLD_BYTES of GPU blocks held by queued saves, a save gathers its GPU blocks on the engine thread (its
    blocks are not held); both files hold their sessions' KV."""
    from cbd.engine.sessions import checkpoints as checkpoints_module

    core = make_core(tiny_loaded, disk_kv_dir=str(tmp_path), block_size=4, num_kv_blocks=64, num_host_kv_blocks=40)
    assert core.checkpoints is not None
    disk = core.checkpoints.disk
    monkeypatch.setattr(checkpoints_module, "HOLD_BYTES", 20 * disk.bytes_per_block)
    rng = random.Random(4)
    keys = [core.sessions.open(session_id=f"s{i}").session_id for i in range(2)]
    for key in keys:
        _turn(core, key, [rng.randrange(2, 256) for _ in range(60)])  # 17 blocks each
    want = [bytes(disk_tier.raw_bytes(disk.gather_gpu(list(core.sessions.sessions[k].block_table)))) for k in keys]
    threads = _record_gathers(monkeypatch)
    gate = threading.Event()
    disk._writer.submit(gate.wait, 30)
    assert core.checkpoints.save_idle(0.0) == 2
    assert [len(ids) for ids in core.checkpoints.held_blocks()] == [17]  # the first held, the second gathered
    on_engine = len(threads)  # the second session's extents (its whole blocks, its last partial block)
    assert on_engine >= 1 and set(threads) == {threading.current_thread().name}
    core.check_integrity()
    gate.set()
    assert disk.flush(10) and len(threads) > on_engine
    assert all(t.startswith("cbd-disk") for t in threads[on_engine:])
    for key, kv in zip(keys, want):
        path = tmp_path / "engine" / files.file_name(key)
        got = files.read_kv(path, files.read_header(path)[0].branches[0])
        assert got is not None and bytes(got) == kv
    disk.close()


def test_a_save_whose_gather_fails_lets_its_blocks_go_and_the_others_are_saved(
    tiny_loaded, tmp_path, monkeypatch
) -> None:
    """Past HOLD_BYTES a save gathers on the engine thread; when that gather fails, the blocks it had taken go back,
    the shutdown save counts it failed and saves the other sessions; one save holds even past the cap (nothing else
    held)."""
    from cbd.engine.sessions import checkpoints as checkpoints_module

    core = make_core(tiny_loaded, disk_kv_dir=str(tmp_path), block_size=4, num_kv_blocks=64, num_host_kv_blocks=40)
    assert core.checkpoints is not None
    disk = core.checkpoints.disk
    monkeypatch.setattr(checkpoints_module, "HOLD_BYTES", disk.bytes_per_block)  # under one session's
    rng = random.Random(6)
    keys = [core.sessions.open(session_id=f"f{i}").session_id for i in range(3)]
    for key in keys:
        _turn(core, key, [rng.randrange(2, 256) for _ in range(40)])
    gather = disk_tier.DiskTier.gather_gpu

    def failing(self, block_ids):  # type: ignore[no-untyped-def]
        if not threading.current_thread().name.startswith("cbd-disk"):
            raise RuntimeError("out of host memory")
        return gather(self, block_ids)

    monkeypatch.setattr(disk_tier.DiskTier, "gather_gpu", failing)
    report = core.checkpoints.save_all(60.0)
    assert (report.num_saved, report.num_failed, report.num_with_kv) == (1, 2, 1)
    assert core.checkpoints.held_blocks() == []
    core.check_integrity()
    for key in keys:
        core.sessions.close(key)
    assert core.checkpoints.disk.flush(10)
    core.sessions.eviction.evict(core.block_manager.num_blocks)
    assert core.block_manager.num_used_blocks == 0
    disk.close()


def test_saving_again_appends_only_the_kv_a_file_lacks_and_later_restarts_answer_the_same(
    tiny_loaded, tmp_path
) -> None:
    """Saved after two turns, restarted, a third turn, saved again (appended); restarted, a transcript that
    outgrows the header's slot (the file written anew while the KV is only in it), a fourth turn, saved
    (appended to a restarted engine's file); restarted: every turn answers as an engine that never
    stopped, with its KV from the files."""
    keys, want4, want5 = _later_turns_never_stopped(tiny_loaded)
    _saved(tiny_loaded, tmp_path)
    core = _restarted(tiny_loaded, tmp_path)
    before = {k: len(core.sessions.sessions[k].token_ids) for k in keys}
    _third_turns(core, keys)
    assert core.checkpoints is not None
    written = _bytes_written(core)
    assert core.checkpoints.save_all(60.0).num_with_kv == 8
    appended = _bytes_written(core) - written
    # Each branch's new tokens' blocks, its last partial block before them written again, its header slot.
    per_block = core.checkpoints.disk.bytes_per_block
    branches = sum(len(core.sessions.sessions[k].branches_and_self()) for k in keys)
    grown = sum(len(core.sessions.sessions[k].token_ids) - before[k] for k in keys)
    bound = (grown // 4 + 2 * branches) * per_block + 1024 * branches
    whole = sum(-(-len(core.sessions.sessions[k].token_ids) // 4) for k in keys) * per_block
    assert appended <= bound < whole, (appended, bound, whole)
    core.checkpoints.disk.close()

    again = _restarted(tiny_loaded, tmp_path)
    assert again.checkpoints is not None
    slots = {k: files.read_header(tmp_path / "engine" / files.file_name(k))[1].slot_size for k in keys}
    again.checkpoints.take_notes({k: bytes(3 * slots[k]) for k in keys})  # a transcript larger than the slot
    assert again.checkpoints.save_all(60.0).num_saved == 8
    assert all(files.read_header(tmp_path / "engine" / files.file_name(k))[1].slot_size > slots[k] for k in keys)
    got = [_turn(again, key, FOURTH[j]) for j, key in enumerate(keys)]
    assert [answers for answers, _ in got] == [answers for answers, _ in want4]
    assert all(cached >= w > 0 for (_, cached), (_, w) in zip(got, want4)), (got, want4)
    assert again.sessions.hits["disk"] == 8 and again.sessions.hits["recompute"] == 0
    assert again.checkpoints.save_all(60.0).num_with_kv == 8
    again.checkpoints.disk.close()

    last = _restarted(tiny_loaded, tmp_path)
    got = [_turn(last, key, FIFTH[j]) for j, key in enumerate(keys)]
    assert [answers for answers, _ in got] == [answers for answers, _ in want5]
    assert all(cached >= w > 0 for (_, cached), (_, w) in zip(got, want5)), (got, want5)
    assert last.sessions.hits["disk"] == 8 and last.sessions.hits["recompute"] == 0
    assert last.checkpoints is not None
    last.checkpoints.disk.close()


def test_a_damaged_extent_is_written_again_by_the_next_save(tiny_loaded, tmp_path, caplog) -> None:
    keys, want4, _ = _later_turns_never_stopped(tiny_loaded)
    _saved(tiny_loaded, tmp_path)
    path = tmp_path / "engine" / files.file_name(keys[0])
    data = bytearray(path.read_bytes())
    first = files.read_header(path)[0].branches[0].extents[0]
    assert first.num_tokens % 4 == 0  # whole blocks: an extent the next save would keep
    data[first.offset + 5] ^= 0xFF  # a flipped bit in it
    path.write_bytes(bytes(data))
    core = _restarted(tiny_loaded, tmp_path)
    with caplog.at_level(logging.WARNING):
        _, cached = _turn(core, keys[0], _script(0)[2])
    assert cached == 0 and "its KV is damaged" in caplog.text
    assert core.checkpoints is not None and core.checkpoints.save_all(60.0).num_with_kv == 1  # the one changed
    core.checkpoints.disk.close()
    caplog.clear()
    again = _restarted(tiny_loaded, tmp_path)
    with caplog.at_level(logging.WARNING):
        answers, cached = _turn(again, keys[0], FOURTH[0])
    assert (answers, "damaged" in caplog.text) == (want4[0][0], False)
    assert cached >= want4[0][1] > 0
    assert again.checkpoints is not None
    again.checkpoints.disk.close()


def test_past_the_saving_deadline_a_file_keeps_the_kv_it_held(tiny_loaded, tmp_path) -> None:
    """A shutdown whose deadline has passed saves token ids without gathering KV, but a session's file keeps
    the KV it held from an earlier save: the next turn recomputes only the turn saved without."""
    keys, want, _ = _later_turns_never_stopped(tiny_loaded)
    _saved(tiny_loaded, tmp_path)
    core = _restarted(tiny_loaded, tmp_path)
    held = {
        k: [b.disk.num_tokens if b.disk else 0 for b in core.sessions.sessions[k].branches_and_self()] for k in keys
    }
    _third_turns(core, keys)
    assert core.checkpoints is not None
    report = core.checkpoints.save_all(0.0)  # the deadline is already past
    assert report.num_saved == 8 and report.num_with_kv == 8
    core.checkpoints.disk.close()
    again = _restarted(tiny_loaded, tmp_path)
    for key in keys:  # the history's KV as its file held it before the third turn (from the candidate taken)
        kept = again.sessions.sessions[key].disk
        assert kept is not None and max(held[key]) // 4 * 4 <= kept.num_tokens <= max(held[key]), (key, held[key])
    got = [_turn(again, key, FOURTH[j]) for j, key in enumerate(keys)]
    assert [answers for answers, _ in got] == [answers for answers, _ in want]
    # Less KV reused than by the engine that never stopped (the third turns' is recomputed), but some; a
    # fork's turn may find its source's third turn in the prefix cache (its source's fourth recomputed it).
    assert all(cached > 0 for _, cached in got) and all(c < w for (_, c), (_, w) in zip(got[:6], want)), (got, want)
    assert again.checkpoints is not None
    again.checkpoints.disk.close()


def _bytes_written(core: EngineCore) -> int:
    stats = core.stats().disk
    assert stats is not None
    return stats.bytes_written


FOURTH = [[(7 * j + t) % 250 + 2 for t in range(12)] for j in range(8)]
FIFTH = [[(11 * j + 3 * t) % 250 + 2 for t in range(9)] for j in range(8)]


def _later_turns_never_stopped(tiny_loaded) -> tuple[list[str], list[tuple[list, int]], list[tuple[list, int]]]:  # noqa: ANN001
    """The sessions' keys, and their fourth (FOURTH) and fifth (FIFTH) turns on an engine that never stopped."""
    never = make_core(tiny_loaded, **SIZES)
    keys = _first_turns(never)
    _third_turns(never, keys)
    fourth = [_turn(never, key, FOURTH[j]) for j, key in enumerate(keys)]
    return keys, fourth, [_turn(never, key, FIFTH[j]) for j, key in enumerate(keys)]


def _rewrite(path: Path, change) -> None:  # noqa: ANN001
    """Rewrite a session file with its header changed by `change` (its KV kept)."""
    saved, _ = files.read_header(path)
    kv = [files.read_kv(path, b) if b.kv_tokens else None for b in saved.branches]
    change(saved)
    path.unlink()
    session_file_save.save(
        path, saved, [files.NewKv(None, 0, [(d, b.kv_tokens)]) if d else None for d, b in zip(kv, saved.branches)]
    )


def test_damaged_files_and_another_kv_layout_recompute_with_the_same_answers(
    tiny_loaded, tmp_path, oracle, caplog
) -> None:  # fmt: skip
    _saved(tiny_loaded, tmp_path)
    paths = {
        k: tmp_path / "engine" / files.file_name(k) for k in ("t0/agent-0", "t1/agent-1", "t0/agent-2", "t1/agent-3")
    }
    data = bytearray(paths["t0/agent-0"].read_bytes())
    data[-3] ^= 0xFF  # a flipped bit in its KV
    paths["t0/agent-0"].write_bytes(bytes(data))
    with open(paths["t1/agent-1"], "r+b") as f:  # truncated in its KV
        f.truncate(paths["t1/agent-1"].stat().st_size - 100)
    _rewrite(paths["t0/agent-2"], lambda s: setattr(s, "fingerprint", files.Fingerprint(s.fingerprint.model, "x")))
    header = bytearray(paths["t1/agent-3"].read_bytes())
    header[20] ^= 0xFF  # its header: the session cannot come back at all
    paths["t1/agent-3"].write_bytes(bytes(header))
    with caplog.at_level(logging.WARNING):
        core = _restarted(tiny_loaded, tmp_path)
        assert "t1/agent-3" not in core.sessions.sessions and len(core.sessions.sessions) == 7
        keys = [k for k in _keys() if k != "t1/agent-3"]
        got = dict(zip(keys, _third_turns_of(core, keys)))
    want = dict(zip(_keys(), oracle))
    for key, (answers, cached) in got.items():
        assert answers == want[key][0], key
        if key in ("t0/agent-0", "t1/agent-1", "t0/agent-2"):
            assert cached == 0, key  # recomputed
        else:
            assert cached >= want[key][1] > 0, key
    log = caplog.text
    assert log.count("its KV is damaged") == 2 and "another layout" in log
    assert files.file_name("t1/agent-3") in log and "header" in log
    stats = core.stats().disk
    assert stats is not None and stats.num_kv_load_failures == 2 and stats.num_sessions_lost == 1


def _keys() -> list[str]:
    return [f"t{i % 2}/agent-{i}" for i in range(6)] + ["t0/fork-0", "t1/fork-3"]


def _third_turns_of(core: EngineCore, keys: list[str]) -> list[tuple[list, int]]:
    every = _keys()
    out = []
    for key in keys:
        j = every.index(key)
        script = _script(j if j < 6 else (0, 3)[j - 6])
        out.append(_turn(core, key, script[2], parent_candidate=1 if j == 5 else None))
    return out


def test_a_disk_cap_saves_token_ids_only_and_the_answers_stay(tiny_loaded, tmp_path, oracle) -> None:
    saved = _saved(tiny_loaded, tmp_path, disk_kv_gib=4096 / 2**30)  # 4 KiB: less than one session's KV
    stats = saved.stats().disk
    assert stats is not None and stats.num_files_written == 8 and stats.num_kv_files_written == 0
    assert not list((tmp_path / "engine").glob(".*.tmp"))
    core = _restarted(tiny_loaded, tmp_path)
    got = _third_turns(core, _keys())
    assert [a for a, _ in got] == [a for a, _ in oracle]
    assert all(cached == 0 for _, cached in got[:6])  # (the forks' turns find their sources' in the prefix cache)
    assert core.sessions.hits["recompute"] == 8


def test_saves_over_the_cap_add_no_kv_but_keep_what_the_file_holds(tiny_loaded, tmp_path) -> None:
    core = make_core(tiny_loaded, disk_kv_dir=str(tmp_path), **SIZES)
    assert core.checkpoints is not None
    key = core.sessions.open(session_id="capped").session_id
    _turn(core, key, _script(0)[0])
    assert core.checkpoints.save_all(60.0).num_with_kv == 1
    path = tmp_path / "engine" / files.file_name(key)
    held = files.read_header(path)[0].branches[0].kv_tokens
    core.checkpoints.disk.cap_bytes = path.stat().st_size  # the directory is full from now on
    for tokens in _script(0)[1:]:  # two more turns, each saved over the cap
        _turn(core, key, tokens)
        assert core.checkpoints.save_all(60.0).num_saved == 1
        saved = files.read_header(path)[0]
        assert saved.branches[0].token_ids == core.sessions.sessions[key].token_ids
        assert 0 < held // 4 * 4 == saved.branches[0].kv_tokens  # its whole blocks, not the new turns'
    core.checkpoints.disk.close()


def test_a_failed_write_leaves_no_file_and_the_session_keeps_serving(tiny_loaded, tmp_path, monkeypatch) -> None:
    core = make_core(tiny_loaded, disk_kv_dir=str(tmp_path), **SIZES)
    key = core.sessions.open(session_id="full").session_id
    _turn(core, key, _script(0)[0])

    def full(*args, **kwargs):  # noqa: ANN002, ANN003
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("os.fsync", full)
    assert core.checkpoints is not None
    report = core.checkpoints.save_all(10.0)
    assert (report.num_saved, report.num_failed) == (0, 1)
    monkeypatch.undo()
    assert not list((tmp_path / "engine").glob(f"*{files.SUFFIX}")) and not list((tmp_path / "engine").glob(".*.tmp"))
    assert _turn(core, key, _script(0)[1])[0]  # still served
    stats = core.stats().disk
    assert stats is not None and stats.num_write_errors == 1
    core.checkpoints.disk.close()


def test_a_ttl_that_ran_out_while_down_removes_the_session(tiny_loaded, tmp_path, caplog) -> None:
    core = make_core(tiny_loaded, disk_kv_dir=str(tmp_path), **SIZES)
    for key, ttl in (("short", 100.0), ("long", 1000.0)):
        core.sessions.open(session_id=key, ttl=ttl)
        _turn(core, key, _script(1)[0])
    assert core.checkpoints is not None
    core.checkpoints.save_all(10.0)
    core.checkpoints.disk.close()
    for key in ("short", "long"):  # as if the daemon had been down for 500 s since
        _rewrite(tmp_path / "engine" / files.file_name(key), lambda s: setattr(s, "saved_at", time.time() - 500))
    with caplog.at_level(logging.INFO):
        restarted = _restarted(tiny_loaded, tmp_path)
    assert list(restarted.sessions.sessions) == ["long"]
    assert 499 < restarted.sessions.sessions["long"].idle_seconds() < 1000
    assert "session short expired while the daemon was down" in caplog.text
    assert restarted.checkpoints is not None and restarted.checkpoints.disk.flush(10)
    assert not (tmp_path / "engine" / files.file_name("short")).exists()


def test_one_daemon_per_owner_and_a_stopped_owners_sessions_move_to_the_daemon_asked(
    tiny_loaded, tmp_path, oracle, monkeypatch
) -> None:  # fmt: skip
    monkeypatch.setattr(disk_tier, "LOCK_WAIT", 0.2)
    first = _saved(tiny_loaded, tmp_path, disk_kv_owner="a", disk_kv_gib=1.0)  # saved, then stopped
    with pytest.raises(SettingError, match="holds the owner name 'b'"):
        held = make_core(tiny_loaded, disk_kv_dir=str(tmp_path), disk_kv_owner="b", **SIZES)
        make_core(tiny_loaded, disk_kv_dir=str(tmp_path), disk_kv_owner="b", **SIZES)
    assert held.checkpoints is not None and first.checkpoints is not None
    # A live owner's sessions are not taken: "c" asks for one while "a" is up again.
    again = make_core(tiny_loaded, disk_kv_dir=str(tmp_path), disk_kv_owner="a", **SIZES)
    taker = make_core(tiny_loaded, disk_kv_dir=str(tmp_path), disk_kv_owner="c", **SIZES)
    with pytest.raises(UnknownSession):
        taker.sessions.get("t0/agent-0")
    assert again.checkpoints is not None
    again.checkpoints.disk.close()
    # "a" stopped: the daemon asked for its sessions takes each over (the file moves to its folder), once.
    keys = _keys()
    got = _third_turns_of(taker, keys[:3])
    assert [a for a, _ in got] == [a for a, _ in oracle[:3]]
    assert all(cached >= want > 0 for (_, cached), (_, want) in zip(got, oracle[:3]))
    moved = {files.file_name(k) for k in keys[:3]}
    assert {p.name for p in (tmp_path / "c").glob(f"*{files.SUFFIX}")} == moved
    assert not moved & {p.name for p in (tmp_path / "a").glob(f"*{files.SUFFIX}")}
    with pytest.raises(UnknownSession):  # "b" finds nothing left to take of what "c" holds
        held.sessions.get(keys[0])
    assert held.sessions.get(keys[3]).session_id == keys[3]  # but takes what "a" still had
    with pytest.raises(SessionExists):  # a saved session is still open: opening its id again takes it over
        held.sessions.open(session_id=keys[4])
    assert keys[4] in held.sessions.sessions
    for core in (held, taker):
        assert core.checkpoints is not None
        core.checkpoints.disk.close()


def test_a_turn_waits_for_its_kv_to_be_read_back_while_the_batch_goes_on(
    tiny_loaded, tmp_path, oracle, monkeypatch
) -> None:  # fmt: skip
    _saved(tiny_loaded, tmp_path)
    gate = threading.Event()
    read = files.read_kv_into

    def held(*args):  # noqa: ANN002
        assert gate.wait(60)
        return read(*args)

    monkeypatch.setattr(files, "read_kv_into", held)  # the disk tier's reader thread waits at the gate
    engine = Engine(EngineConfig(disk_kv_dir=str(tmp_path), **SIZES), loaded=tiny_loaded)
    try:
        outputs: list = []
        accepted = engine.submit_turn("t0/agent-0", TurnInput(_script(0)[2]), GREEDY, on_output=outputs.append)
        # Another request runs to its end while the turn waits for its session's KV.
        (other,) = engine.generate([[5, 6, 7, 8, 9]], GREEDY)
        assert len(other.candidates[0].token_ids) == GREEDY.max_tokens
        assert not accepted.done() and not outputs
        (info,) = [i for i in engine.list_sessions().result(10) if i.session_id == "t0/agent-0"]
        assert info.tier == "disk"
        gate.set()
        accepted.result(30)
        poll_until(lambda: outputs and outputs[-1].finished, 30, what="the turn ends")
    finally:
        gate.set()
        engine.shutdown()
    answer = [t for out in outputs for d in out.candidates for t in d.token_ids]
    assert [answer] == oracle[0][0]
    assert outputs[-1].usage.cached_prompt_tokens >= oracle[0][1] > 0


def test_a_turn_read_back_into_a_full_host_tier_takes_the_room_of_idle_sessions_of_no_higher_retention(
    tiny_loaded, tmp_path, oracle
) -> None:  # fmt: skip
    """A restored engine whose host tier (24 blocks) holds one session's KV at a time: agent-0 (LOW),
    agent-1 (NORMAL) and agent-3 (LOW) take their third turns in turn, each session's KV moved to the host
    after its turn, so each later turn finds the host tier full of the one before."""
    _saved(tiny_loaded, tmp_path)
    core = _restarted(tiny_loaded, tmp_path, num_host_kv_blocks=24)
    host = core.host_tier
    assert host is not None

    def third(j: int, then_to_host: bool = True) -> int:
        """Agent j's third turn (its answer checked against the never-stopped engine's); its cached tokens."""
        key = f"t{j % 2}/agent-{j}"
        answers, cached = _turn(core, key, _script(j)[2])
        assert answers == oracle[j][0]
        if then_to_host:
            core.sessions.eviction.evict(core.block_manager.num_blocks)  # its KV goes to the host tier
            assert core.sessions.sessions[key].host is not None
        return cached

    def no_room_for(j: int) -> bool:
        copy = core.sessions.sessions[f"t{j % 2}/agent-{j}"].disk
        return copy is not None and host.num_free_blocks < -(-copy.num_tokens // 4)

    assert third(0) >= oracle[0][1] > 0  # read back into free room
    assert no_room_for(1)
    # NORMAL after LOW: agent-0's host copy makes way, agent-1's KV is read back.
    assert third(1) >= oracle[1][1] > 0
    assert core.sessions.sessions["t0/agent-0"].host is None
    assert no_room_for(3)
    # LOW after NORMAL: agent-1 keeps its host copy, agent-3 recomputes its history.
    assert third(3, then_to_host=False) == 0
    assert core.sessions.sessions["t1/agent-1"].host is not None
    assert core.sessions.hits["disk"] == 2 and core.sessions.hits["recompute"] == 1
    core.check_integrity()
    assert core.checkpoints is not None
    core.checkpoints.disk.close()


@pytest.mark.parametrize("abort", [False, True])
def test_a_turn_read_back_takes_the_host_room_of_a_running_turns_session_before_recomputing(
    tiny_loaded, tmp_path, oracle, abort
) -> None:  # fmt: skip
    """The host tier (24 blocks) holds one session's KV: agent-0's, whose next turn is running (restored from it,
    so its session's copy is kept only for the case that turn fails). agent-1's third turn, its KV in its file,
    takes that room and reads its KV back instead of recomputing. Both answers are those of an engine without the
    pressure; with `abort`, agent-0's turn is aborted after its copy went, and the same turn again recomputes."""
    longer = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    reference = make_core(tiny_loaded, **SIZES)
    _first_turns(reference)
    _turn(reference, "t0/agent-0", _script(0)[2])
    want = _turn(reference, "t0/agent-0", [7, 8, 9], longer)[0][0]
    _saved(tiny_loaded, tmp_path)
    core = _restarted(tiny_loaded, tmp_path, num_host_kv_blocks=24)
    assert core.host_tier is not None and core.checkpoints is not None
    assert _turn(core, "t0/agent-0", _script(0)[2])[0] == oracle[0][0]
    core.sessions.eviction.evict(core.block_manager.num_blocks)
    agent0 = core.sessions.sessions["t0/agent-0"]
    assert agent0.host is not None and core.host_tier.num_free_blocks < 24 // 2
    running = core.add_session_turn("t0/agent-0", [7, 8, 9], longer)
    seq = running.sequences[0]
    while not (seq.host_prefix is None and seq.host_backup is None and seq.num_computed_tokens > 0):
        checked_step(core)
    assert agent0.busy is running and agent0.host is not None and not running.is_finished
    turn = core.add_session_turn("t1/agent-1", _script(1)[2], GREEDY)  # its KV read back into agent-0's room
    assert agent0.host is None and core.sessions.eviction.num_stale_dropped == 1
    if abort:
        core.abort_request(running.request_id)
    answers, cached = _until_done(core, turn)
    assert answers == oracle[1][0]
    assert cached >= oracle[1][1] > 0  # read back, not recomputed
    assert core.sessions.hits["disk"] == 2 and running.is_finished and agent0.busy is None
    core.check_integrity()
    if abort:  # the session as before that turn, its KV recomputed
        assert agent0.host is None and not agent0.block_table
        assert _turn(core, "t0/agent-0", [7, 8, 9], longer)[0][0] == want
    else:
        assert seq.token_ids[seq.num_prompt_tokens :] == want
    core.check_integrity()
    core.checkpoints.disk.close()


def _agents(core: EngineCore, scripts: list[list[list[int]]]) -> tuple[list, int]:
    """Every agent's turn k, round robin; (answers, prompt tokens computed). Closes the sessions after."""
    keys = [core.sessions.open(session_id=f"spill-{i}").session_id for i in range(len(scripts))]
    answers: list[list] = [[] for _ in scripts]
    computed = 0
    for k in range(len(scripts[0])):
        for i, key in enumerate(keys):
            request = core.add_session_turn(key, scripts[i][k], GREEDY)
            out_tokens, usage = [], None
            while core.has_work():
                for out in checked_step(core):
                    if out.request_id == request.request_id:
                        out_tokens += [t for d in out.candidates for t in d.token_ids]
                        usage = out.usage if out.finished else usage
            assert usage is not None
            answers[i].append(out_tokens)
            computed += usage.prompt_tokens - usage.cached_prompt_tokens
    for key in keys:
        core.sessions.close(key)
    core.check_integrity()
    assert core.block_manager.num_used_blocks == 0
    assert core.host_tier is None or core.host_tier.pool.num_used_blocks == 0
    return answers, computed


@pytest.mark.parametrize("host_blocks", [50, 26])
def test_the_host_tiers_evictions_spill_to_disk_instead_of_recomputing(tiny_loaded, tmp_path, host_blocks) -> None:
    """6 agents, 4 turns each, round robin, over a GPU pool of 40 blocks and a host tier of 50 or 26 (about one
    session at its longest: then the GPU's evictions find no host room and go to disk themselves)."""
    rng = random.Random(11)
    scripts = [[[rng.randrange(2, 256) for _ in range(rng.randrange(10, 30))] for _ in range(4)] for _ in range(6)]
    small = {"block_size": 4, "num_kv_blocks": 40, "num_host_kv_blocks": host_blocks}
    ideal, ideal_computed = _agents(
        make_core(tiny_loaded, block_size=4, num_kv_blocks=512, num_host_kv_blocks=0), scripts
    )
    host_only, host_computed = _agents(make_core(tiny_loaded, **small), scripts)
    spilling = make_core(tiny_loaded, disk_kv_dir=str(tmp_path), disk_kv_spill=True, **small)
    spilled, spill_computed = _agents(spilling, scripts)
    assert host_only == ideal and spilled == ideal
    stats = spilling.stats().disk
    assert stats is not None and stats.num_spilled > 0 and stats.num_kv_loads > 0
    assert spilling.sessions.hits["disk"] > 0
    # What the tiers above had to let go came back from disk: every turn computed only its new tokens, as
    # with a GPU pool that holds everything (a turn whose KV is read back while the host tier is full of
    # idle sessions takes their room: they are spilled in turn), where the host tier alone recomputes.
    # Each spill after the first of a session appends what its file lacks (else extents would not line up).
    assert spill_computed == ideal_computed < host_computed, (ideal_computed, spill_computed, host_computed)
    assert spilling.checkpoints is not None and spilling.checkpoints.disk.flush(10)
    assert not list((tmp_path / "engine").glob(f"*{files.SUFFIX}"))  # closed: no file left
    spilling.checkpoints.disk.close()


def test_on_a_gpu_the_pools_evictions_make_host_room_by_spilling_and_nothing_is_gathered_from_the_pool(
    tiny_loaded, tmp_path, monkeypatch
) -> None:
    """As above with a host tier of about one session, where the GPU pool's evictions find no host room, and the pool
    taken for a GPU's (`spills_from_gpu` off: a gather from it would wait for the step in flight): nothing is
    gathered from the pool; the host tier makes room by spilling idle sessions' host copies, and the GPU pool's
    evictions go there; what still finds no room recomputes. The answers stay, and no more is computed than with
    the host tier alone."""
    monkeypatch.setattr(disk_tier.DiskTier, "spills_from_gpu", property(lambda self: False))

    def gather_gpu(self, block_ids):  # type: ignore[no-untyped-def]
        raise AssertionError("a spill gathered KV from the GPU pool")

    monkeypatch.setattr(disk_tier.DiskTier, "gather_gpu", gather_gpu)
    rng = random.Random(11)
    scripts = [[[rng.randrange(2, 256) for _ in range(rng.randrange(10, 30))] for _ in range(4)] for _ in range(6)]
    small = {"block_size": 4, "num_kv_blocks": 40, "num_host_kv_blocks": 26}
    ideal, _ = _agents(make_core(tiny_loaded, block_size=4, num_kv_blocks=512, num_host_kv_blocks=0), scripts)
    _, host_computed = _agents(make_core(tiny_loaded, **small), scripts)
    spilling = make_core(tiny_loaded, disk_kv_dir=str(tmp_path), disk_kv_spill=True, **small)
    spilled, spill_computed = _agents(spilling, scripts)
    assert spilled == ideal
    stats = spilling.stats().disk
    assert stats is not None and stats.num_spilled > 0 and stats.num_kv_loads > 0
    assert spill_computed < host_computed, (spill_computed, host_computed)
    assert spilling.checkpoints is not None and spilling.checkpoints.disk.flush(10)
    spilling.checkpoints.disk.close()


def test_a_gpu_eviction_without_host_room_spills_the_host_copy_of_a_session_due_back_sooner(
    tiny_loaded, tmp_path, monkeypatch
) -> None:
    """The GPU pool lets a session go (it is due back last) while the host tier is full of one due back sooner:
    with the GPU's pool not gathered from (`spills_from_gpu` off), the host copy goes to its file, and the GPU's
    session to the host tier (before: the GPU's session recomputed, the host copy stayed)."""
    monkeypatch.setattr(disk_tier.DiskTier, "spills_from_gpu", property(lambda self: False))
    core = make_core(tiny_loaded, disk_kv_dir=str(tmp_path), disk_kv_spill=True, block_size=4, num_kv_blocks=64,
                     num_host_kv_blocks=16)  # fmt: skip
    soon, later = core.sessions.open(session_id="soon").session_id, core.sessions.open(session_id="later").session_id
    rng = random.Random(5)
    _turn(core, soon, [rng.randrange(2, 256) for _ in range(36)], expected_idle=1.0)
    core.sessions.eviction.evict(core.block_manager.num_blocks)  # "soon" to the host tier (13 of its 16 blocks)
    first = core.sessions.sessions[soon]
    assert first.host is not None and not first.block_table
    _turn(core, later, [rng.randrange(2, 256) for _ in range(36)], expected_idle=600.0)
    core.sessions.eviction.evict(core.block_manager.num_blocks)
    second = core.sessions.sessions[later]
    assert second.host is not None and not second.block_table  # in the host tier, not released to recompute
    disk = core.stats().disk
    assert first.host is None and disk is not None and disk.num_spilled == 1  # its KV to its file
    assert core.checkpoints is not None and core.checkpoints.disk.flush(10)
    for key in (soon, later):  # both next turns take their KV back (36 + 6 tokens; all but the last computed)
        assert _turn(core, key, [7, 8, 9])[1] == 41
    assert core.sessions.hits["disk"] >= 1 and core.sessions.hits["recompute"] == 0
    core.check_integrity()
    core.checkpoints.disk.close()


def _spilling_core(tiny_loaded, directory: Path) -> EngineCore:  # noqa: ANN001
    """Spilling on, a GPU pool of 64 blocks and a host tier of 26 (two 40-token sessions)."""
    return make_core(tiny_loaded, disk_kv_dir=str(directory), disk_kv_spill=True, block_size=4, num_kv_blocks=64,
                     num_host_kv_blocks=26)  # fmt: skip


def _all_to_files(core: EngineCore) -> None:
    """Every idle session's KV leaves the GPU (to the host tier) and the host tier (spilled to its file)."""
    core.sessions.eviction.evict(core.block_manager.num_blocks)
    assert core.host_tier is not None
    core.sessions.eviction.free_host(core.host_tier.pool.num_blocks, Session(session_id="-", ttl=None,
                                                                              retention=RETENTION_HIGH))  # fmt: skip


def test_sessions_due_back_are_read_ahead_of_their_turns_into_room_those_due_later_make(
    tiny_loaded, tmp_path, monkeypatch
) -> None:  # fmt: skip
    """Four agents said when they would be back (30 s, 7200 s, 3600 s, 7200 s); all their KV is in their files
    (a host tier of two sessions). As each comes due (the engine's clock moved on), its KV is read back before
    its turn, once, into host blocks that only sessions expected back after it give up (an agent two hours past
    its 30 s is expected back no sooner than one idle as long without a hint); then the turns answer as an
    engine with room for everything, from the KV read ahead (not recomputed, not read on the turn)."""
    import types

    from cbd.engine.sessions import eviction, read_back

    rng = random.Random(12)
    scripts = [[[rng.randrange(2, 256) for _ in range(40)] for _ in range(2)] for _ in range(4)]
    idle = [30.0, 7200.0, 3600.0, 7200.0]
    ideal = make_core(tiny_loaded, block_size=4, num_kv_blocks=512, num_host_kv_blocks=0)
    core = _spilling_core(tiny_loaded, tmp_path)
    keys = [f"due-{i}" for i in range(4)]
    for c in (ideal, core):
        for key, script, gap in zip(keys, scripts, idle):
            c.sessions.open(session_id=key)
            _turn(c, key, script[0], expected_idle=gap)
    # Everything leaves the GPU and the host tier: to the files.
    _all_to_files(core)
    checkpoints = core.checkpoints
    assert checkpoints is not None and checkpoints.disk.flush(30)
    loads, sessions = checkpoints.loads, core.sessions.sessions
    real = time.monotonic

    def where() -> list[str]:
        return ["host" if sessions[k].host else "disk" if sessions[k].disk else "none" for k in keys]

    def look(shift: float) -> None:
        """One look for sessions due with the clock `shift` seconds on, and its read to the end."""
        clock = types.SimpleNamespace(monotonic=lambda: real() + shift)
        monkeypatch.setattr(read_back, "time", clock)
        monkeypatch.setattr(eviction, "time", clock)
        loads._next_look = 0.0
        loads.prefetch(lambda key: False)

        def ended() -> bool:
            loads.completed()  # hands the branches their host copies
            return not any(loads.reading(k) for k in keys)

        poll_until(ended, 30, what="the read ends")

    look(0.0)  # none is due within its lead
    assert where() == ["disk"] * 4 and loads.num_read_ahead == 0
    for key in (keys[3], keys[1]):  # two sessions due back last fill the host tier (read for a fork, say)
        loads.read_back(sessions[key])
    assert where() == ["disk", "host", "disk", "host"]
    look(29.5)  # agent 0 is due: one of those due back last makes way
    assert where()[0] == "host" and where().count("host") == 2 and loads.num_read_ahead == 1
    look(29.5)  # read ahead once per idle period
    assert loads.num_read_ahead == 1
    look(3599.5)  # agent 2: the other makes way
    assert where() == ["host", "disk", "host", "disk"] and loads.num_read_ahead == 2
    look(7199.5)  # agents 1 and 3 are due; agent 2 (due sooner) keeps its room, agent 0 (long past due) gives way
    assert where() == ["disk", "host", "host", "disk"] and loads.num_read_ahead == 3
    look(7199.5)  # agent 3: both on the host are due no later than it
    assert where() == ["disk", "host", "host", "disk"] and loads.num_read_ahead == 3
    monkeypatch.setattr(read_back, "time", time)
    monkeypatch.setattr(eviction, "time", time)
    hits = dict(core.sessions.hits)
    for i in (1, 2):
        assert _turn(core, keys[i], scripts[i][1]) == _turn(ideal, keys[i], scripts[i][1])
    assert core.sessions.hits == hits | {"host": hits.get("host", 0) + 2}  # both from the KV read ahead
    assert _turn(core, keys[0], scripts[0][1]) == _turn(ideal, keys[0], scripts[0][1])  # read back on its turn
    assert core.sessions.hits["disk"] == hits.get("disk", 0) + 1
    core.check_integrity()
    checkpoints.disk.close()


def test_a_spill_is_written_without_fsyncs_and_the_next_background_save_makes_it_durable(
    tiny_loaded, tmp_path, monkeypatch
) -> None:  # fmt: skip
    """Spills keep KV for capacity, not for a crash: written without fsyncs. The sessions still count as
    changed, so the background save writes them again, fsynced, with no KV twice (their files hold it), and
    their files' names reach the disk (the directory synced); a restart then finds every session whole."""
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real(fd))
    directories: list[Path] = []
    sync = files.sync_directory
    monkeypatch.setattr(files, "sync_directory", lambda d: directories.append(d) or sync(d))
    rng = random.Random(13)
    scripts = [[rng.randrange(2, 256) for _ in range(40)] for _ in range(3)]
    core = _spilling_core(tiny_loaded, tmp_path)
    keys = [f"spill-{i}" for i in range(3)]
    answers = {}
    for key, script in zip(keys, scripts):
        core.sessions.open(session_id=key)
        answers[key] = _turn(core, key, script)
    _all_to_files(core)
    checkpoints = core.checkpoints
    assert checkpoints is not None and checkpoints.disk.flush(30)
    stats = checkpoints.disk.stats()
    assert stats.num_spilled == 3 and stats.num_files_written == 3 and synced == [] and directories == []
    written = stats.bytes_written
    assert checkpoints.save_idle(0) == 3 and checkpoints.disk.flush(30)
    stats = checkpoints.disk.stats()
    assert stats.num_files_written == 6 and stats.bytes_written - written < 3 * 8192  # headers, no KV again
    assert len(directories) == 3 and len(synced) == 3 * 2 + 3  # each file (extents, header), and its name
    assert checkpoints.save_idle(0) == 0  # saved: unchanged now
    # Spilled twice without a durable save between: the second append keeps the fsynced header's slot.
    slots: list[bool] = []
    real_save = session_file_save.save
    monkeypatch.setattr(session_file_save, "save", lambda *a, **k: slots.append(k["same_slot"]) or real_save(*a, **k))
    for script in ([7, 8, 9], [10, 11, 12]):
        _turn(core, keys[0], script)
        _all_to_files(core)
        assert checkpoints.disk.flush(30)
    assert slots[-2:] == [False, True]
    assert checkpoints.save_idle(0) == 1 and checkpoints.disk.flush(30)
    checkpoints.disk.close()
    restarted = _restarted(tiny_loaded, tmp_path)
    assert sorted(restarted.sessions.sessions) == keys
    assert all(restarted.sessions.sessions[k].disk is not None for k in keys)
    assert restarted.checkpoints is not None
    restarted.checkpoints.disk.close()


def test_a_shutdown_save_waits_for_a_spill_in_flight_and_keeps_its_kv(tiny_loaded, tmp_path, monkeypatch) -> None:
    """While a spill is being written its session's KV is only in that write: a durable save of it then (at
    shutdown) waits for the write and saves the KV it holds, where saving at once would save token ids only."""
    gate = threading.Event()
    real_save = session_file_save.save

    def held(*args, **kw):  # noqa: ANN002, ANN003
        if not kw["durable"]:
            assert gate.wait(60)
        return real_save(*args, **kw)

    monkeypatch.setattr(session_file_save, "save", held)
    core = _spilling_core(tiny_loaded, tmp_path)
    rng = random.Random(14)
    keys = [f"held-{i}" for i in range(2)]
    for key in keys:
        core.sessions.open(session_id=key)
        _turn(core, key, [rng.randrange(2, 256) for _ in range(40)])
    _all_to_files(core)
    checkpoints = core.checkpoints
    assert checkpoints is not None and checkpoints.disk.stats().num_spilled == 2
    threading.Timer(0.2, gate.set).start()  # the spills' writes end only once the shutdown save has begun
    report = checkpoints.save_all(30)
    assert report.num_saved == 2 and report.num_with_kv == 2
    assert checkpoints.disk.flush(30)
    checkpoints.disk.close()
    restarted = _restarted(tiny_loaded, tmp_path)
    assert all(restarted.sessions.sessions[k].disk is not None for k in keys)  # with their KV, not token ids
    assert restarted.checkpoints is not None
    restarted.checkpoints.disk.close()
