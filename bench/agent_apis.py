"""An agent loop through three APIs of one daemon, in one run: cbd's session API (gRPC), the Responses API
with previous_response_id (`cbd openai`), and Chat Completions resending the whole history.

A agents x T turns, all agents at once (each sends its next turn when its last reply ends). Every history
starts with one shared system prompt; each turn appends a tool output (a user message of ~`--tool` tokens)
and generates up to `--new-tokens` tokens (greedy). The ways run one after another on the same daemon and
gateway, each as its own caller (bearer token = tenant), so that no way reuses another's prefix cache:

  grpc          one session per agent (cbd_client.AsyncSession); a turn sends only its new message
  responses     POST /v1/responses, stream, previous_response_id; a turn sends only its new message
  chat-resend   POST /v1/chat/completions, stream, the whole conversation every turn, no session header, and a
                fresh bearer token every turn: nothing of an earlier turn is reused (prefix cache, gateway
                state); through a second gateway that keeps no resent conversation (--max-conversations 0,
                where the gateway has that setting)
  chat-caller   the same resend with one token for every turn: what the daemon's prefix cache (and any reuse
                the gateway makes of a caller's resent conversations) saves a stateless client
  grpc-snapshots  (only when named in --ways) grpc, forking the session into a kept snapshot before each
                continuation as the Responses route does: what that snapshot costs a turn

Reported per way: TTFT p50 over turns 2..T, split by the turn's prompt (history + new input) below / from
`--split` tokens, prompt tokens prefilled per turn (prompt - cached, from usage), generated tokens, wall
time; and the ratios the floors name.

    python bench/agent_apis.py                                      # CPU, the default model, scaled down
    python bench/agent_apis.py --gpu --tokenizer DIR --agents 16 --turns 10 --system 1500 --tool 500 \\
        --new-tokens 64 --split 4096                                # H200, Llama-3-8B shape, random weights
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from agent_apis_ways import Script, Turn, chat_agent, grpc_agent, responses_agent  # noqa: E402

from cbd_client import AsyncClient  # noqa: E402
from daemon_process import DaemonProcess  # noqa: E402
from gateway_process import GatewayProcess  # noqa: E402

WAYS = ("grpc", "responses", "chat-resend", "chat-caller")  # and grpc-snapshots, on demand (--ways)


def scripts(tokenizer_file: Path, args: argparse.Namespace, seed: int) -> tuple[list[Script], int, float]:
    """The agents' scripts (one shared system prompt), its token count and the mean tool output's."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    # Whole lowercase words with a leading space: each is one token, and text of them re-tokenises alike.
    words = sorted(" " + w[1:] for w in tok.get_vocab() if w.startswith("Ġ") and w[1:].isalpha() and w[1:].islower()
                   and len(w) > 3)  # fmt: skip
    rng = random.Random(seed)

    def text(head: str, count: int) -> str:
        return head + "".join(rng.choice(words) for _ in range(count))

    system = text("You are an agent. After each tool output, write a long, detailed analysis of it; never stop "
                  "early. Reference notes:", args.system)  # fmt: skip
    out = [Script(system, [text(f"Tool output {t + 1}:", rng.randrange(args.tool * 9 // 10, args.tool * 11 // 10 + 1))
                           for t in range(args.turns)], args.new_tokens)
           for _ in range(args.agents)]  # fmt: skip
    tool_tokens = statistics.fmean(len(tok.encode(t).ids) for s in out for t in s.tools)
    return out, len(tok.encode(system).ids), tool_tokens


def tokens_file(path: Path, agents: int, turns: int) -> dict[str, str]:
    names = ["grpc", "grpc-snapshots", "responses", "chat", "warm"] + [
        f"resend-a{a}-t{t}" for a in range(agents) for t in range(turns)
    ]
    tokens = {name: secrets.token_hex(16) for name in names}
    path.write_text("".join(f"{name} {token}\n" for name, token in tokens.items()))
    return tokens


async def run_way(way: str, address: str, base: str, work: list[Script], tokens: dict[str, str],
                  prefix: str = "") -> tuple[list[list[Turn]], float]:  # fmt: skip
    """Every agent's turns through one way, all agents at once; and the wall seconds."""
    limits = httpx.Limits(max_connections=len(work) + 4, max_keepalive_connections=len(work) + 4)
    async with (AsyncClient(address, timeout=3600, token=tokens[prefix or (way if way.startswith("grpc") else "grpc")]) as client,
                httpx.AsyncClient(base_url=base, timeout=3600, limits=limits) as http):  # fmt: skip
        start = time.perf_counter()
        if way in ("grpc", "grpc-snapshots"):
            jobs = [grpc_agent(client, s, snapshots=way == "grpc-snapshots") for s in work]
        elif way == "responses":
            jobs = [responses_agent(http, s, tokens[prefix or "responses"]) for s in work]
        elif way == "chat-caller":
            jobs = [chat_agent(http, s, [tokens[prefix or "chat"]] * len(s.tools)) for s in work]
        else:
            jobs = [chat_agent(http, s, [tokens[prefix] if prefix else tokens[f"resend-a{a}-t{t}"]
                                         for t in range(len(s.tools))]) for a, s in enumerate(work)]  # fmt: skip
        turns = await asyncio.gather(*jobs)
        return list(turns), time.perf_counter() - start


def start_gateways(address: str, tmp: Path, started: list[GatewayProcess]) -> tuple[dict[str, str], str]:
    """One gateway with its defaults; for chat-resend a second one that keeps no resent conversation where the
    gateway has that setting (--max-conversations 0). The base URL of each way, and what chat-resend ran on."""
    helps = subprocess.run([sys.executable, "-m", "cbd.cli", "openai", "--help"], capture_output=True, text=True)
    off = ["--max-conversations", "0"] if "--max-conversations" in helps.stdout else []
    for name, extra in (("gateway", []), ("gateway-stateless", off)):
        g = GatewayProcess(
            address, tmp / f"{name}.log", "--state-dir", str(tmp / name), "--log-level", "warning", *extra
        )
        started.append(g)
        g.wait_serving()
    main, stateless = (f"{g.base}/v1" for g in started)
    how = "a gateway with --max-conversations 0" if off else "a gateway without resent-conversation continuation"
    return {"grpc": main, "grpc-snapshots": main, "responses": main, "chat-caller": main, "chat-resend": stateless}, how


def summary(turns: list[list[Turn]], wall: float, split: int) -> dict[str, float | int]:
    later = [t for agent in turns for t in agent[1:]]  # turns 2..T
    short = [t.ttft for t in later if t.prompt_tokens < split]
    long = [t.ttft for t in later if t.prompt_tokens >= split]
    gen = [t.generated for agent in turns for t in agent]
    nan = float("nan")
    return {
        "ttft_p50": statistics.median(t.ttft for t in later), "ttft_p50_short": statistics.median(short) if short else nan,
        "ttft_p50_long": statistics.median(long) if long else nan, "n_short": len(short), "n_long": len(long),
        "prefilled": statistics.fmean(t.prefilled for t in later), "prompt_last": max(a[-1].prompt_tokens for a in turns),
        "generated": sum(gen), "generated_min": min(gen), "wall": wall,
        "turn1_ttft_p50": statistics.median(a[0].ttft for a in turns),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="CUDA, Llama-3-8B shape (random weights; needs --tokenizer)")
    parser.add_argument("--tokenizer", help="a directory with the default model's tokenizer files (--gpu)")
    parser.add_argument("--checkpoint", default="/tmp/cbd-8b-49k")
    parser.add_argument("--kv-cache-gib", type=float, default=40.0)
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--system", type=int, default=300, help="system prompt tokens (shared)")
    parser.add_argument("--tool", type=int, default=120, help="tool output tokens per turn (+-10%%)")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--split", type=int, default=700, help="TTFT split: turns whose prompt is below / from this")
    parser.add_argument("--ways", default=",".join(WAYS))
    args = parser.parse_args()
    ways = args.ways.split(",")
    out = Path(os.environ.get("OUT", "."))
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        tokens = tokens_file(tmp / "tokens", args.agents, args.turns)
        flags = ["--auth-token-file", str(tmp / "tokens")]
        if args.gpu:
            from daemon_gpu import build_checkpoint, engine_settings

            t0 = time.perf_counter()
            build_checkpoint(Path(args.checkpoint), Path(args.tokenizer), 32)
            print(f"checkpoint ready in {time.perf_counter() - t0:.0f} s", flush=True)
            settings = {**engine_settings(Path(args.checkpoint), 64), "kv_cache_gib": args.kv_cache_gib}
            (tmp / "cbd.toml").write_text(
                "[engine]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items())
            )
            flags += ["--config", str(tmp / "cbd.toml")]
            tokenizer_file = Path(args.tokenizer) / "tokenizer.json"
        else:
            from cbd.model.loader import resolve_checkpoint

            tokenizer_file = resolve_checkpoint(None) / "tokenizer.json"
        work, system_tokens, tool_tokens = scripts(tokenizer_file, args, seed=0)
        warm, _, _ = scripts(tokenizer_file, argparse.Namespace(**{**vars(args), "turns": 2, "agents": 2}), seed=1)
        daemon = DaemonProcess(tmp / "cbd.sock", *flags)
        gateways: list[GatewayProcess] = []
        results: dict[str, dict[str, float | int]] = {}
        try:
            daemon.wait_serving(900)
            bases, stateless = start_gateways(daemon.address, tmp, gateways)
            for way in ways:  # a short warm-up of every path, as its own caller
                asyncio.run(run_way(way, daemon.address, bases[way], warm, tokens, prefix="warm"))
            for way in ways:
                turns, wall = asyncio.run(run_way(way, daemon.address, bases[way], work, tokens))
                results[way] = summary(turns, wall, args.split)
                (out / f"agent_apis_{way}.json").write_text(json.dumps([[asdict(t) for t in a] for a in turns]))
                print(f"{way}: {json.dumps(results[way])}", flush=True)
        finally:
            for g in gateways:
                g.stop()
            daemon.stop()
            for log in (daemon.log_path, *(g.log_path for g in gateways)):
                if out.resolve() != Path.cwd().resolve():
                    shutil.copy(log, out / f"agent_apis_{log.name}")
    report(args, results, system_tokens, tool_tokens, stateless)


def report(
    args: argparse.Namespace, results: dict[str, dict[str, float | int]], system: int, tool: float, stateless: str
) -> None:
    where = "GPU (8B shape, random bf16 weights)" if args.gpu else "CPU (default model)"
    print(f"\n{where}: {args.agents} agents x {args.turns} turns, system {system} tokens, tool output ~{tool:.0f} "
          f"tokens/turn, up to {args.new_tokens} greedy tokens/turn; TTFT ms, p50 over turns 2-{args.turns}")  # fmt: skip
    print(f"{'way':14s} {'TTFT p50':>8s} {f'<{args.split}':>9s} {f'>={args.split}':>9s} {'n<,n>=':>7s} "
          f"{'prefilled/turn':>14s} {'last prompt':>11s} {'generated':>9s} {'min/turn':>8s} {'wall s':>7s} {'turn-1 TTFT':>11s}")  # fmt: skip
    for way, r in results.items():
        print(f"{way:14s} {1000 * r['ttft_p50']:8.1f} {1000 * r['ttft_p50_short']:9.1f} {1000 * r['ttft_p50_long']:9.1f} "
              f"{r['n_short']:3d},{r['n_long']:3d} {r['prefilled']:14.1f} {r['prompt_last']:11d} {r['generated']:9d} "
              f"{r['generated_min']:8d} {r['wall']:7.1f} {1000 * r['turn1_ttft_p50']:11.1f}")  # fmt: skip
    print(f"chat-resend: a fresh bearer token every turn, through {stateless}")
    if {"responses", "grpc", "chat-resend"} <= results.keys():
        r, g, s = results["responses"], results["grpc"], results["chat-resend"]
        print(f"responses / grpc TTFT p50 (prompt >= {args.split}): {r['ttft_p50_long'] / g['ttft_p50_long']:.2f} "
              f"(floor <= 1.15); all turns 2+: {r['ttft_p50'] / g['ttft_p50']:.2f}")  # fmt: skip
        print(f"responses / chat-resend TTFT p50 (prompt >= {args.split}): "
              f"{r['ttft_p50_long'] / s['ttft_p50_long']:.2f} (floor <= 0.5); all turns 2+: "
              f"{r['ttft_p50'] / s['ttft_p50']:.2f}")  # fmt: skip
        if "grpc-snapshots" in results:
            k = results["grpc-snapshots"]
            print(f"responses / grpc-snapshots TTFT p50 (prompt >= {args.split}): "
                  f"{r['ttft_p50_long'] / k['ttft_p50_long']:.2f}; grpc-snapshots / grpc: "
                  f"{k['ttft_p50_long'] / g['ttft_p50_long']:.2f}")  # fmt: skip
        print(f"prefilled per turn (turns 2+): responses {r['prefilled']:.1f}, grpc {g['prefilled']:.1f}, "
              f"chat-resend {s['prefilled']:.1f}; tool output ~{tool:.0f} tokens + the reply before it")  # fmt: skip


if __name__ == "__main__":
    main()
