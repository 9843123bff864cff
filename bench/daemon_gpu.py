"""The daemon at full batch on the GPU: streaming Generate through gRPC vs Engine.generate in process.

Llama-3-8B shape (hidden 4096, 32 layers, 32 heads / 8 KV heads, intermediate 14336) with the default
model's vocabulary (49152) and tokenizer, so that detokenisation is real; random bf16 weights, written
once as a checkpoint that both paths load. Workload per batch size B: B prompts of 256 random tokens,
greedy, EOS ignored, N new tokens each. In process: `Engine.generate` on token ids. Daemon: a real
`cbd serve` on a unix socket with the same engine settings (one TOML file), driven by
bench/load_clients.py (P client processes, B concurrent streaming calls). Best of R rounds each.

Columns: tok/s (generated tokens / seconds from submit to last token), ms per engine step (the same
seconds / engine steps taken), and for the daemon at each B: its GPU busy fraction (the engine's own
CUDA-event measure, read from the metrics endpoint during the run) and the CPU time each thread group
of the daemon's processes spent per engine step (from /proc: where the time goes), and the engine thread's
own time per step in each phase of its loop (its `cbd_engine_step_phase_seconds` histograms' sums).
`--before DIR` also runs a daemon from another source tree (DIR/daemon, DIR/client) for comparison.
`--daemon-cpus LIST` (e.g. 0-3,8-11) runs every thread of the daemon's two processes on those CPUs and the
client processes on the others, as when the clients are other hosts: by default they share every CPU
with the daemon, and at a small model's step length the daemon's threads then run slower.

    python bench/daemon_gpu.py --tokenizer DIR [--batches 32,128,256] [--new-tokens 512,384,256]
                               [--client-processes 8] [--rounds 2] [--before DIR] [--daemon-cpus LIST]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import pyspy_summary  # noqa: E402
from load_clients import Call, run  # noqa: E402

from cbd.config import EngineConfig  # noqa: E402
from cbd.engine.engine import Engine  # noqa: E402
from cbd.engine.sampling_params import SamplingParams  # noqa: E402
from cbd_client import Client  # noqa: E402
from cbd_client.address import free_port  # noqa: E402
from daemon_process import DaemonProcess  # noqa: E402

OUT = Path(os.environ.get("OUT", "."))
ALLOWED_CPUS = os.sched_getaffinity(0)  # before --daemon-cpus narrows this process to the clients' CPUs
SHAPES = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=49152, max_position_embeddings=8192, rope_theta=500000.0,
               tie_word_embeddings=False),
    # Llama-3.2-1B's shape (its vocabulary replaced by the default model's, as for the 8B shape)
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=49152, max_position_embeddings=8192, rope_theta=500000.0,
               tie_word_embeddings=True),
}  # fmt: skip


def build_checkpoint(directory: Path, tokenizer_dir: Path, shape: str, layers: int | None) -> None:
    if (directory / "config.json").exists():
        return
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    dims = dict(SHAPES[shape])
    if layers is not None:
        dims["num_hidden_layers"] = layers
    config = LlamaConfig(**dims, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, torch_dtype="bfloat16")  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = LlamaForCausalLM(config)
        finally:
            torch.set_default_dtype(prev)
    tmp = directory.with_suffix(".tmp")
    model.save_pretrained(tmp, max_shard_size="8GB")
    tok.save_pretrained(tmp)
    del model
    torch.cuda.empty_cache()
    tmp.rename(directory)


def engine_settings(checkpoint: Path, max_batch: int) -> dict[str, object]:
    return {
        "model": str(checkpoint), "device": "cuda", "dtype": "bfloat16", "kv_cache_gib": 24.0,
        "max_num_seqs": max_batch, "cuda_graph_max_batch": max_batch,
    }  # fmt: skip


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(length)] for _ in range(count)]


def in_process(engine: Engine, batch: list[list[int]], new_tokens: int) -> dict[str, float]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    busy: list[float] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.5):
            b = engine.stats().gpu_busy
            if b is not None:
                busy.append(b)

    sampler = threading.Thread(target=sample)
    steps0 = engine.stats().num_steps
    sampler.start()
    start = time.perf_counter()
    results = engine.generate(batch, params)
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    tokens = sum(len(r.candidates[0].token_ids) for r in results)
    steps = engine.stats().num_steps - steps0
    return {"tok_s": tokens / seconds, "ms_step": 1000 * seconds / steps, "busy": _median(busy[1:] or busy)}


@torch.inference_mode()
def gpu_only_step(engine: Engine, batch: int, context: int, reps: int = 50) -> float:
    """ms per decode step on the GPU alone: the engine's captured graph for `batch` sequences of `context`
    tokens (distinct KV blocks each) replayed back to back with the greedy pick of each row, no host work
    between steps (no scheduling, packing, streaming)."""
    graphs = engine.core.runner.graphs
    assert graphs is not None and graphs.stream is not None, "needs CUDA graphs"
    key = graphs.bucket(batch, batch, 1)
    assert key is not None, f"no graph for batch {batch}"
    bs = graphs.block_size
    per_seq = -(-context // bs)
    blocks = engine.core.runner.scratch_block  # blocks in the pool (the scratch block is the last)
    device = graphs.ids.device
    tables = (torch.arange(key[0] * per_seq, device=device) % blocks).view(key[0], per_seq)
    ids = torch.randint(100, 49000, (key[0],), device=device)
    ctx = torch.full((key[0],), context, dtype=torch.int64, device=device)
    graph, logits = graphs.graphs[key]
    with torch.cuda.stream(graphs.stream):
        graphs.load(key[0], key[1], ids, ctx, tables)
        for _ in range(3):
            graph.replay()
            logits.argmax(-1)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
            logits.argmax(-1)
        end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _threads(pid: int) -> dict[tuple[int, str], float]:
    """CPU seconds by (pid, thread name) of a process and its children."""
    tick = os.sysconf("SC_CLK_TCK")
    pids = [pid, *_children(pid)]
    cpu: dict[tuple[int, str], float] = defaultdict(float)
    for p in pids:
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                stat = (task / "stat").read_text()
                name = (task / "comm").read_text().strip()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            cpu[(p, _group(name))] += (int(fields[11]) + int(fields[12])) / tick
    return cpu


def _group(thread: str) -> str:
    for prefix in ("grpc", "pt_", "cbd-engine", "ZMQ", "python", "asyncio", "Thread", "cuda"):
        if thread.startswith(prefix):
            return prefix.rstrip("_")
    return thread


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def profile(label: str, pids: dict[str, int], seconds: float, rate: int = 200) -> list[str]:
    """A py-spy GIL window of each process, summarised (see pyspy_summary.py)."""
    lines = []
    for role, pid in pids.items():
        path = OUT / f"pyspy_{label}_{role}.txt"
        proc = pyspy_summary.record(pid, seconds, rate, path)
        _, err = proc.communicate(timeout=seconds + 60)
        lines.append(f"{label} {role} (pid {pid}):")
        if proc.returncode != 0:
            lines.append(f"  py-spy failed: {err.decode().strip().splitlines()[-1:]}")
        lines.extend(pyspy_summary.summarise(path, seconds, rate))
    return lines


def through_daemon(
    d: DaemonProcess, metrics_port: int, batch: list[list[int]], new_tokens: int, processes: int,
    profile_label: str | None = None, stream_interval: int = 1,
) -> dict[str, object]:  # fmt: skip
    busy: list[float] = []
    done = threading.Event()
    profiled: list[str] = []

    def profile_soon() -> None:
        if done.wait(3.0) or profile_label is None:  # into the decode phase
            return
        pids = {"frontend": d.process.pid}
        pids.update({f"engine{i}": p for i, p in enumerate(_children(d.process.pid))})
        profiled.extend(profile(profile_label, pids, 3.0))

    def sample() -> None:
        while not done.wait(0.5):
            try:
                text = _metrics(metrics_port)
            except OSError:
                continue
            for line in text.splitlines():
                if line.startswith("cbd_gpu_idle_ratio "):
                    busy.append(1.0 - float(line.split()[1]))

    with Client(d.address, timeout=60) as client:
        steps0 = client.stats().num_steps
        phases0 = _phase_seconds(metrics_port)
        cpu0 = _threads(d.process.pid)
        sampler = threading.Thread(target=sample)
        sampler.start()
        profiler = threading.Thread(target=profile_soon)
        profiler.start()
        result = run(d.address, [Call(p, new_tokens, stream_interval=stream_interval) for p in batch], processes)
        done.set()
        sampler.join()
        profiler.join()
        cpu1 = _threads(d.process.pid)
        steps = client.stats().num_steps - steps0
        phases1 = _phase_seconds(metrics_port)
    if result.errors:
        raise RuntimeError(f"{len(result.errors)} calls failed, e.g. {result.errors[0]}")
    roles = {d.process.pid: "frontend"}
    cpu = {f"{roles.get(pid, 'engine')}:{name}": round(1000 * (v - cpu0.get((pid, name), 0.0)) / steps, 3)
           for (pid, name), v in cpu1.items() if v - cpu0.get((pid, name), 0.0) > 0.01}  # fmt: skip
    return {
        "tok_s": result.tokens / result.seconds, "ms_step": 1000 * result.seconds / steps,
        "busy": _median(busy[1:] or busy), "messages": result.messages, "cpu_ms_per_step": cpu,
        "phase_ms_per_step": {k: round(1000 * (v - phases0.get(k, 0.0)) / steps, 3) for k, v in phases1.items()},
        "profile": profiled,
    }  # fmt: skip


def _metrics(port: int) -> str:
    return str(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode())


def _phase_seconds(port: int) -> dict[str, float]:
    """The engine thread's seconds so far in each step phase (`cbd_engine_step_phase_seconds`'s sums)."""
    sums = {}
    for line in _metrics(port).splitlines():
        if line.startswith("cbd_engine_step_phase_seconds_sum{"):
            sums[line.split('phase="', 1)[1].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
    return sums


def _children(pid: int) -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _ppid(int(p.name)) == pid]


def _start_gateway(address: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "cbd.cli", "openai", "--daemon", address, "--listen",
                             f"127.0.0.1:{port}", "--log-level", "warning"])  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                break
        except OSError:
            time.sleep(0.2)
    return proc, f"http://127.0.0.1:{port}/v1"


def cpu_list(text: str) -> set[int]:
    """CPUs written as taskset writes them: 0-3,8,10-11."""
    cpus: set[int] = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of a process and of its children (not theirs: no tensor parallelism here) onto cpus;
    threads started later inherit it."""
    for p in [pid, *_children(pid)]:
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                os.sched_setaffinity(int(task.name), cpus)
            except OSError:
                pass  # a thread that has just ended


def daemon_runs(
    label: str,
    config_file: Path,
    workloads: list[tuple[int, int, list[list[int]]]],
    args: argparse.Namespace,
    env: dict[str, str] | None,
) -> dict[int, dict[str, object]]:
    port = free_port()
    intervals = [int(k) for k in args.stream_intervals.split(",") if k and int(k) != 1]
    with tempfile.TemporaryDirectory() as tmp:
        d = DaemonProcess(Path(tmp) / "cbd.sock", "--config", str(config_file), "--metrics-port", str(port), env=env)
        try:
            d.wait_serving(900)
            if args.daemon_cpus:  # the daemon on its CPUs; this process (and the clients it starts) on the rest
                mine = cpu_list(args.daemon_cpus)
                theirs = ALLOWED_CPUS - mine
                if not theirs or not mine <= ALLOWED_CPUS:
                    raise SystemExit(f"--daemon-cpus {args.daemon_cpus}: not a part of this process's CPUs")
                pin(d.process.pid, mine)
                os.sched_setaffinity(0, theirs)
            run(d.address, [Call(workloads[0][2][0], 8)], 1)  # warm-up
            best: dict[int, dict[str, object]] = {}
            gateway = _start_gateway(d.address) if args.gateway and label == "daemon" else None
            for b, n, batch in workloads:
                if gateway is not None:
                    for _ in range(args.rounds):
                        g = run(gateway[1], [Call(p, n) for p in batch], args.client_processes)
                        print(f"gateway B={b}: {g.tokens / g.seconds:.0f} tok/s ({len(g.errors)} errors)", flush=True)
                        best.setdefault(-b, {"tok_s": 0.0})
                        best[-b]["tok_s"] = max(best[-b]["tok_s"], g.tokens / g.seconds)  # type: ignore[type-var]
                for _ in range(args.rounds):
                    r = through_daemon(d, port, batch, n, args.client_processes)
                    print(f"{label} B={b}: {r['tok_s']:.0f} tok/s, {r['ms_step']:.2f} ms/step", flush=True)
                    if b not in best or r["tok_s"] > best[b]["tok_s"]:  # type: ignore[operator]
                        best[b] = r
                if args.profile and b == args.profile_batch:  # one more round, profiled, not counted
                    r = through_daemon(d, port, batch, n, args.client_processes, label)
                    print(f"{label} B={b} profiled: {r['tok_s']:.0f} tok/s, {r['ms_step']:.2f} ms/step", flush=True)
                    best[b]["profile"] = r["profile"]
                for k in intervals:  # the same calls, k tokens per stream message
                    for _ in range(args.rounds):
                        r = through_daemon(d, port, batch, n, args.client_processes, stream_interval=k)
                        print(f"{label} B={b} interval {k}: {r['tok_s']:.0f} tok/s, {r['ms_step']:.2f} ms/step, "
                              f"{r['messages']} messages", flush=True)  # fmt: skip
                        kept = best[b].setdefault("intervals", {})  # type: ignore[union-attr]
                        if k not in kept or r["tok_s"] > kept[k]["tok_s"]:
                            kept[k] = r
            if gateway is not None:
                gateway[0].terminate()
                gateway[0].wait(30)
        finally:
            d.stop()
            shutil.copy(d.log_path, OUT / f"daemon_{label}.log")
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True, help="a directory with the default model's tokenizer files")
    parser.add_argument("--checkpoint", default="/tmp/cbd-8b-49k")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--layers", type=int, help="instead of the shape's own number of layers")
    parser.add_argument("--batches", default="32,128,256")
    parser.add_argument("--new-tokens", default="512,384,256")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--client-processes", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--profile", action="store_true", help="py-spy the daemon in an extra round at --profile-batch")
    parser.add_argument("--profile-batch", type=int, default=128)
    parser.add_argument("--skip-in-process", action="store_true")
    parser.add_argument("--gateway", action="store_true", help="also drive the daemon through `cbd openai`")
    parser.add_argument("--before", help="also run a daemon from this source tree (DIR/daemon, DIR/client)")
    parser.add_argument("--stream-intervals", default="", help="also run the daemon's calls with these stream_interval")
    parser.add_argument("--daemon-cpus", default="", help="the daemon's CPUs (e.g. 0-3); the clients get the others")
    args = parser.parse_args()
    checkpoint = Path(args.checkpoint)
    t0 = time.perf_counter()
    build_checkpoint(checkpoint, Path(args.tokenizer), args.shape, args.layers)
    print(f"checkpoint ready in {time.perf_counter() - t0:.0f}s", flush=True)
    batches = [int(x) for x in args.batches.split(",")]
    news = [int(x) for x in args.new_tokens.split(",")]
    workloads = [(b, n, prompts(b, args.prompt_len, seed=b)) for b, n in zip(batches, news)]
    settings = engine_settings(checkpoint, max(batches))
    config_file = OUT / "daemon_gpu.toml"
    config_file.write_text("[engine]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items()))

    local: dict[int, dict[str, float]] = {}
    if not args.skip_in_process:
        local = in_process_runs(settings, workloads, args)
    remote = daemon_runs("daemon", config_file, workloads, args, None)
    before = None
    if args.before:
        others = [
            p for p in os.environ.get("PYTHONPATH", "").split(":") if p and not p.endswith(("/daemon", "/client"))
        ]
        path = ":".join([f"{args.before}/daemon", f"{args.before}/client", *others])
        before = daemon_runs("before", config_file, workloads, args, {"PYTHONPATH": path})
    report(args, workloads, local, remote, before)


def in_process_runs(
    settings: dict[str, object], workloads: list[tuple[int, int, list[list[int]]]], args: argparse.Namespace
) -> dict[int, dict[str, float]]:
    engine = Engine(EngineConfig.from_dict(settings))
    engine.generate([workloads[0][2][0]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    local: dict[int, dict[str, float]] = {}
    for b, n, batch in workloads:
        gpu_ms = gpu_only_step(engine, b, args.prompt_len + n // 2)  # the run's mean context
        print(f"GPU only B={b}: {gpu_ms:.2f} ms/step, {1000 * b / gpu_ms:.0f} tok/s", flush=True)
        for _ in range(args.rounds):
            r = in_process(engine, batch, n)
            r["gpu_ms"] = gpu_ms
            print(f"in-process B={b}: {r['tok_s']:.0f} tok/s, {r['ms_step']:.2f} ms/step", flush=True)
            if b not in local or r["tok_s"] > local[b]["tok_s"]:
                local[b] = r
    engine.shutdown()
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return local


def report(
    args: argparse.Namespace, workloads: list[tuple[int, int, list[list[int]]]], local: dict[int, dict[str, float]],
    remote: dict[int, dict[str, object]], before: dict[int, dict[str, object]] | None,
) -> None:  # fmt: skip
    (OUT / "daemon_gpu.json").write_text(json.dumps({"local": local, "daemon": remote, "before": before}, indent=1))
    layers = f", {args.layers} layers" if args.layers else ""
    print(f"\n{torch.cuda.get_device_name()}, {args.shape.upper()} shape{layers}, vocab 49152, prompt {args.prompt_len}, "
          f"greedy, {args.client_processes} client processes, best of {args.rounds}")  # fmt: skip
    head = f"{'B':>4} {'new':>4} {'in-proc tok/s':>13} {'daemon tok/s':>12} {'ratio':>6} {'ms/step in/daemon':>18} {'busy':>5}"
    print(head + (f" {'before tok/s':>12} {'ratio':>6}" if before else ""))
    for b, n, _ in workloads:
        if -b in remote:
            g = remote[-b]["tok_s"]
            print(f"{b:4d} {n:4d} gateway (cbd openai, HTTP + SSE): {g:.0f} tok/s = {g / remote[b]['tok_s']:.2f}x the "  # type: ignore[operator]
                  f"daemon's gRPC figure")  # fmt: skip
        if b not in local:
            local[b] = {"tok_s": float("nan"), "ms_step": float("nan")}
        lo, re_ = local[b], remote[b]
        line = (f"{b:4d} {n:4d} {lo['tok_s']:13.0f} {re_['tok_s']:12.0f} {re_['tok_s'] / lo['tok_s']:6.2f} "  # type: ignore[operator]
                f"{lo['ms_step']:8.2f} / {re_['ms_step']:6.2f} {re_['busy']:5.3f}")  # fmt: skip
        if before:
            line += f" {before[b]['tok_s']:12.0f} {before[b]['tok_s'] / lo['tok_s']:6.2f}"  # type: ignore[operator]
        print(line)
    print(f"{'B':>4} {'GPU-only ms/step':>16} {'GPU-only tok/s':>14} {'daemon / GPU-only':>17} "
          f"{'host CPU us/seq/step: engine process':>36} {'frontend':>8}")  # fmt: skip
    for b, _, _ in workloads:
        gpu_ms = local.get(b, {}).get("gpu_ms", float("nan"))
        cpu: dict[str, float] = remote[b]["cpu_ms_per_step"]  # type: ignore[assignment]
        engine_ms = sum(v for k, v in cpu.items() if k.startswith("engine:"))
        frontend_ms = sum(v for k, v in cpu.items() if k.startswith("frontend:"))
        print(f"{b:4d} {gpu_ms:16.2f} {1000 * b / gpu_ms:14.0f} {remote[b]['tok_s'] / (1000 * b / gpu_ms):17.2f} "  # type: ignore[operator]
              f"{1000 * engine_ms / b:36.1f} {1000 * frontend_ms / b:8.1f}")  # fmt: skip
    for label, runs in (("this tree", remote), ("before", before or {})):  # the same calls with a stream interval
        for b, _, _ in workloads:
            gpu_ms = local.get(b, {}).get("gpu_ms", float("nan"))
            for k, r in runs.get(b, {}).get("intervals", {}).items():  # type: ignore[union-attr]  # records are loose dicts
                cpu = r["cpu_ms_per_step"]
                engine_ms = sum(v for key, v in cpu.items() if key.startswith("engine:"))
                frontend_ms = sum(v for key, v in cpu.items() if key.startswith("frontend:"))
                print(f"{label} {b:4d} stream_interval {k:3d}: {r['tok_s']:.0f} tok/s, {r['ms_step']:.2f} ms/step, "
                      f"daemon / GPU-only {r['tok_s'] / (1000 * b / gpu_ms):.2f}, host CPU us/seq/step engine "
                      f"{1000 * engine_ms / b:.1f} frontend {1000 * frontend_ms / b:.1f}, {r['messages']} messages "
                      f"(interval 1: {runs[b]['messages']})")  # fmt: skip
    for label, runs in (("daemon", remote), ("before", before or {})):
        for b, r in runs.items():
            if b < 0:
                continue
            print(f"{label} B={b} CPU ms per engine step: {r['cpu_ms_per_step']}")
            print(f"{label} B={b} engine thread ms per step by phase: {r['phase_ms_per_step']}")
            for line in r["profile"]:  # type: ignore[attr-defined]
                print(line)


if __name__ == "__main__":
    main()
