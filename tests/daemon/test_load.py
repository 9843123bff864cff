"""The bounded load generator (bench/load.py) against a daemon whose pool and admission caps are tight.

A short run of the same generator that measures the daemon on the default model: 100 clients, plain
requests, fan-outs and sessions, count- and time-limited. Only RESOURCE_EXHAUSTED (retried after
the daemon's hint) may come back; afterwards no block, request or session is left.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from load import parse_args, run  # noqa: E402


def test_bounded_load_ends_by_itself_with_no_errors_and_no_leaked_blocks(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    args = parse_args([
        "--clients", "100", "--requests", "400", "--duration", "12", "--grace", "60", "--ramp", "1",
        "--sample-every", "1", "--call-timeout", "120",
        "--daemon-args", f"--model {tiny_checkpoint('llama')} --num-kv-blocks 160 --max-queued-requests 40",
    ])  # fmt: skip
    report = run(args)
    summary = report.summary()
    assert report.errors == {}, summary
    assert report.refusals > 0 and report.preemptions > 0, summary  # the caps and the pool were really hit
    assert report.requests_completed > 50 and report.jobs_completed > 20, summary
    assert report.leaked_blocks == 0 and set(report.leftover.values()) == {0}, summary
    assert report.clients_cancelled_at_limit == 0, summary
    assert len(report.samples) >= 5 and summary["ttft_p99_s"] is not None
