"""The daemon's host time per sequence per step with and without a stream interval (CPU).

A real `cbd serve` on a model too small to matter (bench/host_cost_cpu.py's 1-layer Llama, hidden size
64, the default model's vocabulary and tokenizer, so detokenisation is real), so that what each daemon
process spends per engine step is mostly its own per-sequence work. Per batch size B: B streaming
Generate calls at once (bench/load_clients.py, P client processes), prompts of --prompt-len random
tokens, greedy, EOS ignored, --new-tokens each, every call with the same `stream_interval` k. Each
interval runs in turn within a round (the same daemon, rounds alternate), best of --rounds by tok/s.
Reported per (B, k): tok/s, each daemon process's CPU time (from /proc, over the engine steps the daemon
counted) per sequence per step, and the stream messages the clients read. The engine process's figure
includes the forward (on the CPU it runs in the engine thread; the 49152-wide output layer dominates it);
the frontend's is the part the stream interval changes (bench/host_cost_cpu.py has the engine's own).

    python bench/stream_interval_cpu.py [--batches 64,256] [--intervals 1,4,8,16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from host_cost_cpu import build_checkpoint  # noqa: E402
from load_clients import Call, run  # noqa: E402

from cbd_client import Client  # noqa: E402
from daemon_process import DaemonProcess, cpu_seconds  # noqa: E402


def one_run(d: DaemonProcess, engine: int, prompts: list[list[int]], new_tokens: int, k: int, procs: int) -> dict:
    with Client(d.address, timeout=60) as client:
        steps0 = client.stats().num_steps
        cpu0 = cpu_seconds(d.process.pid), cpu_seconds(engine)
        result = run(d.address, [Call(p, new_tokens, stream_interval=k) for p in prompts], procs)
        cpu1 = cpu_seconds(d.process.pid), cpu_seconds(engine)
        steps = client.stats().num_steps - steps0
    if result.errors:
        raise RuntimeError(f"{len(result.errors)} calls failed, e.g. {result.errors[0]}")
    b = len(prompts)
    return {
        "tok_s": result.tokens / result.seconds, "messages": result.messages, "tokens": result.tokens,
        "frontend_us": 1e6 * (cpu1[0] - cpu0[0]) / steps / b, "engine_us": 1e6 * (cpu1[1] - cpu0[1]) / steps / b,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--intervals", default="1,4,8,16")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--client-processes", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    batches = [int(x) for x in args.batches.split(",")]
    intervals = [int(x) for x in args.intervals.split(",")]
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "tiny"
        build_checkpoint(checkpoint)
        top = max(batches)
        blocks = top * -(-(args.prompt_len + args.new_tokens) // 16) + 64
        d = DaemonProcess(
            Path(tmp) / "cbd.sock", "--model", str(checkpoint), "--dtype", "float32", "--num-threads", "1",
            "--num-kv-blocks", str(blocks), "--max-num-seqs", str(top), "--max-num-batched-tokens", str(max(2048, top)),
            "--max-queued-requests", str(4 * top), "--enable-prefix-caching", "false",
        )  # fmt: skip
        best: dict[tuple[int, int], dict] = {}
        try:
            d.wait_serving()
            engine = d.engine_pid()
            for _ in range(args.rounds):
                for b in batches:
                    prompts = [[rng.randrange(100, 49000) for _ in range(args.prompt_len)] for _ in range(b)]
                    for k in intervals:
                        r = one_run(d, engine, prompts, args.new_tokens, k, args.client_processes)
                        print(f"B={b} k={k}: {r['tok_s']:.0f} tok/s, frontend {r['frontend_us']:.1f} "
                              f"engine {r['engine_us']:.1f} us/seq/step, {r['messages']} messages", flush=True)  # fmt: skip
                        if (b, k) not in best or r["tok_s"] > best[(b, k)]["tok_s"]:
                            best[(b, k)] = r
        finally:
            d.stop()
    print(f"\n{args.new_tokens} greedy tokens per stream, prompt {args.prompt_len}, 1-layer hidden-64 model, "
          f"{args.client_processes} client processes, best of {args.rounds} (by tok/s)")  # fmt: skip
    print(
        f"{'B':>4} {'k':>3} {'tok/s':>8} {'x k=1':>6} {'frontend us/seq/step':>20} {'engine (with forward)':>21} {'messages':>9}"
    )
    for b in batches:
        base = best[(b, intervals[0])]["tok_s"]
        for k in intervals:
            r = best[(b, k)]
            print(f"{b:4d} {k:3d} {r['tok_s']:8.0f} {r['tok_s'] / base:6.2f} {r['frontend_us']:20.1f} "
                  f"{r['engine_us']:21.1f} {r['messages']:9d}")  # fmt: skip


if __name__ == "__main__":
    main()
