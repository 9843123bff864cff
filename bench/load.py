"""Load and soak: many concurrent streaming clients against a daemon, bounded in count and time.

Each simulated client has its own channel and runs jobs back to back until the request budget is
spent or the time is up (then it stops by itself; calls still running at the hard limit are cancelled
and reported as such). Jobs, drawn at random:

- plain (60%): one request, prompt length mixed (about 16 / 64 / 256 / 1024 tokens), 8-64 new tokens;
- fan-out (20%): n = 2-4 sampled candidates from one prompt of 32-256 tokens;
- session (20%): an agent loop: open a session on a shared system prompt, 2-4 turns of 16-64 new
  tokens each, one turn a fan-out whose candidate is chosen, then close;
- tools (`--tool-weight`, 0 by default): a chat request with one function tool, the call required.

Prompts are chat messages of random words when the model has a chat template, token ids otherwise.
RESOURCE_EXHAUSTED is the one expected error: the client waits the daemon's retry hint and retries
(each refusal is counted). Every few seconds a sampler records the daemon's RSS and KV blocks in use.
At the end, once the daemon is idle, blocks still in use are leaked blocks (must be 0).

    python bench/load.py                          # 500 clients, 2,000 requests or 300 s, default model
    python bench/load.py --duration 660 --requests 1000000 --json soak.json     # a soak run
    python bench/load.py --address unix:/run/cbd/cbd.sock --pid $(pidof cbd)     # an already running daemon
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from cbd_client import AsyncClient, CbdError

WORDS = [
    "agent",
    "tool",
    "call",
    "result",
    "plan",
    "step",
    "file",
    "test",
    "error",
    "retry",
    "cache",
    "token",
    "model",
    "batch",
    "queue",
    "stream",
    "search",
    "index",
    "graph",
    "node",
    "edge",
    "value",
    "score",
    "branch",
    "merge",
    "commit",
    "build",
    "deploy",
    "check",
    "report",
    "summary",
]

TOOLS = [{
    "name": "lookup", "description": "Look a word up",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
}]  # fmt: skip


@dataclass
class Sample:
    t: float
    rss_mib: float | None
    kv_blocks_used: int
    running: int
    waiting: int
    live_requests: int
    open_sessions: int
    completed: int


@dataclass
class LoadReport:
    clients: int
    duration_s: float
    requests_completed: int = 0  # Generate calls that ended with every candidate finished
    clients_cancelled_at_limit: int = 0
    given_up_at_time_limit: int = 0  # refused calls whose retry would have come after --duration
    jobs_completed: int = 0
    tokens_generated: int = 0
    refusals: int = 0  # RESOURCE_EXHAUSTED answers (retried after the hint)
    errors: dict[str, int] = field(default_factory=dict)  # unexpected statuses
    error_examples: dict[str, str] = field(default_factory=dict)  # the first message of each
    ttft_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    leaked_blocks: int | None = None
    leftover: dict[str, int] = field(default_factory=dict)
    kv_blocks_total: int = 0
    preemptions: int = 0

    def summary(self) -> dict[str, object]:
        def pct(values: list[float], q: float) -> float | None:
            return round(statistics.quantiles(values, n=100, method="inclusive")[q - 1], 3) if len(values) > 1 else None

        rss = [s.rss_mib for s in self.samples if s.rss_mib is not None]
        quarter = max(1, len(rss) // 4)
        return {
            "clients": self.clients,
            "duration_s": round(self.duration_s, 1),
            "requests_completed": self.requests_completed,
            "requests_per_s": round(self.requests_completed / self.duration_s, 2),
            "tokens_per_s": round(self.tokens_generated / self.duration_s, 1),
            "jobs_completed": self.jobs_completed,
            "ttft_p50_s": pct(self.ttft_s, 50), "ttft_p99_s": pct(self.ttft_s, 99),
            "e2e_p50_s": pct(self.e2e_s, 50), "e2e_p99_s": pct(self.e2e_s, 99),
            "refusals_resource_exhausted": self.refusals,
            "unexpected_errors": self.errors,
            "unexpected_error_examples": self.error_examples,
            "refused_calls_not_retried_after_the_time_limit": self.given_up_at_time_limit,
            "clients_cancelled_at_time_limit": self.clients_cancelled_at_limit,
            "leaked_blocks": self.leaked_blocks,
            "leftover_after_idle": self.leftover,
            "kv_blocks_total": self.kv_blocks_total,
            "kv_blocks_used_max": max((s.kv_blocks_used for s in self.samples), default=None),
            "preemptions": self.preemptions,
            "rss_mib_first_quarter_mean": round(statistics.fmean(rss[:quarter]), 1) if rss else None,
            "rss_mib_last_quarter_mean": round(statistics.fmean(rss[-quarter:]), 1) if rss else None,
            "rss_mib_max": round(max(rss), 1) if rss else None,
        }  # fmt: skip


def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class Workload:
    """Draws prompts and jobs; chat messages of words for a chat model, token ids otherwise."""

    def __init__(self, rng: random.Random, chat: bool, vocab: int, context: int) -> None:
        self.rng, self.chat, self.vocab = rng, chat, vocab
        self.max_prompt = max(16, context - 128)  # room for the template and the new tokens
        self.system = self.text(128) if chat else [self.rng.randrange(2, vocab) for _ in range(128)]

    def text(self, tokens: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(max(1, tokens)))  # ~1 token per word

    def prompt(self, tokens: int) -> object:
        if self.chat:
            return [{"role": "user", "content": self.text(tokens)}]
        return [self.rng.randrange(2, self.vocab) for _ in range(tokens)]

    def plain_length(self) -> int:
        length = self.rng.choices([16, 64, 256, 1024], weights=[4, 3, 2, 1])[0] + self.rng.randrange(-8, 9)
        return min(length, self.max_prompt)


class LoadGenerator:
    def __init__(self, address: str, args: argparse.Namespace, pid: int | None) -> None:
        self.address, self.args, self.pid = address, args, pid
        self.report = LoadReport(clients=args.clients, duration_s=0.0)
        self.started = 0  # Generate calls started (the count limit)
        self.stop_at = 0.0

    def budget_left(self) -> bool:
        return self.started < self.args.requests and time.monotonic() < self.stop_at

    def error(self, name: str, details: str = "") -> None:
        self.report.errors[name] = self.report.errors.get(name, 0) + 1
        self.report.error_examples.setdefault(name, details[:200])

    async def call(self, make_stream, n: int) -> str | None:  # type: ignore[no-untyped-def]
        """One Generate call, retried after the hint on RESOURCE_EXHAUSTED; returns the error's status or None.
        TTFT and end-to-end time are measured from the submission that was accepted."""
        self.started += 1
        while True:
            begin = time.monotonic()
            first = None
            finished = 0
            try:
                async for delta in make_stream():
                    if delta.token_ids and first is None:
                        first = time.monotonic() - begin
                    self.report.tokens_generated += len(delta.token_ids)
                    finished += delta.finish_reason is not None
            except CbdError as e:
                if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and first is None:
                    self.report.refusals += 1
                    if time.monotonic() + (e.retry_after or 1.0) >= self.stop_at:
                        self.report.given_up_at_time_limit += 1  # the run is over: do not come back
                        return "given up"
                    await asyncio.sleep(e.retry_after or 1.0)
                    continue
                self.error(e.code.name, e.details)
                return e.code.name
            if finished != n:  # a stream that ended without every candidate's finish is a lost request
                self.error("incomplete stream")
                return "incomplete stream"
            self.report.requests_completed += 1
            self.report.e2e_s.append(time.monotonic() - begin)
            if first is not None:
                self.report.ttft_s.append(first)
            return None

    async def client(self, index: int) -> None:
        rng = random.Random(self.args.seed * 100_003 + index)
        async with AsyncClient(self.address, timeout=self.args.call_timeout) as client:
            info = await client.model_info()
            work = Workload(rng, info.has_chat_template, info.vocab_size, info.context_length)
            await asyncio.sleep(rng.random() * self.args.ramp)  # spread the start
            while self.budget_left():
                kind = rng.choices(["plain", "fanout", "session", "tools"], weights=[6, 2, 2, self.args.tool_weight])[0]
                if kind == "plain":
                    prompt = work.prompt(work.plain_length())
                    kw = {"max_tokens": rng.randrange(8, 65), "temperature": 0.7, "seed": rng.randrange(1 << 30)}
                    await self.call(lambda prompt=prompt, kw=kw: client.stream(prompt, **kw), 1)
                elif kind == "fanout":
                    prompt = work.prompt(rng.randrange(32, 257))
                    kw = {"n": rng.randrange(2, 5), "max_tokens": rng.randrange(16, 33), "temperature": 0.9}
                    await self.call(lambda prompt=prompt, kw=kw: client.stream(prompt, **kw), kw["n"])
                elif kind == "tools" and work.chat:
                    prompt = work.prompt(rng.randrange(16, 129))
                    kw = {"max_tokens": 48, "tools": TOOLS, "tool_choice": "required", "temperature": 0.7}
                    await self.call(lambda prompt=prompt, kw=kw: client.stream(prompt, **kw), 1)
                else:
                    await self.session_job(client, work, rng)
                self.report.jobs_completed += 1

    async def session_job(self, client: AsyncClient, work: Workload, rng: random.Random) -> None:
        prefix = [{"role": "system", "content": work.system}] if work.chat else work.system
        while True:
            try:
                session = await client.session(prefix, ttl=self.args.session_ttl)
                break
            except CbdError as e:
                if e.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    self.error(e.code.name)
                    return
                self.report.refusals += 1
                await asyncio.sleep(e.retry_after or 1.0)
        try:
            turns = rng.randrange(2, 5)
            fan_turn = rng.randrange(turns)
            for turn in range(turns):
                if not self.budget_left():
                    break
                prompt = work.prompt(rng.randrange(16, 65))
                n = 3 if turn == fan_turn else 1
                kw = {"n": n, "max_tokens": rng.randrange(16, 33), "temperature": 0.8}
                error = await self.call(lambda prompt=prompt, kw=kw: session.stream(prompt, **kw), n)
                if error is not None:
                    break
                if n > 1:
                    session.choose(rng.randrange(n))
        finally:
            try:
                await session.close()
            except CbdError as e:
                self.error(f"close:{e.code.name}")

    async def sampler(self, client: AsyncClient) -> None:
        start = time.monotonic()
        while True:
            stats = await client.stats()
            self.report.samples.append(Sample(
                round(time.monotonic() - start, 1), rss_mib(self.pid), stats.kv_blocks_used, stats.running,
                stats.waiting, stats.live_requests, stats.open_sessions, self.report.requests_completed,
            ))  # fmt: skip
            if self.args.verbose:
                s = self.report.samples[-1]
                print(f"t={s.t:6.1f}s rss={s.rss_mib} kv={s.kv_blocks_used} run={s.running} wait={s.waiting} "
                      f"live={s.live_requests} sessions={s.open_sessions} done={s.completed}", file=sys.stderr)  # fmt: skip
            await asyncio.sleep(self.args.sample_every)

    async def run(self) -> LoadReport:
        async with AsyncClient(self.address, timeout=30) as control:
            await control.wait_ready(600)
            begin = time.monotonic()
            self.stop_at = begin + self.args.duration
            sampler = asyncio.ensure_future(self.sampler(control))
            tasks = [asyncio.ensure_future(self.client(i)) for i in range(self.args.clients)]
            done, pending = await asyncio.wait(tasks, timeout=self.args.duration + self.args.grace)
            for task in pending:  # the hard limit: cancel what is still running
                task.cancel()
            self.report.clients_cancelled_at_limit = len(pending)
            await asyncio.gather(*tasks, return_exceptions=True)
            for task in done:
                if task.exception() is not None:
                    self.error(f"client:{type(task.exception()).__name__}: {task.exception()}")
            self.report.duration_s = time.monotonic() - begin
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
            await self.wait_idle(control)
        return self.report

    async def wait_idle(self, control: AsyncClient) -> None:
        deadline = time.monotonic() + 60
        while True:
            stats = await control.stats()
            busy = stats.running + stats.waiting + stats.live_requests + stats.open_sessions
            if busy == 0 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        self.report.samples.append(Sample(round(time.monotonic() - self.stop_at + self.args.duration, 1),
                                          rss_mib(self.pid), stats.kv_blocks_used, stats.running, stats.waiting,
                                          stats.live_requests, stats.open_sessions,
                                          self.report.requests_completed))  # fmt: skip
        self.report.leaked_blocks = stats.kv_blocks_used
        self.report.leftover = {"running": stats.running, "waiting": stats.waiting, "live_requests": stats.live_requests,
                                    "open_sessions": stats.open_sessions}  # fmt: skip
        self.report.kv_blocks_total = stats.kv_blocks_total
        self.report.preemptions = stats.num_preemptions


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=500)
    parser.add_argument("--requests", type=int, default=2000, help="Generate calls to start at most")
    parser.add_argument("--duration", type=float, default=300.0, help="seconds after which no job starts")
    parser.add_argument("--grace", type=float, default=300.0, help="seconds after --duration before cancelling")
    parser.add_argument("--ramp", type=float, default=5.0, help="clients start spread over this many seconds")
    parser.add_argument("--call-timeout", type=float, default=600.0)
    parser.add_argument("--session-ttl", type=float, default=600.0, help="idle TTL of the agents' sessions")
    parser.add_argument("--sample-every", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--tool-weight", type=float, default=0.0, help="weight of tool-call jobs (plain is 6)")
    parser.add_argument("--address", help="a running daemon (default: start one on the default model)")
    parser.add_argument("--pid", type=int, help="the running daemon's pid, for its RSS")
    parser.add_argument("--daemon-args", default="", help="extra `cbd serve` flags for the daemon started here")
    parser.add_argument("--json", help="write the summary and the samples here")
    parser.add_argument("--verbose", action="store_true", help="print each sample")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> LoadReport:
    if args.address:
        return asyncio.run(LoadGenerator(args.address, args, args.pid).run())
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from daemon_process import DaemonProcess

    with tempfile.TemporaryDirectory() as tmp:
        daemon = DaemonProcess(Path(tmp) / "cbd.sock", *args.daemon_args.split())
        try:
            daemon.wait_serving(600)
            report = asyncio.run(LoadGenerator(daemon.address, args, daemon.process.pid).run())
            if daemon.process.poll() is not None:
                report.errors["daemon exited"] = 1
        finally:
            daemon.stop()
    return report


def main() -> None:
    args = parse_args()
    report = run(args)
    summary = report.summary()
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "samples": [asdict(s) for s in report.samples]},
                                              indent=1))  # fmt: skip
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
