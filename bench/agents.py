"""Agent workload: sessions with resident KV vs the same engine run stateless.

A agents x T turns. Every agent's history starts with one shared system prompt (~500 tokens); each
turn appends ~200 tokens of "tool output" and generates 100 tokens (greedy, EOS ignored); every third
turn is a fan-out (n = 4, sampled) and the agent continues from one of its candidates. An agent sends
its next turn as soon as its previous one finishes, so all agents run concurrently.

  sessions   one session per agent; each turn sends only the new tool output (prefix caching on, so the
             system prompt is computed once for all agents)
  stateless  the full history every turn, prefix caching off (what a server without sessions does)

Both drive the same EngineCore in process; TTFT is submit -> first token of the turn. Reported: TTFT
p50/p99 by turn index, total seconds, generated tok/s, peak KV blocks in use.

    python bench/agents.py                                   # CPU, the default model, 8 agents x 6 turns
    python bench/agents.py --gpu --agents 64 --turns 10      # CUDA, Llama-3-8B shape, random weights
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
    script: list[list[int]]  # tool output of each turn
    turn: int = 0
    history: list[int] = field(default_factory=list)  # stateless: everything so far
    session_id: str | None = None
    parent: int | None = None
    request_id: str | None = None
    submitted: float = 0.0
    got_first: bool = False
    tokens: dict[int, list[int]] = field(default_factory=dict)


def _params(agent: Agent, turn: int, new_tokens: int) -> SamplingParams:
    if turn % 3 == 2:  # every third turn fans out
        return SamplingParams(
            max_tokens=new_tokens, temperature=0.8, seed=1000 * agent.index + turn, n=4, ignore_eos=True
        )
    return SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)


def run(core: EngineCore, system: list[int], scripts: list[list[list[int]]], new_tokens: int, sessions: bool) -> dict:
    agents = [Agent(i, s, history=list(system)) for i, s in enumerate(scripts)]
    ttft: dict[int, list[float]] = {}
    peak = 0
    generated = 0
    by_request: dict[str, Agent] = {}
    reported = 0

    def submit(agent: Agent) -> None:
        turn = agent.turn
        params = _params(agent, turn, new_tokens)
        tool = agent.script[turn]
        if sessions:
            request = core.add_session_turn(agent.session_id, tool, params, parent_candidate=agent.parent)  # type: ignore[arg-type]
        else:
            request = core.add_request(agent.history + tool, params)
        agent.history += tool
        agent.request_id, agent.submitted, agent.got_first, agent.tokens = (
            request.request_id,
            time.perf_counter(),
            False,
            {},
        )
        by_request[request.request_id] = agent

    start = time.perf_counter()
    for agent in agents:
        if sessions:
            session = core.sessions.open()
            session.token_ids = list(system)
            agent.session_id = session.session_id
        submit(agent)
    while core.has_work():
        outputs = core.step()
        now = time.perf_counter()
        peak = max(peak, core.block_manager.num_used_blocks)
        for out in outputs:
            agent = by_request[out.request_id]
            for d in out.candidates:
                agent.tokens.setdefault(d.index, []).extend(d.token_ids)
                generated += len(d.token_ids)
            if not agent.got_first and any(d.token_ids for d in out.candidates):
                agent.got_first = True
                ttft.setdefault(agent.turn, []).append(now - agent.submitted)
            if out.finished:
                del by_request[out.request_id]
                chosen = agent.turn % 4 if len(agent.tokens) > 1 else 0
                agent.history += agent.tokens[chosen]
                agent.parent = chosen if len(agent.tokens) > 1 else None
                agent.turn += 1
                done = min(a.turn for a in agents)
                if done > reported:
                    reported = done
                    log.info("%s: every agent finished turn %d (%.1f s)", "sessions" if sessions else "stateless",
                             done, now - start)  # fmt: skip
                if agent.turn < len(agent.script):
                    submit(agent)
    total = time.perf_counter() - start
    for agent in agents:
        if agent.session_id is not None:
            session = core.sessions.get(agent.session_id)
            if not session.branches:  # the session's history is exactly what the stateless run resends
                assert session.token_ids == agent.history, agent.index
            core.sessions.close(agent.session_id)
    assert core.block_manager.num_used_blocks == 0
    return {
        "total_s": total,
        "tok_s": generated / total,
        "generated": generated,
        "peak_blocks": peak,
        "ttft": {k: {"p50": statistics.median(v), "p99": _pct(v, 0.99)} for k, v in sorted(ttft.items())},
        "final_histories": [len(a.history) for a in agents],
    }


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="CUDA with the Llama-3-8B shape (random weights)")
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system", type=int, default=500)
    parser.add_argument("--tool", type=int, default=200)
    parser.add_argument("--new-tokens", type=int, default=100)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    rng = random.Random(0)
    if args.gpu:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from overlap_gpu import build_hf

        from cbd.model.loader import model_from_hf

        hf = build_hf(32)
        max_len = args.system + args.turns * (args.tool + args.new_tokens + 20) + 64
        loaded = model_from_hf(hf, "cuda", torch.bfloat16, max_positions=max_len + 64)
        del hf
        torch.cuda.empty_cache()
        per_agent = -(-max_len // 16)
        base = dict(device="cuda", dtype="bfloat16", block_size=16, num_kv_blocks=args.agents * 4 * per_agent + 256,
                    max_num_seqs=max(256, 4 * args.agents), max_num_batched_tokens=8192, max_model_len=max_len,
                    cuda_graph_max_batch=256)  # fmt: skip
        vocab = loaded.spec.vocab_size
    else:
        from cbd.model.loader import load_model

        loaded = load_model(None, pack_cpu_gemm=True)
        max_len = args.system + args.turns * (args.tool + args.new_tokens + 20) + 64
        base = dict(num_kv_blocks=args.agents * 4 * (-(-max_len // 8)) + 64, max_model_len=max_len)
        vocab = loaded.spec.vocab_size
    system = [rng.randrange(100, vocab) for _ in range(args.system)]
    scripts = [[[rng.randrange(100, vocab) for _ in range(rng.randrange(args.tool - 20, args.tool + 21))]
                for _ in range(args.turns)] for _ in range(args.agents)]  # fmt: skip
    results = {}
    for name, sessions in (("sessions", True), ("stateless", False)):
        core = EngineCore(loaded, EngineConfig(**base, enable_prefix_caching=sessions))
        core.warm_up()
        results[name] = run(core, system, scripts, args.new_tokens, sessions)
        log.info("%s: total %.1f s, %.1f tok/s, peak blocks %d", name, results[name]["total_s"],
                 results[name]["tok_s"], results[name]["peak_blocks"])  # fmt: skip
        del core
        if args.gpu:
            torch.cuda.empty_cache()
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "agents.json"), "w") as f:
            json.dump(results, f, indent=1)
    s, n = results["sessions"], results["stateless"]
    device = torch.cuda.get_device_name() if args.gpu else "CPU"
    print(f"\n{device}: {args.agents} agents x {args.turns} turns, system {args.system}, tool ~{args.tool}, "
          f"{args.new_tokens} new tokens/turn, fan-out n=4 every third turn")  # fmt: skip
    print(f"{'':12s} {'total s':>8s} {'tok/s':>8s} {'peak KV blocks':>15s}")
    for name, r in results.items():
        print(f"{name:12s} {r['total_s']:8.1f} {r['tok_s']:8.1f} {r['peak_blocks']:15d}")
    print(f"sessions vs stateless throughput: {s['tok_s'] / n['tok_s']:.2f}x")
    print("TTFT ms by turn (p50 / p99):")
    for k in s["ttft"]:
        a, b = s["ttft"][k], n["ttft"][k]
        print(f"  turn {k + 1:2d}: sessions {1000 * a['p50']:8.1f} / {1000 * a['p99']:8.1f}   "
              f"stateless {1000 * b['p50']:8.1f} / {1000 * b['p99']:8.1f}")  # fmt: skip
    last = max(s["ttft"])
    print(f"sessions: turn-{last + 1} TTFT p50 / turn-1 TTFT p50 = {s['ttft'][last]['p50'] / s['ttft'][0]['p50']:.2f}")


if __name__ == "__main__":
    main()
