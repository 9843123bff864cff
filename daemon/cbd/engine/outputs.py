"""What the engine hands back each step: per-request deltas, one entry per candidate that moved.

The per-step types (an output per request per step, a delta per candidate) are msgspec structs encoded
as arrays: they cross from the engine process to the frontend in every step's Events message, where
decoding them is per-sequence work of every step (a fifth of the bytes and under half the time of
dataclasses encoded as maps).
"""

from __future__ import annotations

import bisect
from collections.abc import Collection
from dataclasses import dataclass, field
from operator import attrgetter

import msgspec

from cbd.engine.sequence import FinishReason


class TokenLogprob(msgspec.Struct, array_like=True, omit_defaults=True):
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = msgspec.field(default_factory=list)  # best alternatives, most likely first


class Usage(msgspec.Struct, frozen=True, array_like=True):
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int


class CandidateDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    usage: Usage | None = None  # this candidate's, on its last delta


class RequestOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    candidates: list[CandidateDelta]
    finished: bool = False
    usage: Usage | None = None  # set on the last output of a request
    queue_seconds: float | None = None  # on the first output: from submission to first being scheduled
    priority: int | None = None  # on the first output: the class it is scheduled in (sampling_params.PRIORITY_*)
    error: str | None = None  # with finish reason ERROR: why, when it is the request's doing ("grammar too expensive")
    # On the last output of a session's turn: whether the turn became the session's history (every candidate
    # ended STOP or LENGTH). The engine's rule, carried so that the frontend's chat log never re-derives it;
    # None on other outputs, and on a turn that ended without the engine (its process gone): not ok.
    turn_ok: bool | None = None
    # On the first output once the request has been scheduled: the prompt's counts (its tokens, those whose
    # KV was reused; completion_tokens 0), the same prompt counts as the last output's `usage`.
    prompt_usage: Usage | None = None


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_blocks: int
    num_blocks_used: int
    num_blocks_free: int
    num_blocks_cached: int
    num_preemptions: int
    num_steps: int
    num_generated_tokens: int
    num_sessions: int = 0
    num_session_evictions: int = 0
    num_priority_preemptions: int = 0  # of num_preemptions, those made for a more urgent request
    gpu_busy: float | None = None  # device busy fraction of the recent steps (CUDA only)
    host: HostTierStats | None = None  # None: no host tier
    disk: DiskTierStats | None = None  # None: no disk tier (no --disk-kv-dir)
    speculation: SpeculationStats | None = None
    grammar_cache_bytes: int = 0  # compiled grammars the engine keeps (engine/grammar/matcher.py's byte bound)
    num_idle_trims: int = 0  # the engine process's heap given back after idle periods (cbd/allocator.py)
    step_phases: StepPhaseStats | None = None  # None: not kept (a core whose loop files no phases)


# The phases of an engine step, in its order (engine/step_phases.py says what each covers), and the upper
# bounds (seconds) of the buckets of their histograms.
STEP_PHASES = ("intake", "schedule", "launch", "mask", "wait", "book", "emit", "deliver")
STEP_PHASE_SECONDS_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)


@dataclass(slots=True)
class StepPhaseStats:
    """Host time of the engine's steps by phase (cumulative): per phase of STEP_PHASES, the count of steps per
    bucket of STEP_PHASE_SECONDS_BUCKETS (one more for larger) and the sum of seconds."""

    buckets: list[list[int]] = field(
        default_factory=lambda: [[0] * (len(STEP_PHASE_SECONDS_BUCKETS) + 1) for _ in STEP_PHASES]
    )
    seconds: list[float] = field(default_factory=lambda: [0.0] * len(STEP_PHASES))

    def observe(self, phase: int, seconds: float) -> None:
        self.buckets[phase][bisect.bisect_left(STEP_PHASE_SECONDS_BUCKETS, seconds)] += 1
        self.seconds[phase] += seconds


# Upper bounds (seconds) of the buckets of the host tier's restore-latency histogram.
RESTORE_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


@dataclass(slots=True)
class HostTierStats:
    """The host KV tier: its pool, what moved, and how long copies took (cumulative)."""

    num_blocks: int = 0
    num_blocks_used: int = 0
    bytes_per_block: int = 0
    num_offloaded_blocks: int = 0
    num_restored_blocks: int = 0
    num_restored_tokens: int = 0  # prompt tokens restored instead of recomputed
    num_host_evictions: int = 0  # sessions whose host blocks were released (to recompute)
    session_hits: dict[str, int] = field(default_factory=dict)  # session turns by where their KV was
    # Restore latency (from the copy's start to its completion as the engine saw it): count per bucket
    # of RESTORE_SECONDS_BUCKETS (one more for larger), and the sum.
    restore_buckets: list[int] = field(default_factory=lambda: [0] * (len(RESTORE_SECONDS_BUCKETS) + 1))
    restore_seconds_sum: float = 0.0

    def observe_restore(self, seconds: float) -> None:
        self.restore_buckets[bisect.bisect_left(RESTORE_SECONDS_BUCKETS, seconds)] += 1
        self.restore_seconds_sum += seconds


@dataclass(slots=True)
class DiskTierStats:
    """Session files (engine/kv/disk_tier.py): the directory, what was written and read (cumulative)."""

    cap_bytes: int = 0
    num_files: int = 0
    bytes_on_disk: int = 0
    num_files_written: int = 0
    num_kv_files_written: int = 0  # of those, with KV (the rest: token ids only)
    num_write_errors: int = 0  # writes that failed (disk full): the old file stays
    bytes_written: int = 0
    write_seconds_sum: float = 0.0
    num_kv_loads: int = 0  # branches whose KV came back from a file
    num_kv_load_failures: int = 0  # branches whose saved KV was damaged: recomputed
    bytes_read: int = 0
    load_seconds_sum: float = 0.0
    num_sessions_restored: int = 0  # sessions listed again at start
    num_sessions_lost: int = 0  # saved sessions that could not be listed again (damaged, another model)
    num_spilled: int = 0  # idle sessions whose host-tier KV went to their file instead of recompute
    num_checkpoints: int = 0  # drain-time checkpoints
    last_checkpoint_seconds: float = 0.0  # how long the last one took


@dataclass(slots=True)
class SaveReport:
    """What saving sessions did (engine/sessions/checkpoints.py)."""

    num_saved: int = 0  # files written (or queued, in the background)
    num_with_kv: int = 0  # of those, with their KV (the rest: token ids only)
    num_failed: int = 0  # not saved (the disk refused the write: the last file stays)
    seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What is being served, as the server reports it (fixed once the engine has started)."""

    name: str
    architecture: str
    vocab_size: int
    dtype: str
    device: str
    max_model_len: int  # the context a request may fill, prompt included
    num_kv_blocks: int
    block_size: int
    eos_token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SpeculationStats:
    num_steps: int = 0  # sequence-steps that verified drafts
    num_draft_tokens: int = 0  # drafts proposed and verified
    num_accepted_tokens: int = 0  # of those, kept (each saved one step of its sequence)
    num_device_drafted: int = 0  # of num_steps, those whose drafts the device looked up again (not the host's)


def ended(request_id: str, n: int, reason: FinishReason, done: Collection[int] = ()) -> RequestOutput:
    """The last output of a request that ends where it stands (refused, never started, or its engine is
    gone): every candidate of `n` not already `done` ends with `reason`. The one rule for ending a request
    from outside the step."""
    deltas = [CandidateDelta(i, [], "", None, reason) for i in range(n) if i not in done]
    return RequestOutput(request_id, deltas, True, None)


def copy_delta(d: CandidateDelta) -> CandidateDelta:
    """A copy of d that later deltas of its candidate can be merged into (extend_delta) without changing d."""
    logprobs = None if d.logprobs is None else list(d.logprobs)
    return CandidateDelta(d.index, list(d.token_ids), d.text, logprobs, d.finish_reason, d.usage)


def extend_delta(merged: CandidateDelta, d: CandidateDelta) -> None:
    """Merge d, a later delta of the same candidate, into merged: tokens, text and logprobs concatenated;
    the last finish reason and usage. The one rule for folding a candidate's deltas."""
    merged.token_ids += d.token_ids
    if d.text:
        merged.text += d.text
    if d.logprobs is not None:
        merged.logprobs = (merged.logprobs or []) + d.logprobs
    if d.finish_reason is not None:
        merged.finish_reason = d.finish_reason
    if d.usage is not None:
        merged.usage = d.usage


def merge_deltas(deltas: list[CandidateDelta]) -> list[CandidateDelta]:
    """Consecutive deltas as one per candidate (in first-seen order; extend_delta's rule). A step that keeps
    drafts moves a candidate by several tokens."""
    if len(deltas) < 2 or len({d.index for d in deltas}) == len(deltas):
        return deltas
    merged: dict[int, CandidateDelta] = {}
    for d in deltas:
        m = merged.get(d.index)
        if m is None:
            merged[d.index] = copy_delta(d)
        else:
            extend_delta(m, d)
    return list(merged.values())


def start_merge(first: RequestOutput, candidates: list[CandidateDelta]) -> RequestOutput:
    """A new output with these candidates and first's request fields, for later outputs of its request to
    be merged into (merge_request_fields)."""
    return RequestOutput(first.request_id, candidates, first.finished, first.usage, first.queue_seconds,
                         first.priority, first.error, first.turn_ok, first.prompt_usage)  # fmt: skip


def merge_request_fields(merged: RequestOutput, out: RequestOutput) -> None:
    """Merge the request fields of out, a later output of the same request, into merged: finished if either
    is; the first queue time, class and prompt counts; the last usage, error and turn outcome."""
    if not (
        out.finished or out.usage is not None or out.queue_seconds is not None or out.priority is not None
        or out.error is not None or out.turn_ok is not None or out.prompt_usage is not None
    ):  # fmt: skip
        return  # most outputs carry none of them
    merged.finished = merged.finished or out.finished
    if merged.queue_seconds is None:
        merged.queue_seconds = out.queue_seconds
    if merged.priority is None:
        merged.priority = out.priority
    if merged.prompt_usage is None:
        merged.prompt_usage = out.prompt_usage
    if out.usage is not None:
        merged.usage = out.usage
    if out.error is not None:
        merged.error = out.error
    if out.turn_ok is not None:
        merged.turn_ok = out.turn_ok


def merge_outputs(outputs: list[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request as one (a stream that fell behind catches up in one message):
    each candidate's deltas merged (extend_delta), candidates in index order, the request fields merged
    (merge_request_fields). Nothing is dropped."""
    if len(outputs) == 1:
        return outputs[0]
    deltas = merge_deltas([d for out in outputs for d in out.candidates])
    merged = start_merge(outputs[0], sorted(deltas, key=attrgetter("index")))
    for out in outputs[1:]:
        merge_request_fields(merged, out)
    return merged
