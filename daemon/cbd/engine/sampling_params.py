"""Per-request sampling (and scheduling) parameters, validated once at the boundary."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from cbd.errors import InvalidRequest

if TYPE_CHECKING:
    from cbd.engine.grammar.matcher import CompiledGrammar

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_CANDIDATES = 64
MAX_TENANT_CHARS = 128
# Below this temperature sampling is greedy: logits / T would overflow float32 (or round to inf/NaN) for
# tiny legal values such as 1e-45, and at 1e-5 the softmax is already one-hot for any logit gap > 1e-3.
MIN_TEMPERATURE = 1e-5
# Priority classes (scheduler.py): interactive requests are admitted first and may preempt batch ones.
PRIORITY_INTERACTIVE, PRIORITY_BATCH = 0, 1

MAX_STREAM_INTERVAL = 1024  # tokens per gathered output (engine/stream_interval.py)


def check_stream_interval(name: str, value: object) -> None:
    """A stream interval (tokens per gathered output) is an int in 1..MAX_STREAM_INTERVAL (InvalidRequest)."""
    if type(value) is not int or not 1 <= value <= MAX_STREAM_INTERVAL:
        raise InvalidRequest(f"{name} must be 1-{MAX_STREAM_INTERVAL} tokens, got {value!r}")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0  # 0 (or anything below MIN_TEMPERATURE) means greedy
    top_p: float = 1.0  # 1 disables
    top_k: int = 0  # 0 disables
    min_p: float = 0.0  # 0 disables
    seed: int | None = None  # None: a fresh random seed per request
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N alternatives per token; 0 returns only the chosen token's logprob
    n: int = 1
    skip_special_tokens: bool = True
    # Every candidate's reply is held to this grammar (constrained decoding; see engine/grammar/matcher.py). Once
    # the grammar is complete the candidate stops (finish reason stop), ignore_eos notwithstanding.
    grammar: CompiledGrammar | None = None
    # Scheduling: PRIORITY_INTERACTIVE or PRIORITY_BATCH; None: the session's class for a turn, else
    # interactive. tenant: whom the request is for (the batch is shared fairly among a class's tenants).
    priority: int | None = None
    tenant: str = ""
    # The prefix cache's scope: a request reuses cached KV blocks only of requests with the same scope.
    # The frontend sets it to the caller's authenticated tenant ("" when the daemon has no auth), so no
    # tenant's prompt can be probed through another's cache hits (usage.cached_prompt_tokens, timing).
    cache_scope: str = ""
    # Outputs gathered to at most one per this many tokens of a candidate after the first token
    # (engine/stream_interval.py): the request's own interval, or None: 1 for an interactive request and
    # batch_stream_interval for a batch one (the class is the one it runs in).
    stream_interval: int | None = None
    batch_stream_interval: int = 1

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequest(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0 (0 disables), got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequest(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidRequest(f"seed must be in [0, 2**63), got {self.seed}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if any(not s for s in self.stop):
            raise InvalidRequest("stop strings must not be empty (an empty string would stop before any text)")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise InvalidRequest(f"each stop string has at most {MAX_STOP_STRING_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(
                f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}"
            )
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequest("stop_token_ids must be non-negative token ids")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(f"logprobs must be in [0, {MAX_LOGPROBS}]")
        if not 1 <= self.n <= MAX_CANDIDATES:
            raise InvalidRequest(f"n must be in [1, {MAX_CANDIDATES}]")
        if self.priority not in (None, PRIORITY_INTERACTIVE, PRIORITY_BATCH):
            raise InvalidRequest(f"unknown priority {self.priority}")
        if len(self.tenant) > MAX_TENANT_CHARS:
            raise InvalidRequest(f"tenant has at most {MAX_TENANT_CHARS} characters, got {len(self.tenant)}")
        if len(self.cache_scope) > MAX_TENANT_CHARS:
            raise InvalidRequest(f"cache_scope has at most {MAX_TENANT_CHARS} characters")
        if self.stream_interval is not None:  # None: by its class
            check_stream_interval("stream_interval", self.stream_interval)
        check_stream_interval("batch_stream_interval", self.batch_stream_interval)

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


def validate_request(
    prompt_token_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int, has_tokenizer: bool,
    max_num_seqs: int,
) -> None:  # fmt: skip
    """Raise InvalidRequest for a request that can never run on a model with these facts (and an engine that
    runs at most max_num_seqs sequences at once: a request's candidates run together, so n above it would
    wait forever at the head of the queue)."""
    if not prompt_token_ids:
        raise InvalidRequest("the prompt is empty")
    if params.n > max_num_seqs:
        raise InvalidRequest(
            f"n must be at most {max_num_seqs} on this daemon: its candidates run at once, and it runs at most "
            f"{max_num_seqs} sequences at once (max_num_seqs)"
        )
    if len(prompt_token_ids) >= max_model_len:  # first: O(1), before a pass over millions of ids
        raise InvalidRequest(
            f"the prompt has {len(prompt_token_ids)} tokens; this engine's context holds at most "
            f"{max_model_len} (prompt plus at least one new token)"
        )
    if any(not 0 <= t < vocab_size for t in prompt_token_ids):
        raise InvalidRequest(f"prompt token ids must be in [0, {vocab_size})")
    if any(t >= vocab_size for t in params.stop_token_ids):
        raise InvalidRequest(f"stop_token_ids must be in [0, {vocab_size})")
    if params.stop and not has_tokenizer:
        raise InvalidRequest("stop strings need a tokenizer, and this checkpoint has none")


def validate_session_prefix(prefix: list[int], vocab_size: int, max_model_len: int) -> None:
    """Raise InvalidRequest for a session prefix that leaves no room for a turn: the context must hold the
    prefix, a turn's input (at least one token) and at least one new token."""
    if any(not 0 <= t < vocab_size for t in prefix):
        raise InvalidRequest(f"prefix token ids must be in [0, {vocab_size})")
    if len(prefix) + 2 > max_model_len:
        raise InvalidRequest(
            f"the session prefix has {len(prefix)} tokens; this engine's context holds at most {max_model_len} "
            f"(the prefix, a turn's input and at least one new token: a prefix of at most {max_model_len - 2})"
        )
