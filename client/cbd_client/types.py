"""Plain result types of the client API (no protobuf in user code)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

# A prompt: a str is text, a list of ints token ids, a list of {"role", "content"} dicts a chat.
Prompt = str | Sequence[int] | Sequence[dict[str, str]]


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of a tool call: the first of an index has id and name, later ones argument fragments."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str = ""  # JSON text

    def parsed_arguments(self) -> object:
        import json

        return json.loads(self.arguments)


@dataclass(frozen=True, slots=True)
class Delta:
    """What one candidate produced since the previous delta."""

    request_id: str
    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None  # "stop", "length", "abort", "error" or "tool_calls" on the last delta
    usage: Usage | None = None  # on the candidate's last delta
    tool_calls: tuple[ToolCallDelta, ...] = ()


@dataclass(slots=True)
class Candidate:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(slots=True)
class Completion:
    request_id: str
    candidates: list[Candidate]
    usage: Usage | None = None  # totals over all candidates

    @property
    def text(self) -> str:
        """The first candidate's text."""
        return self.candidates[0].text


@dataclass(frozen=True, slots=True)
class ModelInfo:
    model: str
    architecture: str
    context_length: int
    vocab_size: int
    dtype: str
    device: str
    block_size: int
    num_kv_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_n: int
    max_logprobs: int
    max_stop_strings: int
    max_queued_requests: int
    eos_token_ids: tuple[int, ...]
    has_chat_template: bool
    max_tools: int = 0
    max_grammar_bytes: int = 0
    tool_call_format: str = ""  # "hermes", "mistral", "llama3_json" or "generic"
    kv_cache_dtype: str = ""  # the model's dtype, or "fp8" (--kv-cache-dtype)


@dataclass(frozen=True, slots=True)
class Stats:
    running: int
    waiting: int
    live_requests: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_cached: int
    uptime_seconds: float
    num_preemptions: int
    num_steps: int
    generated_tokens: int
    open_sessions: int = 0
    session_evictions: int = 0
    host_kv_blocks_total: int = 0  # the host KV tier (0: none)
    host_kv_blocks_used: int = 0
    kv_blocks_offloaded: int = 0  # GPU -> host (idle sessions), since start
    kv_blocks_restored: int = 0  # host -> GPU (turns), since start
    restored_prompt_tokens: int = 0  # prompt tokens restored instead of recomputed
    priority_preemptions: int = 0  # of num_preemptions, those made for interactive requests
    draft_tokens: int = 0  # speculative decoding: draft tokens verified since start
    accepted_draft_tokens: int = 0  # of those, kept
    speculative_steps: int = 0  # sequence-steps that verified drafts
    # Session files (--disk-kv-dir; see the proto's Stats for each)
    session_files: int = 0
    session_file_bytes: int = 0
    session_files_written: int = 0
    session_files_written_with_kv: int = 0
    session_file_write_errors: int = 0
    session_file_bytes_written: int = 0
    session_file_bytes_read: int = 0
    session_kv_reads: int = 0
    session_kv_read_failures: int = 0
    sessions_restored: int = 0
    sessions_lost: int = 0
    last_save_seconds: float = 0.0
    sessions_spilled: int = 0
    device_drafted_steps: int = 0  # of speculative_steps, those whose drafts the device looked up again


@dataclass(frozen=True, slots=True)
class SessionInfo:
    session_id: str
    num_tokens: int  # tokens in the session's history
    resident_blocks: int  # KV blocks held now (0 after a release under memory pressure)
    pending_candidates: int  # candidates of an n > 1 turn waiting for the next turn to pick one
    idle_seconds: float
    busy: bool
    ttl_seconds: float
    is_chat: bool
    kv_tier: str = "none"  # where its KV is: "gpu", "host", "disk", "recompute" (released) or "none" (no tokens)
    host_blocks: int = 0  # KV blocks in the host tier
    expected_idle_ms: int | None = None  # the retention hints in force
    retention: str = "normal"  # "low" | "normal" | "high"
    priority: str = "interactive"  # its turns' class: "interactive" | "batch"
    tenant: str = ""  # the tenant that owns it ("" on a daemon without auth)
    disk_blocks: int = 0  # KV blocks only in its session file (kv_tier "disk")
