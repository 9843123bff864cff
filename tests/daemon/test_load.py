"""The bounded load generator (bench/load.py) against a daemon whose pool and admission caps are tight.

A short run of the same generator that measures the daemon on the default model: 100 clients, plain
requests, fan-outs and sessions, ended by its request count (its time limit is only a bound on how long
the test may take). Only RESOURCE_EXHAUSTED (retried after the daemon's hint) may come back; every call
started is answered whole; afterwards no block, request or session is left. How fast is bench/'s job.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from load import parse_args, run  # noqa: E402

REQUESTS = 150


def test_bounded_load_ends_by_itself_with_no_errors_and_no_leaked_blocks(tiny_checkpoint: Callable[..., Path]) -> None:
    args = parse_args([
        "--clients", "100", "--requests", str(REQUESTS), "--duration", "600", "--grace", "60", "--ramp", "1",
        "--sample-every", "1", "--call-timeout", "120",
        "--daemon-args", f"--model {tiny_checkpoint('llama')} --num-kv-blocks 160 --max-queued-requests 40",
    ])  # fmt: skip
    report = run(args)
    summary = report.summary()
    assert report.errors == {}, summary
    assert report.refusals > 0 and report.preemptions > 0, summary  # the caps and the pool were really hit
    # Ended by its count, not its time limit: every call started was answered with every candidate finished.
    assert report.requests_completed == REQUESTS and report.given_up_at_time_limit == 0, summary
    assert report.leaked_blocks == 0 and set(report.leftover.values()) == {0}, summary
    assert report.clients_cancelled_at_limit == 0, summary
    assert len(report.samples) >= 2 and summary["ttft_p99_s"] is not None  # sampled while running, and idle after
