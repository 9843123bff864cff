"""Sessions that outlive GPU memory: recompute eviction vs the host KV tier vs a GPU pool that fits all.

A agents, each with a long history (a shared system prompt plus its own ~H tokens), take T turns:
a turn appends ~U tokens of tool output and generates G tokens (greedy, EOS ignored), then the agent
"runs a tool" for a random 1-5 s (it says so: `expected_idle`) before its next turn. The sessions'
KV together is several times the GPU pool of the first two modes:

  recompute  GPU pool of P blocks, no host tier: an idle session's KV is released under pressure
             and its next turn recomputes the history (what cbd did before the host tier)
  host       the same GPU pool plus a host tier that holds every session: offload and restore
  disk       the same GPU pool, a host tier of the same size, and session files under it: the GPU and
             host pools together hold 2/RATIO of the sessions (at 3: the sessions are 1.5x them); what
             the full host tier lets go is spilled to disk and read back for the session's next turn
             (on the disk tier's reader thread while the batch goes on, the turn waiting, as in the
             daemon's engine thread); the files in a temporary directory on the machine's own disk
  host-small the disk mode's GPU pool and host tier without the disk (what the disk adds)
  ideal      a GPU pool that holds every session (the upper bound)

The modes asked for (--modes) drive the same EngineCore in process, one after another in this run. Reported: TTFT
(submit -> first token) p50/p99 overall and by turn, generated tok/s over the run's wall time,
prompt tokens computed, blocks offloaded/restored; then the restore bandwidth of the engine's own
copier (a batch of blocks host -> GPU, timed on the device) beside a plain pinned host -> device copy.

    python bench/kv_tiers.py                      # CPU, the default model, scaled down
    python bench/kv_tiers.py --gpu                # CUDA, Llama-3-8B shape (random weights), the issue's shape
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cbd.config import EngineConfig
from cbd.engine.core import EngineCore
from cbd.engine.sampling_params import SamplingParams

log = logging.getLogger("bench")


@dataclass
class Agent:
    index: int
    first: list[int]  # its own start of history (after the shared system prompt)
    tools: list[list[int]]  # tool output of each turn
    gaps: list[float]  # seconds of "tool" after each turn
    session_id: str = ""
    turn: int = 0
    ready_at: float = 0.0
    request_id: str | None = None
    submitted: float = 0.0
    got_first: bool = False
    answers: list[list[int]] = field(default_factory=list)


def run(core: EngineCore, system: list[int], agents: list[Agent], new_tokens: int, label: str) -> dict:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    ttft: dict[int, list[float]] = {}
    by_request: dict[str, Agent] = {}
    generated = 0
    for agent in agents:  # agents arrive spread over the first tool gap, as they would
        agent.turn, agent.answers, agent.ready_at = 0, [], agent.index * agent.gaps[-1] / len(agents)
        session = core.sessions.open(token_ids=system + agent.first)
        agent.session_id = session.session_id
    start = time.perf_counter()
    pending = list(agents)  # agents waiting for their tool
    loading: dict[str, Agent] = {}  # agents whose turn waits for its session's KV read back from its file
    checkpoints = core.checkpoints
    prompt_tokens = cached_tokens = 0
    recomputed = 0  # turns after the first that computed more than half of their agent's own history again

    def submit(agent: Agent) -> None:
        gap = agent.gaps[agent.turn]
        request = core.add_session_turn(agent.session_id, agent.tools[agent.turn], params, expected_idle=gap)
        agent.request_id, agent.got_first = request.request_id, False
        agent.answers.append([])
        by_request[request.request_id] = agent

    while pending or loading or core.has_work():
        now = time.perf_counter() - start
        for agent in [a for a in pending if a.ready_at <= now]:
            pending.remove(agent)
            agent.submitted = time.perf_counter()
            # As the daemon's engine thread does (engine_loop.py): a turn whose session's KV is in its file
            # waits for it to be read back on the disk tier's reader thread while the batch goes on.
            if checkpoints is not None and checkpoints.loads.needs_load(agent.session_id):
                checkpoints.loads.start_load(agent.session_id)
                loading[agent.session_id] = agent
            else:
                submit(agent)
        if checkpoints is not None:
            for key in checkpoints.loads.completed():
                if key in loading:  # else read back ahead of its turn
                    submit(loading.pop(key))
            checkpoints.loads.prefetch(lambda key: key in loading)  # as engine_loop.py does each turn of its loop
        if not core.has_work():
            if loading:
                time.sleep(0.001)
            else:
                time.sleep(max(0.0, min(a.ready_at for a in pending) - (time.perf_counter() - start)))
            continue
        outputs = core.step()
        stamp = time.perf_counter()
        for out in outputs:
            agent = by_request[out.request_id]
            for d in out.candidates:
                agent.answers[-1].extend(d.token_ids)
                generated += len(d.token_ids)
            if not agent.got_first and any(d.token_ids for d in out.candidates):
                agent.got_first = True
                ttft.setdefault(agent.turn, []).append(stamp - agent.submitted)
            if out.finished:
                assert out.usage is not None
                prompt_tokens += out.usage.prompt_tokens
                cached_tokens += out.usage.cached_prompt_tokens
                computed = out.usage.prompt_tokens - out.usage.cached_prompt_tokens
                recomputed += agent.turn > 0 and computed > len(agent.first) // 2
                del by_request[out.request_id]
                agent.ready_at = stamp - start + agent.gaps[agent.turn]
                agent.turn += 1
                if agent.turn < len(agent.tools):
                    pending.append(agent)
    total = time.perf_counter() - start
    while core.has_work():
        core.step()
    for agent in agents:
        core.sessions.close(agent.session_id)
    assert core.block_manager.num_used_blocks == 0
    host = core.stats().host
    every = [t for v in ttft.values() for t in v]
    warm = [t for k, v in ttft.items() if k > 0 for t in v]  # turns after the first (which is cold in every mode)
    result = {
        "mode": label,
        "total_s": total,
        "tok_s": generated / total,
        "ttft_p50": statistics.median(every),
        "ttft_p99": _pct(every, 0.99),
        "warm_ttft_p50": statistics.median(warm) if warm else float("nan"),
        "warm_ttft_p99": _pct(warm, 0.99) if warm else float("nan"),
        "ttft_by_turn": {k: {"p50": statistics.median(v), "p99": _pct(v, 0.99)} for k, v in sorted(ttft.items())},
        "prompt_tokens": prompt_tokens,
        "computed_prompt_tokens": prompt_tokens - cached_tokens,
        "recomputed_turns": recomputed,
        "offloaded_blocks": host.num_offloaded_blocks if host else 0,
        "restored_blocks": host.num_restored_blocks if host else 0,
        "spilled_sessions": core.stats().disk.num_spilled if core.stats().disk else 0,
        "read_ahead": checkpoints.loads.num_read_ahead if checkpoints is not None else 0,
        "kv_read_gib": core.stats().disk.bytes_read / 2**30 if core.stats().disk else 0.0,
        "files_written_gib": core.stats().disk.bytes_written / 2**30 if core.stats().disk else 0.0,
        "session_evictions": core.sessions.eviction.num_evictions,
        "preemptions": core.scheduler.num_preemptions,
        "answers": [a.answers for a in agents],
    }
    log.info("%s: %.1f s, %.1f tok/s, TTFT p50 %.1f ms p99 %.1f ms, computed %d of %d prompt tokens", label, total,
             result["tok_s"], 1000 * result["ttft_p50"], 1000 * result["ttft_p99"],
             result["computed_prompt_tokens"], prompt_tokens)  # fmt: skip
    return result


def restore_bandwidth(core: EngineCore, blocks: int) -> dict:
    """GB/s of the engine's copier restoring `blocks` blocks (host -> GPU, scattered GPU ids), and of one
    plain pinned host -> device copy of the same bytes, both timed with CUDA events."""
    assert core.host_tier is not None and torch.cuda.is_available()
    copier = core.host_tier.copier
    blocks = min(blocks, copier.host.shape[0], core.block_manager.num_blocks)
    gpu_ids = random.Random(0).sample(range(core.block_manager.num_blocks), blocks)
    host_ids = list(range(blocks))
    nbytes = blocks * copier.bytes_per_block
    results = {}
    for name in ("copier", "plain"):
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if name == "copier":
                copier.is_done(copier.restore(host_ids, gpu_ids), block=True)
            else:
                dst = torch.empty(copier.host[:blocks].shape, dtype=copier.host.dtype, device="cuda")
                dst.copy_(copier.host[:blocks], non_blocking=True)
                torch.cuda.synchronize()
                del dst
            best = min(best, time.perf_counter() - t0)
        results[name] = nbytes / best / 1e9
    copier.drain_latencies()
    return {"blocks": blocks, "bytes": nbytes, "copier_gb_s": results["copier"], "plain_gb_s": results["plain"]}


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="CUDA with the Llama-3-8B shape (random weights)")
    parser.add_argument("--agents", type=int)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system", type=int, default=1000, help="shared system prompt tokens")
    parser.add_argument("--history", type=int, help="each agent's own history tokens before its first turn")
    parser.add_argument("--tool", type=int, help="tool output tokens per turn (about)")
    parser.add_argument("--new-tokens", type=int, help="generated tokens per turn")
    parser.add_argument("--gap", type=float, nargs=2, help="tool time range in seconds")
    parser.add_argument("--ratio", type=float, default=3.0, help="sessions' KV / GPU pool of the first two modes")
    parser.add_argument("--modes", default="recompute,host,ideal")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.gpu:  # ~8K-token histories, +300 / 100 tokens per turn, 1-5 s tools. 40 agents: their KV (43 GiB at
        # the 8B shape) must fit the ideal mode's GPU pool and the host tier in pinned host memory (64 agents'
        # 68 GiB could not be pinned on a 125 GiB H200 host).
        defaults = dict(agents=40, history=7000, tool=300, new_tokens=100, gap=(1.0, 5.0))
    else:
        defaults = dict(agents=12, history=300, tool=40, new_tokens=16, gap=(3.0, 6.0))
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    rng = random.Random(0)
    block = 16 if args.gpu else 8
    max_len = args.system + args.history + args.turns * (args.tool + 20 + args.new_tokens) + 64
    if args.gpu:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from overlap_gpu import loaded_8b

        loaded = loaded_8b(max_len + 64)
        base: dict = dict(device="cuda", dtype="bfloat16", max_num_seqs=256, max_num_batched_tokens=8192,
                          cuda_graph_max_batch=256)  # fmt: skip
    else:
        from cbd.model.loader import load_model

        loaded = load_model(None, pack_cpu_gemm=True)
        base = dict(max_num_batched_tokens=2048)
    vocab = loaded.spec.vocab_size
    system = [rng.randrange(100, vocab) for _ in range(args.system)]
    agents = [
        Agent(
            i, [rng.randrange(100, vocab) for _ in range(args.history)],
            [[rng.randrange(100, vocab) for _ in range(rng.randrange(args.tool - 20, args.tool + 21))]
             for _ in range(args.turns)],
            [rng.uniform(*args.gap) for _ in range(args.turns)],
        )
        for i in range(args.agents)
    ]  # fmt: skip
    # Blocks every session holds at its longest (the shared system prompt once), and the pools.
    per_agent = -(-(args.history + args.turns * (args.tool + 20 + args.new_tokens)) // block) + 1
    all_sessions = -(-args.system // block) + args.agents * per_agent
    small = max(int(all_sessions / args.ratio), 2 * per_agent + 64)
    pools = {
        "recompute": dict(num_kv_blocks=small, num_host_kv_blocks=0),
        "host": dict(num_kv_blocks=small, num_host_kv_blocks=all_sessions + 64),
        "ideal": dict(num_kv_blocks=all_sessions + 256, num_host_kv_blocks=0),
        "disk": dict(num_kv_blocks=small, num_host_kv_blocks=small),
        "host-small": dict(num_kv_blocks=small, num_host_kv_blocks=small),  # the disk mode's pools, no disk
    }
    bytes_per_block = None
    results: dict[str, dict] = {}
    bandwidth = None
    for mode in args.modes.split(","):
        disk = dict(disk_kv_dir=tempfile.mkdtemp(prefix="cbd-kv-tiers-"), disk_kv_spill=True) if mode == "disk" else {}
        config = EngineConfig(**base, **pools[mode], **disk, block_size=block, max_model_len=max_len)
        core = EngineCore(loaded, config)
        core.warm_up()
        bytes_per_block = core.runner.kv_bytes_per_block(loaded.model, block)
        results[mode] = run(core, system, agents, args.new_tokens, mode)
        if mode == "host" and args.gpu:
            bandwidth = restore_bandwidth(core, 2048)
        if core.checkpoints is not None:
            core.checkpoints.disk.close()
            shutil.rmtree(disk["disk_kv_dir"])
        del core
        if args.gpu:
            torch.cuda.empty_cache()
    answers = {mode: r.pop("answers") for mode, r in results.items()}
    same = len({json.dumps(a) for a in answers.values()}) == 1
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "kv_tiers.json"), "w") as f:
            json.dump({"args": vars(args), "pools": pools, "bandwidth": bandwidth, "results": results}, f, indent=1)
    device = torch.cuda.get_device_name() if args.gpu else "CPU"
    gib = (bytes_per_block or 0) / 2**30
    print(f"\n{device}: {args.agents} agents x {args.turns} turns, history {args.system}+{args.history}, "
          f"tool ~{args.tool}, {args.new_tokens} new tokens, tool gap {args.gap[0]}-{args.gap[1]} s")  # fmt: skip
    print(f"sessions' KV {all_sessions} blocks ({all_sessions * gib:.1f} GiB) = {all_sessions / small:.1f}x the "
          f"GPU pool of recompute/host ({small} blocks); greedy answers equal across modes: {same}")  # fmt: skip
    print("TTFT in ms; '2+': the turns after each agent's first (the first computes the whole history in every mode)")
    print("'recomp': turns after the first that computed more than half of their agent's own history again")
    print(f"{'mode':10s} {'tok/s':>8s} {'p50':>8s} {'p99':>8s} {'2+ p50':>8s} {'2+ p99':>8s} {'computed':>9s} "
          f"{'recomp':>7s} {'offload':>8s} {'restore':>8s} {'preempt':>8s}")  # fmt: skip
    for mode, r in results.items():
        print(f"{mode:10s} {r['tok_s']:8.1f} {1000 * r['ttft_p50']:8.1f} {1000 * r['ttft_p99']:8.1f} "
              f"{1000 * r['warm_ttft_p50']:8.1f} {1000 * r['warm_ttft_p99']:8.1f} {r['computed_prompt_tokens']:9d} "
              f"{r['recomputed_turns']:7d} {r['offloaded_blocks']:8d} {r['restored_blocks']:8d} "
              f"{r['preemptions']:8d}")  # fmt: skip
    if "recompute" in results and "host" in results:
        rc, h = results["recompute"], results["host"]
        print(f"host vs recompute: TTFT p50 {h['ttft_p50'] / rc['ttft_p50']:.2f}x, turns 2+ "
              f"{h['warm_ttft_p50'] / rc['warm_ttft_p50']:.2f}x (floor <= 0.5); throughput "
              f"{h['tok_s'] / rc['tok_s']:.2f}x (floor >= 1.5)")  # fmt: skip
    print("TTFT p50 ms by turn: " + "  ".join(
        f"{mode} " + "/".join(f"{1000 * v['p50']:.0f}" for v in r["ttft_by_turn"].values()) for mode, r in results.items()
    ))  # fmt: skip
    if "recompute" in results and "host-small" in results:
        print(
            f"host-small vs recompute: TTFT p50 {results['host-small']['ttft_p50'] / results['recompute']['ttft_p50']:.2f}x"
        )
    if "recompute" in results and "disk" in results:
        rc, d = results["recompute"], results["disk"]
        print(f"disk vs recompute (sessions {all_sessions / (2 * small):.1f}x the GPU + host pools): TTFT p50 "
              f"{d['ttft_p50'] / rc['ttft_p50']:.2f}x, turns 2+ {d['warm_ttft_p50'] / rc['warm_ttft_p50']:.2f}x; "
              f"{d['spilled_sessions']} spills, {d['files_written_gib']:.2f} GiB written, {d['kv_read_gib']:.2f} GiB "
              f"read back ({d['read_ahead']} sessions read ahead of their turns)")  # fmt: skip
    if bandwidth:
        print(f"restore bandwidth: {bandwidth['copier_gb_s']:.1f} GB/s (engine copier, {bandwidth['blocks']} scattered "
              f"blocks; floor 20) vs plain pinned host->device copy {bandwidth['plain_gb_s']:.1f} GB/s")  # fmt: skip


if __name__ == "__main__":
    main()
