"""Prometheus metrics: request counters and latencies from the servicer, engine gauges read at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from cbd.engine.outputs import (
    RESTORE_SECONDS_BUCKETS,
    STEP_PHASE_SECONDS_BUCKETS,
    STEP_PHASES,
    DiskTierStats,
    EngineStats,
    HostTierStats,
    RequestOutput,
    StepPhaseStats,
)
from cbd.engine.sampling_params import PRIORITY_BATCH
from cbd.server.memory import resident_bytes
from cbd_client.contract import KvTier, Priority

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class _EngineCollector(Collector):
    def __init__(
        self, stats: Callable[[], EngineStats | None], live: Callable[[], int], pids: Callable[[], dict[str, int]],
        caches: Callable[[], dict[str, int]],
    ) -> None:  # fmt: skip
        self._stats, self._live, self._pids, self._caches = stats, live, pids, caches

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
        rss = GaugeMetricFamily(
            "cbd_process_resident_memory_bytes", "Resident memory of each daemon process (frontend, engine).",
            labels=["process"],
        )  # fmt: skip
        for process, pid in self._pids().items():
            if (resident := resident_bytes(pid)) is not None:
                rss.add_metric([process], resident)
        yield rss
        s = self._stats()
        if s is None:
            return
        grammars = GaugeMetricFamily(
            "cbd_grammar_cache_bytes",
            "Compiled grammars kept, by process (each bounded at 256 MiB).",
            labels=["process"],
        )
        grammars.add_metric(["engine"], s.grammar_cache_bytes)
        grammars.add_metric(["frontend"], self._caches().get("grammar_cache_bytes", 0))
        yield grammars
        trims = CounterMetricFamily(
            "cbd_idle_trims", "Heaps given back to the system after an idle period, by process.", labels=["process"]
        )
        trims.add_metric(["engine"], s.num_idle_trims)
        trims.add_metric(["frontend"], self._caches().get("idle_trims", 0))
        yield trims
        yield GaugeMetricFamily(
            "cbd_chat_transcripts", "Chat sessions' transcripts the frontend keeps (one per open chat session).",
            value=self._caches().get("chat_transcripts", 0),
        )  # fmt: skip
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
        preemptions = CounterMetricFamily("cbd_preemptions", "Sequences preempted, by cause.", labels=["cause"])
        preemptions.add_metric(["memory"], s.num_preemptions - s.num_priority_preemptions)
        preemptions.add_metric(["priority"], s.num_priority_preemptions)
        yield preemptions
        yield CounterMetricFamily(
            "cbd_session_evictions", "Times an idle session's KV left the GPU (to the host tier, or released) for running requests.",
            value=s.num_session_evictions,
        )  # fmt: skip
        yield CounterMetricFamily("cbd_engine_steps", "Engine steps run.", value=s.num_steps)
        if s.step_phases is not None:
            yield _step_phases(s.step_phases)
        if s.speculation is not None:
            spec = s.speculation
            yield CounterMetricFamily("cbd_spec_draft_tokens", "Draft tokens verified (speculative decoding).",
                                      value=spec.num_draft_tokens)  # fmt: skip
            yield CounterMetricFamily("cbd_spec_accepted_tokens", "Draft tokens kept (each saved a step).",
                                      value=spec.num_accepted_tokens)  # fmt: skip
            yield CounterMetricFamily(
                "cbd_spec_device_drafted_steps",
                "Sequence-steps whose drafts the device looked up again after the step in flight, where they differed.",
                value=spec.num_device_drafted,
            )  # fmt: skip
            yield GaugeMetricFamily(
                "cbd_spec_acceptance_ratio", "Kept / verified draft tokens since start (0 before any).",
                value=spec.num_accepted_tokens / spec.num_draft_tokens if spec.num_draft_tokens else 0.0,
            )  # fmt: skip
        if s.host is not None:
            yield from _host_tier(s.host)
        if s.disk is not None:
            yield from _session_files(s.disk)


def _host_tier(h: HostTierStats) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
    yield GaugeMetricFamily("cbd_host_kv_blocks_total", "Blocks in the host KV tier.", value=h.num_blocks)
    yield GaugeMetricFamily("cbd_host_kv_blocks_used", "Host KV blocks holding sessions' KV.", value=h.num_blocks_used)
    for name, blocks, doc in (
        ("offloaded", h.num_offloaded_blocks, "copied from the GPU to the host tier (idle sessions)"),
        ("restored", h.num_restored_blocks, "copied from the host tier back to the GPU (turns)"),
    ):
        yield CounterMetricFamily(f"cbd_kv_{name}_blocks", f"KV blocks {doc}.", value=blocks)
        yield CounterMetricFamily(f"cbd_kv_{name}_bytes", f"Bytes of KV {doc}.", value=blocks * h.bytes_per_block)
    yield CounterMetricFamily(
        "cbd_kv_restored_prompt_tokens", "Prompt tokens restored from the host tier instead of recomputed.",
        value=h.num_restored_tokens,
    )  # fmt: skip
    yield CounterMetricFamily(
        "cbd_host_kv_evictions", "Sessions whose host-tier KV was released (their next turn recomputes).",
        value=h.num_host_evictions,
    )  # fmt: skip
    hits = CounterMetricFamily("cbd_session_turns_by_tier", "Session turns by where their history's KV was.",
                               labels=["tier"])  # fmt: skip
    for tier in (KvTier.GPU, KvTier.HOST, KvTier.DISK, KvTier.RECOMPUTE):
        hits.add_metric([tier.value], h.session_hits.get(tier, 0))
    yield hits
    yield HistogramMetricFamily(
        "cbd_kv_restore_seconds", "From a restore's start to its completion as the engine saw it.",
        buckets=_histogram(RESTORE_SECONDS_BUCKETS, h.restore_buckets), sum_value=h.restore_seconds_sum,
    )  # fmt: skip


def _histogram(bounds: tuple[float, ...], counts: list[int]) -> list[tuple[str, float]]:
    """Prometheus' cumulative buckets of per-bucket counts (one more count than bounds: the overflow)."""
    cumulative, buckets = 0, list[tuple[str, float]]()
    for bound, count in zip((*bounds, float("inf")), counts, strict=True):
        cumulative += count
        buckets.append(("+Inf" if bound == float("inf") else str(bound), cumulative))
    return buckets


def _step_phases(p: StepPhaseStats) -> HistogramMetricFamily:
    family = HistogramMetricFamily(
        "cbd_engine_step_phase_seconds",
        f"Host time of each engine step by phase ({', '.join(STEP_PHASES)}; wait: for the device).",
        labels=["phase"],
    )
    for phase, counts, seconds in zip(STEP_PHASES, p.buckets, p.seconds, strict=True):
        family.add_metric([phase], _histogram(STEP_PHASE_SECONDS_BUCKETS, counts), seconds)
    return family


def _session_files(d: DiskTierStats) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    yield GaugeMetricFamily("cbd_session_files", "Session files in --disk-kv-dir.", value=d.num_files)
    yield GaugeMetricFamily("cbd_session_file_bytes", "Bytes of session files in --disk-kv-dir.", value=d.bytes_on_disk)
    for name, value, doc in (
        ("session_files_written", d.num_files_written, "Session files written."),
        ("session_files_written_with_kv", d.num_kv_files_written, "Session files written with their KV."),
        ("session_file_write_errors", d.num_write_errors, "Session file writes that failed (the old file stays)."),
        ("session_file_written_bytes", d.bytes_written, "Bytes of session files written."),
        ("session_file_read_bytes", d.bytes_read, "Bytes of saved KV read back."),
        ("session_kv_reads", d.num_kv_loads, "Saved KV read back for a turn or fork."),
        ("session_kv_read_failures", d.num_kv_load_failures, "Saved KV that was damaged (recomputed)."),
        ("sessions_restored", d.num_sessions_restored, "Sessions listed again from their files at start."),
        ("sessions_lost", d.num_sessions_lost, "Saved sessions that could not be listed again."),
        ("sessions_spilled", d.num_spilled, "Idle sessions whose host-tier KV went to their file, not recompute."),
    ):
        yield CounterMetricFamily(f"cbd_{name}", doc, value=value)
    yield CounterMetricFamily("cbd_session_file_write_seconds", "Seconds spent writing session files.",
                              value=d.write_seconds_sum)  # fmt: skip
    yield CounterMetricFamily("cbd_session_kv_read_seconds", "Seconds spent reading saved KV back.",
                              value=d.load_seconds_sum)  # fmt: skip
    yield GaugeMetricFamily("cbd_session_save_seconds", "How long the last shutdown's saving took.",
                            value=d.last_checkpoint_seconds)  # fmt: skip


def priority_label(priority: int | None) -> str:
    """The bounded label of a priority class."""
    return (Priority.BATCH if priority == PRIORITY_BATCH else Priority.INTERACTIVE).value


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "cbd_requests",
            "Generate requests that ended, as completed or cancelled.",
            ["outcome"],
            registry=self.registry,
        )
        self.refused = Counter(
            "cbd_requests_refused",
            "Generate requests the daemon refused before they ran (bad input, over a cap, unknown session, not "
            "serving), by gRPC status code.",
            ["code"],
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
            "cbd_time_to_first_token_seconds", "From request arrival to its first token, by priority class.",
            ["priority"], buckets=_LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.inter_token = Histogram(
            "cbd_inter_token_latency_seconds", "Time between consecutive messages carrying new tokens of a request.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5), registry=self.registry,
        )  # fmt: skip
        self.queue = Histogram(
            "cbd_queue_seconds", "From submission to the engine to the request's first step, by priority class.",
            ["priority"], buckets=_LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.duration = Histogram(
            "cbd_request_duration_seconds", "From request arrival to its last message.",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip

    def watch_engine(
        self, stats: Callable[[], EngineStats | None], live: Callable[[], int], pids: Callable[[], dict[str, int]],
        caches: Callable[[], dict[str, int]],
    ) -> None:  # fmt: skip
        """caches: the frontend's cache sizes by name (grammar_cache_bytes, chat_transcripts)."""
        self.registry.register(_EngineCollector(stats, live, pids, caches))

    def observe(self, output: RequestOutput, elapsed: float) -> None:
        """Account one engine output of a request that arrived `elapsed` seconds ago."""
        if output.queue_seconds is not None:
            self.queue.labels(priority_label(output.priority)).observe(output.queue_seconds)
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
