"""Interactive agents beside an evaluation sweep: priorities vs first-come-first-served.

Interactive load: A agents in sessions (the bench/agents.py shape): each turn appends ~U tokens of
tool output and generates G tokens (greedy), and the next turn follows at once; an agent starts a
new session after T turns. Batch load: an evaluation loop that keeps K requests in flight, each a
fan-out of n candidates of L tokens (sampled), the next submitted as one finishes.

Four modes, each a window of W seconds on the same EngineCore (in process), one after another:
  interactive alone    the agents on an otherwise idle engine
  batch alone          the sweep alone
  priorities           both; the agents interactive, the sweep `priority=batch`
  fcfs                 both, no priorities (what cbd did before): first come, first served
Reported: the agents' TTFT p50 / p99 (submit -> first token) and turns done, and the sweep's
generated tokens per second, per mode; the floors are priorities' TTFT p50 <= 1.5x interactive alone
and its batch throughput >= 0.8x batch alone.

    python bench/priorities.py                    # CPU, the default model, scaled down
    python bench/priorities.py --gpu              # CUDA, Llama-3-8B shape (random weights)
    python bench/priorities.py --gpu --attention-backend triton   # without FlashAttention-4 (auto picks it)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from cbd.config import EngineConfig
from cbd.engine.core import EngineCore
from cbd.engine.sampling_params import PRIORITY_BATCH, SamplingParams

log = logging.getLogger("bench")


def window(core: EngineCore, args: argparse.Namespace, vocab: int, agents: bool, batch: bool, prio: bool) -> dict:
    rng = random.Random(1)
    system = [rng.randrange(100, vocab) for _ in range(args.system)]
    turn_params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    sweep_params = SamplingParams(
        max_tokens=args.batch_tokens, temperature=0.8, n=args.n, ignore_eos=True,
        priority=PRIORITY_BATCH if prio else None, tenant="sweep",
    )  # fmt: skip
    owner: dict[str, tuple[str, int]] = {}  # request id -> ("agent", index) | ("sweep", 0)
    submitted: dict[str, float] = {}
    first_seen: set[str] = set()
    ttft: list[float] = []
    turns_done = 0
    sweep_tokens = 0
    sessions = [""] * args.agents
    turns = [0] * args.agents

    def next_turn(i: int) -> None:
        if turns[i] % args.turns == 0:
            if sessions[i]:
                core.sessions.close(sessions[i])
            sessions[i] = core.sessions.open(token_ids=list(system)).session_id
        tool = [rng.randrange(100, vocab) for _ in range(rng.randrange(args.tool - 20, args.tool + 21))]
        request = core.add_session_turn(sessions[i], tool, turn_params)
        owner[request.request_id], submitted[request.request_id] = ("agent", i), time.perf_counter()
        turns[i] += 1

    def next_sweep() -> None:
        prompt = [rng.randrange(100, vocab) for _ in range(args.batch_prompt)]
        owner[core.add_request(prompt, sweep_params).request_id] = ("sweep", 0)

    preempted = core.scheduler.num_preemptions, core.scheduler.num_priority_preemptions
    if agents:
        for i in range(args.agents):
            next_turn(i)
    if batch:
        for _ in range(args.inflight):
            next_sweep()
    start = time.perf_counter()
    end = start + args.window
    while time.perf_counter() < end:
        outputs = core.step()
        now = time.perf_counter()
        for out in outputs:
            kind, i = owner[out.request_id]
            if kind == "sweep":
                sweep_tokens += sum(len(d.token_ids) for d in out.candidates)
                if out.finished:
                    next_sweep()
                continue
            if out.request_id not in first_seen and any(d.token_ids for d in out.candidates):
                first_seen.add(out.request_id)
                ttft.append(now - submitted[out.request_id])
            if out.finished:
                turns_done += 1
                next_turn(i)
    elapsed = time.perf_counter() - start
    for request_id in list(core.requests):
        core.abort_request(request_id)
    while core.has_work():
        core.step()
    for sid in sessions:
        if sid:
            core.sessions.close(sid)
    return {
        "ttft_p50": statistics.median(ttft) if ttft else None,
        "ttft_p99": sorted(ttft)[min(len(ttft) - 1, int(0.99 * len(ttft)))] if ttft else None,
        "turns": turns_done,
        "batch_tok_s": sweep_tokens / elapsed,
        "preemptions": core.scheduler.num_preemptions - preempted[0],
        "priority_preemptions": core.scheduler.num_priority_preemptions - preempted[1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="CUDA with the Llama-3-8B shape (random weights)")
    parser.add_argument("--window", type=float, help="seconds per mode")
    parser.add_argument("--agents", type=int)
    parser.add_argument("--turns", type=int, default=6, help="turns per session before an agent starts afresh")
    parser.add_argument("--system", type=int, default=500)
    parser.add_argument("--tool", type=int)
    parser.add_argument("--new-tokens", type=int)
    parser.add_argument("--inflight", type=int, help="sweep requests kept in flight")
    parser.add_argument("--n", type=int)
    parser.add_argument("--batch-prompt", type=int, default=256)
    parser.add_argument("--batch-tokens", type=int)
    parser.add_argument("--attention-backend", default="auto", help="auto | triton | flash | torch")
    parser.add_argument("--fused-swiglu", default="auto", help="auto | on | off (the MLP's fused SwiGLU GEMM)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.gpu:
        defaults = dict(window=30.0, agents=16, tool=200, new_tokens=100, inflight=32, n=8, batch_tokens=512)
    else:
        defaults = dict(window=30.0, agents=2, tool=40, new_tokens=16, inflight=4, n=4, batch_tokens=64)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    max_len = args.system + args.turns * (args.tool + 20 + args.new_tokens) + 64
    if args.gpu:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from overlap_gpu import loaded_8b

        loaded = loaded_8b(max_len + 64)
        config = EngineConfig(device="cuda", dtype="bfloat16", block_size=16, kv_cache_gib=40.0, max_num_seqs=256,
                              max_num_batched_tokens=8192, max_model_len=max_len, cuda_graph_max_batch=256,
                              host_kv_gib=0, attention_backend=args.attention_backend,
                              fused_swiglu=args.fused_swiglu)  # fmt: skip
    else:
        from cbd.model.loader import load_model

        loaded = load_model(None, pack_cpu_gemm=True)
        config = EngineConfig(max_model_len=max_len, max_num_seqs=16, num_kv_blocks=4096, host_kv_gib=0)
    core = EngineCore(loaded, config)
    core.warm_up()
    vocab = loaded.spec.vocab_size
    modes = {
        "interactive alone": (True, False, True),
        "batch alone": (False, True, True),
        "priorities": (True, True, True),
        "fcfs": (True, True, False),
    }
    results = {}
    for name, (agents, batch, prio) in modes.items():
        results[name] = window(core, args, vocab, agents, batch, prio)
        log.info("%s: %s", name, results[name])
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "priorities.json"), "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    device = torch.cuda.get_device_name() if args.gpu else "CPU"
    print(f"\n{device}: {args.agents} agents (tool ~{args.tool}, {args.new_tokens} new tokens per turn) beside a sweep "
          f"of {args.inflight} x n={args.n} x {args.batch_tokens} tokens; {args.window:.0f} s per mode")  # fmt: skip
    print(
        f"{'mode':18s} {'TTFT p50 ms':>12s} {'p99 ms':>9s} {'turns':>6s} {'batch tok/s':>12s} {'preempt (prio)':>15s}"
    )
    for name, r in results.items():
        p50 = f"{1000 * r['ttft_p50']:.1f}" if r["ttft_p50"] is not None else "-"
        p99 = f"{1000 * r['ttft_p99']:.1f}" if r["ttft_p99"] is not None else "-"
        print(f"{name:18s} {p50:>12s} {p99:>9s} {r['turns']:6d} {r['batch_tok_s']:12.1f} "
              f"{r['preemptions']:>7d} ({r['priority_preemptions']})")  # fmt: skip
    idle, alone, prio_r, fcfs = (results[k] for k in modes)
    print(f"priorities: TTFT p50 {prio_r['ttft_p50'] / idle['ttft_p50']:.2f}x idle (floor <= 1.5; fcfs "
          f"{fcfs['ttft_p50'] / idle['ttft_p50']:.2f}x), batch throughput {prio_r['batch_tok_s'] / alone['batch_tok_s']:.2f}x "
          f"alone (floor >= 0.8; fcfs {fcfs['batch_tok_s'] / alone['batch_tok_s']:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
