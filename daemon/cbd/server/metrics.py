"""Prometheus metrics: request counters and latencies from the servicer, engine gauges read at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from cbd.engine.outputs import EngineStats, RequestOutput

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats | None], live: Callable[[], int]) -> None:
        self._stats, self._live = stats, live

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self._stats()
        if s is None:
            return
        for name, value, doc in (
            ("cbd_running_sequences", s.num_running, "Sequences (candidates) being computed."),
            ("cbd_waiting_sequences", s.num_waiting, "Sequences waiting to be admitted."),
            ("cbd_live_requests", self._live(), "Requests submitted and not yet finished."),
            ("cbd_kv_blocks_total", s.num_blocks, "KV blocks in the pool."),
            ("cbd_kv_blocks_used", s.num_blocks_used, "KV blocks held by live sequences."),
            ("cbd_kv_blocks_cached", s.num_blocks_cached, "Free KV blocks that still hold a reusable prefix."),
            ("cbd_kv_usage_ratio", s.num_blocks_used / max(1, s.num_blocks), "Fraction of KV blocks in use."),
            ("cbd_open_sessions", s.num_sessions, "Open sessions."),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        if s.gpu_busy is not None:
            yield GaugeMetricFamily(
                "cbd_gpu_idle_ratio", "Fraction of the engine loop's recent wall time the GPU had no step to run.",
                value=1.0 - s.gpu_busy,
            )  # fmt: skip
        yield CounterMetricFamily("cbd_preemptions", "Sequences preempted for KV space.", value=s.num_preemptions)
        yield CounterMetricFamily(
            "cbd_session_evictions", "Idle sessions whose KV was released for running requests.",
            value=s.num_session_evictions,
        )  # fmt: skip
        yield CounterMetricFamily("cbd_engine_steps", "Engine steps run.", value=s.num_steps)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "cbd_requests",
            "Generate requests that ended, as completed or cancelled.",
            ["outcome"],
            registry=self.registry,
        )
        self.candidates = Counter(
            "cbd_candidates", "Finished candidates by finish reason.", ["finish_reason"], registry=self.registry
        )
        self.prompt_tokens = Counter("cbd_prompt_tokens", "Prompt tokens of finished requests.", registry=self.registry)
        self.cached_prompt_tokens = Counter(
            "cbd_cached_prompt_tokens", "Prompt tokens served from the prefix cache.", registry=self.registry
        )
        self.completion_tokens = Counter("cbd_completion_tokens", "Generated tokens.", registry=self.registry)
        self.first_token = Histogram(
            "cbd_time_to_first_token_seconds", "From request arrival to its first token.",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.inter_token = Histogram(
            "cbd_inter_token_latency_seconds", "Time between consecutive messages carrying new tokens of a request.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5), registry=self.registry,
        )  # fmt: skip
        self.queue = Histogram(
            "cbd_queue_seconds", "From submission to the engine to the request's first step.",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.duration = Histogram(
            "cbd_request_duration_seconds", "From request arrival to its last message.",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip

    def watch_engine(self, stats: Callable[[], EngineStats | None], live: Callable[[], int]) -> None:
        self.registry.register(_EngineCollector(stats, live))

    def observe(self, output: RequestOutput, elapsed: float) -> None:
        """Account one engine output of a request that arrived `elapsed` seconds ago."""
        if output.queue_seconds is not None:
            self.queue.observe(output.queue_seconds)
        for delta in output.candidates:
            if delta.finish_reason is not None:
                self.candidates.labels(delta.finish_reason.value).inc()
        if output.finished:
            self.requests.labels("completed").inc()
            self.duration.observe(elapsed)
            if output.usage is not None:
                self.prompt_tokens.inc(output.usage.prompt_tokens)
                self.cached_prompt_tokens.inc(output.usage.cached_prompt_tokens)
                self.completion_tokens.inc(output.usage.completion_tokens)

    def cancelled(self, elapsed: float) -> None:
        self.requests.labels("cancelled").inc()
        self.duration.observe(elapsed)

    def serve(self, port: int, address: str) -> None:
        start_http_server(port, addr=address, registry=self.registry)
