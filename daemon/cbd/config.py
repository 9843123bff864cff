"""Engine configuration: one frozen dataclass, validated once."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # torch only where a device or dtype is made: the frontend process imports no torch
    import torch

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    # Model source: a HF checkpoint directory, a .gguf file, or None for the embedded default.
    model: str | None = None
    # Where converted checkpoints are cached; None means $CBD_CACHE_DIR or ~/.cache/cbd.
    cache_dir: str | None = None
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    dtype: str = "auto"  # "auto" (fp32 on CPU, bf16 on CUDA) | "float32" | "bfloat16" | "float16"
    # Tokens per KV block, a power of two (small blocks let prompts that share a prefix share more of it).
    block_size: int = 8
    # KV pool size in blocks; None sizes it from kv_cache_gib.
    num_kv_blocks: int | None = None
    # KV pool size in GiB, used when num_kv_blocks is not set.
    kv_cache_gib: float = 0.5
    # How the KV pool stores keys and values: "auto" (the model's dtype) | "fp8" (float8 e4m3 with one fp32 scale
    # per token, head and K/V; 1.94x the tokens per GiB at head_dim 128; not with the flash attention backend).
    kv_cache_dtype: str = "auto"
    # Host KV tier in GiB (pinned host memory on CUDA): idle sessions' KV is copied there instead of being
    # dropped when the KV pool runs short. None: a quarter of the host's RAM, at most 64 GiB and at most four
    # times the GPU KV pool; 0: no host tier. Not with tensor_parallel_size > 1 (there it is always 0).
    host_kv_gib: float | None = None
    # Host KV tier size in blocks; None sizes it from host_kv_gib.
    num_host_kv_blocks: int | None = None
    # Directory of session files: open sessions are saved there at shutdown and, once idle, in the background,
    # and listed again when a daemon starts on it (their KV read back on their next turn); replicas may share
    # it, each in its own folder (disk_kv_owner). None: $STATE_DIRECTORY/sessions under systemd (the service's
    # StateDirectory=, /var/lib/cbd),
    # else sessions are not saved (a restart loses them).
    disk_kv_dir: str | None = None
    # GiB of session files in disk_kv_dir at most: a session that would go over it is saved with its token ids
    # only (its KV is recomputed on its next turn); 0: sessions are not saved.
    disk_kv_gib: float = 64.0
    # This daemon's folder in disk_kv_dir (letters, digits, . _ -): several daemons may share the directory,
    # each holding its own sessions; "": named after the listen addresses (the same daemon restarted finds its
    # folder again). A session a stopped daemon left there moves to the daemon that its next call reaches.
    disk_kv_owner: str = ""
    # When the host KV tier is full and lets an idle session's KV go, write it to the session's file instead
    # of recomputing it later (the disk as the tier under the host tier). Off by default: it pays where the
    # disk reads a session's KV faster than the device recomputes it (on an H200 with a 1.9 GiB/s disk the
    # 8B shape's agents were slower with it: docs/BENCHMARKS.md).
    disk_kv_spill: bool = False
    # Sequences (candidates) running at once.
    max_num_seqs: int = 128
    # Token budget of one engine step; longer prefills are split into chunks that fit.
    max_num_batched_tokens: int = 2048
    # Live requests (queued or running) beyond which a new one is refused (RESOURCE_EXHAUSTED, with a retry hint).
    max_queued_requests: int = 4096
    # Prompt tokens of live requests beyond which a new one is refused (RESOURCE_EXHAUSTED; bounds memory
    # whatever the offered load).
    max_queued_tokens: int = 1_048_576
    # None: the model's own context length.
    max_model_len: int | None = None
    # Reuse the KV of prompt prefixes shared between requests.
    enable_prefix_caching: bool = True
    # CPU fp32 only: pre-pack GEMM weights for oneDNN (faster; logits differ from BLAS in the last bits).
    cpu_packed_gemm: bool = True
    # Shard the model over this many GPUs of the host (or CPU processes); the engine starts the ranks itself.
    tensor_parallel_size: int = 1
    # Seconds after which a queued batch-priority request is scheduled as interactive (its starvation bound).
    priority_aging_seconds: float = 30.0
    # Within a class and tenant, a turn that brings its KV (its session's on the GPU or the host tier, at most 2048
    # tokens left to compute) is admitted before requests that bring none (prefix-cache hits do not count) and have
    # waited less than this (their bound on being overtaken); 0: queue order.
    warm_first_seconds: float = 10.0
    # Batch-priority requests are refused (RESOURCE_EXHAUSTED) once the live requests or their prompt tokens
    # reach this share of max_queued_requests / max_queued_tokens; interactive ones only at the caps.
    batch_queue_share: float = 0.75
    # Open sessions at most (OpenSession beyond it is RESOURCE_EXHAUSTED).
    max_sessions: int = 1024
    # Default idle seconds after which a session closes itself.
    session_ttl: float = 600.0
    # Keep one step in flight while the CPU prepares the next: "auto" (on for CUDA, off on CPU) | "on" | "off".
    overlap: str = "auto"
    # Speculative decoding with drafts looked up in the sequence's own context (n-grams): "auto" (while at most
    # speculative_max_batch sequences run) | "ngram" (always) | "off". Outputs are the same either way.
    speculative: str = "auto"
    # Draft tokens a sequence verifies per step, at most (it starts at 4, doubles after a run kept whole, and
    # drops to just past what was kept otherwise).
    num_speculative_tokens: int = 8
    # "auto" speculates while at most this many sequences run (beyond, a step costs more per token verified).
    # Verifying steps get CUDA graphs up to this many sequences with "auto", max(this, 8) with "ngram"
    # (never beyond 32 or cuda_graph_max_batch).
    speculative_max_batch: int = 4
    # Tokens of finished sequences kept for drafting across a tenant's sessions and requests (when a sequence's
    # own context has no match, its tenant's other recent work is searched: engine/spec/agent_index.py), at most
    # ~0.5 KB of host memory each (its index included); 0: only the sequence's own context.
    speculative_index_tokens: int = 131072
    # In the overlap loop, look a step's drafts up again on the device once the step before it has been sampled,
    # so that they follow the sequence's real tokens (engine/device/draft_lookup.py); false: the host's drafts
    # only, made after a guess of the tokens in flight. Outputs are the same either way.
    speculative_device_drafts: bool = True
    # "auto" | "torch" | "triton" | "flash". auto: on CUDA, "flash" (FlashAttention-4 for prefill/extend steps,
    # Triton for decodes) where flash-attn-4 is installed, compute capability >= 9.0, bf16/fp16 and KV not FP8,
    # else "triton"; "torch" on the CPU. The choice and its reason are logged at start.
    attention_backend: str = "auto"
    # GEMMs on CUDA: "auto" (cuBLASLt) | "cublas" | "cublaslt" (torch's BLAS front end, process-wide).
    blas_library: str = "auto"
    # The MLP's gate|up GEMM with SiLU-mul in its epilogue (quack's, from the flash extra) for eager steps of 1024
    # rows or more: "auto" (where it runs: CUDA, compute capability >= 9.0, bf16/fp16, no MLP bias, MLP sizes
    # multiples of 8) | "on" (the same, an error where it cannot) | "off" (cuBLAS, then a SiLU-mul kernel). The
    # choice is logged at start.
    fused_swiglu: str = "auto"
    # Capture CUDA graphs for decode steps (and speculative decoding's verifying steps) before reporting ready.
    cuda_graphs: bool = True
    # Largest decode batch with a CUDA graph (capped by max_num_seqs).
    cuda_graph_max_batch: int = 256
    # Threads torch uses inside one CPU operation (intra-op); 0: the cores this process may run on (its CPU
    # affinity mask), less those other processes keep busy (re-read every 2 s of work: a thread is given up
    # per core they take beyond half a core, at least one kept). A number given is used as it is.
    num_threads: int = 0
    # Structured output: grammars (JSON schemas, regexes, EBNF, tool sets) compile in this many worker
    # processes at most at once; further compiles wait their turn (requests without a grammar never do).
    grammar_compile_workers: int = 2
    # Seconds one grammar may take to compile; past it its worker is killed and the request is refused
    # (INVALID_ARGUMENT naming this limit). Time waiting for a free worker is not counted.
    grammar_compile_timeout: float = 10.0
    # MiB of memory (address space) one grammar's compile may take; past it the request is refused.
    grammar_compile_memory_mib: int = 1024
    # Milliseconds the host may spend filling one constrained candidate's token mask for one step; a
    # request whose masks take longer in grammar_mask_budget_steps consecutive steps ends with an error
    # ("grammar too expensive"), so one pathological grammar cannot slow the batch.
    grammar_mask_budget_ms: float = 20.0
    # Consecutive steps over grammar_mask_budget_ms after which the request is ended.
    grammar_mask_budget_steps: int = 3
    # The C allocator (glibc) of the daemon's processes: at most this many malloc arenas (0: glibc's default,
    # 8 per core). Few arenas keep memory a burst freed reusable instead of spread over per-thread heaps.
    malloc_arena_max: int = 2
    # Allocations of at least this many KiB get mappings of their own, unmapped when freed (0: glibc's
    # dynamic threshold). A fixed threshold keeps the heap from fragmenting but costs a page fault per page
    # of every large buffer (a third of CPU decode throughput at 128), so the default leaves it dynamic and
    # relies on the idle trim.
    malloc_mmap_threshold_kib: int = 0
    # Seconds a daemon process must be idle, after work, before it gives its heap's free pages back
    # (malloc_trim); 0: never.
    idle_trim_seconds: float = 2.0

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2, got {self.num_kv_blocks}")
        if self.kv_cache_gib <= 0:
            raise ValueError(f"kv_cache_gib must be > 0, got {self.kv_cache_gib}")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {self.kv_cache_dtype!r}")
        if self.host_kv_gib is not None and not self.host_kv_gib >= 0:
            raise ValueError(f"host_kv_gib must be >= 0, got {self.host_kv_gib}")
        if self.disk_kv_owner and not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}", self.disk_kv_owner):
            raise ValueError(f"disk_kv_owner must be 1-128 letters, digits and . _ -, got {self.disk_kv_owner!r}")
        if not self.disk_kv_gib >= 0:
            raise ValueError(f"disk_kv_gib must be >= 0, got {self.disk_kv_gib}")
        if self.num_host_kv_blocks is not None and self.num_host_kv_blocks < 0:
            raise ValueError(f"num_host_kv_blocks must be >= 0, got {self.num_host_kv_blocks}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_queued_tokens < 1:
            raise ValueError(f"max_queued_tokens must be >= 1, got {self.max_queued_tokens}")
        if self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.dtype not in _DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPE_NAMES)}, got {self.dtype!r}")
        if self.overlap not in ("auto", "on", "off"):
            raise ValueError(f"overlap must be 'auto', 'on' or 'off', got {self.overlap!r}")
        if self.speculative not in ("auto", "ngram", "off"):
            raise ValueError(f"speculative must be 'auto', 'ngram' or 'off', got {self.speculative!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if self.speculative_max_batch < 1:
            raise ValueError(f"speculative_max_batch must be >= 1, got {self.speculative_max_batch}")
        if self.speculative_index_tokens < 0:
            raise ValueError(f"speculative_index_tokens must be >= 0, got {self.speculative_index_tokens}")
        if self.attention_backend not in ("auto", "torch", "triton", "flash"):
            raise ValueError(
                f"attention_backend must be 'auto', 'torch', 'triton' or 'flash', got {self.attention_backend!r}"
            )
        if self.blas_library not in ("auto", "cublas", "cublaslt"):
            raise ValueError(f"blas_library must be 'auto', 'cublas' or 'cublaslt', got {self.blas_library!r}")
        if self.fused_swiglu not in ("auto", "on", "off"):
            raise ValueError(f"fused_swiglu must be 'auto', 'on' or 'off', got {self.fused_swiglu!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if not self.priority_aging_seconds > 0:
            raise ValueError(f"priority_aging_seconds must be > 0, got {self.priority_aging_seconds}")
        if not self.warm_first_seconds >= 0:
            raise ValueError(f"warm_first_seconds must be >= 0, got {self.warm_first_seconds}")
        if not 0 < self.batch_queue_share <= 1:
            raise ValueError(f"batch_queue_share must be in (0, 1], got {self.batch_queue_share}")
        if self.max_sessions < 0:
            raise ValueError(f"max_sessions must be >= 0, got {self.max_sessions}")
        if self.session_ttl <= 0:
            raise ValueError(f"session_ttl must be > 0, got {self.session_ttl}")
        if self.cuda_graph_max_batch < 1:
            raise ValueError(f"cuda_graph_max_batch must be >= 1, got {self.cuda_graph_max_batch}")
        if self.num_threads < 0:
            raise ValueError(f"num_threads must be >= 0, got {self.num_threads}")
        if self.grammar_compile_workers < 1:
            raise ValueError(f"grammar_compile_workers must be >= 1, got {self.grammar_compile_workers}")
        if not self.grammar_compile_timeout > 0:
            raise ValueError(f"grammar_compile_timeout must be > 0, got {self.grammar_compile_timeout}")
        if self.grammar_compile_memory_mib < 64:
            raise ValueError(f"grammar_compile_memory_mib must be >= 64, got {self.grammar_compile_memory_mib}")
        if not self.grammar_mask_budget_ms > 0:
            raise ValueError(f"grammar_mask_budget_ms must be > 0, got {self.grammar_mask_budget_ms}")
        for name in ("malloc_arena_max", "malloc_mmap_threshold_kib"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.idle_trim_seconds < 0:
            raise ValueError(f"idle_trim_seconds must be >= 0, got {self.idle_trim_seconds}")
        if self.grammar_mask_budget_steps < 1:
            raise ValueError(f"grammar_mask_budget_steps must be >= 1, got {self.grammar_mask_budget_steps}")
        if not (self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")

    @classmethod
    def from_dict(cls, values: dict[str, object]) -> EngineConfig:
        return config_from_dict(cls, values, "engine config")

    def session_dir(self) -> str | None:
        """Where sessions are saved: disk_kv_dir, else the sessions folder of systemd's state directory; None
        (not saved) without either, or with disk_kv_gib 0."""
        if not self.disk_kv_gib:
            return None
        if self.disk_kv_dir is not None:
            return self.disk_kv_dir
        state = os.environ.get("STATE_DIRECTORY", "").split(":")[0]
        return os.path.join(state, "sessions") if state else None

    def host_kv_bytes(self, gpu_pool_bytes: int) -> int:
        """The host tier's size: host_kv_gib, or by default a quarter of physical RAM (at most 64 GiB and
        at most 4x the GPU pool, `gpu_pool_bytes`)."""
        if self.host_kv_gib is not None:
            return int(self.host_kv_gib * 2**30)
        return min(64 * 2**30, physical_memory() // 4, 4 * gpu_pool_bytes)

    def intra_op_threads(self) -> int:
        return self.num_threads or len(os.sched_getaffinity(0))

    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def overlap_enabled(self, device: torch.device) -> bool:
        return self.overlap == "on" or (self.overlap == "auto" and device.type == "cuda")

    def torch_dtype(self) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            return torch.float32 if self.torch_device().type == "cpu" else torch.bfloat16
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]


def config_from_dict(cls: type[T], values: dict[str, Any], label: str) -> T:
    """Build a config dataclass from a mapping; unknown keys are errors, not silently dropped."""
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown {label} keys: {unknown}; known: {sorted(known)}")
    for f in fields(cls):  # type: ignore[arg-type]
        if f.name in values and not _has_type(values[f.name], str(f.type)):
            raise ValueError(f"{label}: {f.name} must be {f.type}, got {values[f.name]!r}")
    return cls(**values)


def _has_type(value: Any, annotation: str) -> bool:
    """Values read from TOML against a field's annotation (`int`, `float`, `str`, `bool`, `X | None`)."""
    base = annotation.replace(" | None", "")
    if value is None:
        return annotation.endswith("| None")
    if base == "bool":
        return isinstance(value, bool)
    if base == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if base == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, str)


_DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")


def physical_memory() -> int:
    """Bytes of RAM this host has."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
