"""Sessions across a restart: saving at shutdown, listing at start, and the first turn after the restart
(KV read back from the session files) against recomputing the history.

S sessions each hold an H-token history. Engine A (a session directory) prefills them, answers one
greedy token per session on a fork (the oracle of a daemon that never stopped), then saves every
session (`save_all`, the shutdown's saving) and stops. The files' pages are then dropped from the
page cache (posix_fadvise DONTNEED), so the next reads come from the disk. Engine B starts on the same
directory: `restore` lists the sessions. The first half's first turns (U new tokens, one token
generated, one session at a time) come at once: each reads its KV back from disk before it runs
("cold"). The second half is read back first, as an idle daemon does ahead of turns (`prefetch`, into
the host tier), then their first turns run ("read ahead"). Each TTFT (submit -> first token) is set
against the TTFT of the same turn on sessions whose same-length histories have no KV (recompute), in
the same engine and run. The disk's own sequential write (with fsync) and cold read rates are measured
beside.

    python bench/durable_sessions.py                 # CPU, the default model, scaled down
    python bench/durable_sessions.py --gpu           # CUDA, Llama-3-8B shape (random weights)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from cbd.config import EngineConfig
from cbd.engine.core import EngineCore
from cbd.engine.sampling_params import SamplingParams

ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def ttft(core: EngineCore, key: str, tokens: list[int]) -> tuple[float, int, int]:
    """One turn to its first token: (seconds, the token, cached prompt tokens)."""
    start = time.perf_counter()
    request = core.add_session_turn(key, tokens, ONE)
    first = None
    cached = 0
    while core.has_work():
        for out in core.step():
            if out.request_id == request.request_id:
                for d in out.candidates:
                    if d.token_ids and first is None:
                        first = (time.perf_counter() - start, d.token_ids[0])
                if out.finished and out.usage is not None:
                    cached = out.usage.cached_prompt_tokens
    assert first is not None
    return first[0], first[1], cached


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_rates(directory: Path, gib: float) -> tuple[float, float]:
    """The disk's own sequential write (fsync included) and cold read rates, GiB/s."""
    path = directory / "rate.bin"
    chunk = os.urandom(64 * 2**20)
    count = max(1, int(gib * 16))
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(count):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    write = count / 16 / (time.perf_counter() - start)
    drop_cache(path)
    buffer = bytearray(64 * 2**20)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buffer):
            pass
    read = count / 16 / (time.perf_counter() - start)
    path.unlink()
    return write, read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="CUDA with the Llama-3-8B shape (random weights)")
    parser.add_argument("--sessions", type=int)
    parser.add_argument("--history", type=int)
    parser.add_argument("--new", type=int, default=100, help="new tokens of the first turn after the restart")
    parser.add_argument("--dir", help="the session directory (default: a temporary one)")
    args = parser.parse_args()
    if args.sessions is None:
        args.sessions = 24 if args.gpu else 6
    if args.history is None:
        args.history = 8000 if args.gpu else 600
    block = 16 if args.gpu else 8
    max_len = args.history + args.new + 64
    per_session = -(-(args.history + args.new + 8) // block)
    if args.gpu:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from overlap_gpu import loaded_8b

        loaded = loaded_8b(max_len + 64)
        base: dict = dict(device="cuda", dtype="bfloat16", max_num_batched_tokens=8192, max_num_seqs=64)
    else:
        from cbd.model.loader import load_model

        loaded = load_model(None, pack_cpu_gemm=True)
        base = dict(max_num_batched_tokens=2048)
    directory = Path(args.dir or tempfile.mkdtemp(prefix="cbd-sessions-"))
    rng = random.Random(0)
    vocab = loaded.spec.vocab_size
    histories = [[rng.randrange(100, vocab) for _ in range(args.history)] for _ in range(2 * args.sessions)]
    turns = [[rng.randrange(100, vocab) for _ in range(args.new)] for _ in range(2 * args.sessions)]
    # The host tier holds the read-ahead half with a quarter to spare (prefetch leaves a quarter free).
    pools = dict(num_kv_blocks=(2 * args.sessions + 2) * per_session,
                 num_host_kv_blocks=int((args.sessions // 2 + 2) * per_session / 0.7))  # fmt: skip
    config = EngineConfig(**base, **pools, block_size=block, max_model_len=max_len, disk_kv_dir=str(directory))

    a = EngineCore(loaded, config)
    a.warm_up()
    oracle = []
    for i in range(args.sessions):
        key = a.sessions.open(session_id=f"agent-{i}", ttl=float("inf")).session_id
        ttft(a, key, histories[i])  # the history's KV (and one token)
        fork = a.sessions.fork(key).session_id
        oracle.append(ttft(a, fork, turns[i])[1])
        a.sessions.close(fork)
    assert a.checkpoints is not None
    report = a.checkpoints.save_all(3600.0)
    saved_bytes = sum(p.stat().st_size for p in directory.rglob("*.session"))
    a.checkpoints.disk.close()
    del a
    gc.collect()
    if args.gpu:
        torch.cuda.empty_cache()
    for path in directory.rglob("*.session"):
        drop_cache(path)

    b = EngineCore(loaded, EngineConfig(**base, **pools, block_size=block, max_model_len=max_len,
                                        disk_kv_dir=str(directory)))  # fmt: skip
    b.warm_up()
    assert b.checkpoints is not None
    start = time.perf_counter()
    restored = b.checkpoints.restore()
    listing = time.perf_counter() - start
    half = args.sessions // 2
    restored_ttft: dict[str, list[float]] = {"cold": [], "read ahead": []}
    recompute_ttft, same, cached = [], 0, []
    prefetch_seconds = 0.0
    for i in range(args.sessions):
        if i == half:  # the rest are read back ahead of their turns, as an idle daemon does
            start = time.perf_counter()
            while True:
                b.checkpoints.loads.prefetch(lambda key: False)
                b.checkpoints.loads.completed()
                if not b.checkpoints.loads.load_copies() and not any(
                    b.checkpoints.loads.needs_load(f"agent-{k}") for k in range(half, args.sessions)
                ):
                    break
                time.sleep(0.001)
            prefetch_seconds = time.perf_counter() - start
        seconds, token, hit = ttft(b, f"agent-{i}", turns[i])
        restored_ttft["cold" if i < half else "read ahead"].append(seconds)
        same += token == oracle[i]
        cached.append(hit)
        # The same turn on a same-length history without KV (other tokens: no prefix-cache hits).
        j = args.sessions + i
        key = b.sessions.open(session_id=f"recompute-{i}", token_ids=histories[j]).session_id
        recompute_ttft.append(ttft(b, key, turns[j])[0])
        b.sessions.close(key)
    stats = b.stats().disk
    b.checkpoints.disk.close()
    write_rate, read_rate = disk_rates(directory, min(4.0, saved_bytes / 2**30))
    for path in directory.rglob("*.session"):
        path.unlink()
    p50_cold, p50_ahead = (statistics.median(restored_ttft[k]) for k in ("cold", "read ahead"))
    p50_recompute = statistics.median(recompute_ttft)
    result = {
        "device": torch.cuda.get_device_name() if args.gpu else "CPU", "args": vars(args),
        "saved_sessions": report.num_saved, "saved_with_kv": report.num_with_kv, "save_seconds": report.seconds,
        "saved_gib": saved_bytes / 2**30, "listing_seconds": listing, "restored": len(restored),
        "ttft_cold_p50": p50_cold, "ttft_read_ahead_p50": p50_ahead, "ttft_recompute_p50": p50_recompute,
        "ratio_cold": p50_cold / p50_recompute, "ratio_read_ahead": p50_ahead / p50_recompute,
        "read_ahead_seconds": prefetch_seconds, "same_first_tokens": same, "cached_min": min(cached),
        "kv_read_gib": (stats.bytes_read if stats else 0) / 2**30, "kv_read_seconds": stats.load_seconds_sum if stats else 0,
        "disk_write_gib_s": write_rate, "disk_read_gib_s": read_rate,
    }  # fmt: skip
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "durable_sessions.json"), "w") as f:
            json.dump(result, f, indent=1)
    r = result
    print(f"\n{r['device']}: {args.sessions} sessions x {args.history} tokens, first turn +{args.new} tokens")
    print(f"shutdown saving: {r['saved_sessions']} sessions ({r['saved_with_kv']} with KV), {r['saved_gib']:.2f} GiB "
          f"in {r['save_seconds']:.2f} s = {r['saved_gib'] / r['save_seconds']:.2f} GiB/s")  # fmt: skip
    print(f"start: {r['restored']} sessions listed in {1000 * r['listing_seconds']:.1f} ms")
    print(f"first turn TTFT p50: recompute {1000 * p50_recompute:.1f} ms; cold (read on the turn) "
          f"{1000 * p50_cold:.1f} ms = {r['ratio_cold']:.3f}x; read ahead {1000 * p50_ahead:.1f} ms = "
          f"{r['ratio_read_ahead']:.3f}x (the read-ahead of {args.sessions - half} sessions took "
          f"{prefetch_seconds:.2f} s)")  # fmt: skip
    print(f"first tokens equal to the never-stopped engine: {same}/{args.sessions}; cached prompt tokens >= "
          f"{r['cached_min']}")  # fmt: skip
    print(f"KV read back: {r['kv_read_gib']:.2f} GiB in {r['kv_read_seconds']:.2f} s "
          f"= {r['kv_read_gib'] / max(r['kv_read_seconds'], 1e-9):.2f} GiB/s")  # fmt: skip
    print(f"the disk itself: write (fsync) {write_rate:.2f} GiB/s, cold read {read_rate:.2f} GiB/s")


if __name__ == "__main__":
    main()
