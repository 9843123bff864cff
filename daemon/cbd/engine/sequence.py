"""Request and sequence state.

A request owns `n` candidates. Until its prompt is prefilled it has a single sequence (candidate 0)
that carries `pending_forks = n - 1`; when that sequence samples its first token, the engine forks
it into n sequences that share the prompt's KV blocks.

Invariant: `num_computed_tokens <= len(token_ids)`; tokens past `num_computed_tokens` have no KV yet.
A decoding sequence has exactly one uncomputed token (the one sampled last step).

Overlap: when a step that samples a sequence's next token is launched, a PLACEHOLDER is appended
at once (`num_placeholders` counts them, `pending_row` is its sampling row in that step), so the
next step can be scheduled before the token is known; the token replaces the placeholder when
the step completes.

Speculation: a step that verifies drafts appends them before the placeholder (`num_draft` of them);
they are inputs of the step but not known tokens until the step says which the model would have
produced itself: those stay, the rest are cut (see Scheduler.update_from_output). In the overlap loop
the step after a verifying one is booked as if every draft were kept (`next_rows`): when the verifying
step completes, the cut shifts that step's tokens and rows back by the drafts it rejected, and the
device has already placed them there from its own kept count (engine/device/draft_carry.py). So at
most two steps' tokens are unknown: [known][drafts + placeholder in flight][drafts + placeholder].
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from cbd.engine.kv.host_pool import HostCopy
from cbd.engine.sampling_params import SamplingParams

PLACEHOLDER = -1  # a token id still being sampled on the device


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # the engine failed while running it


@dataclass(slots=True)
class Sequence:
    seq_id: int
    request: Request
    candidate_index: int
    token_ids: list[int]
    num_prompt_tokens: int
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # A session turn whose history's KV is on the host tier (or a sequence set aside there): the host
    # tier restores it when the scheduler admits the sequence (then None). See kv/host_tier.py.
    host_prefix: HostCopy | None = None
    # After a restore, until the sequence runs: the host copy it came from (kept, so that setting it
    # aside again frees its GPU blocks without copying anything back).
    host_backup: HostCopy | None = None
    # Chained hashes of this sequence's full blocks, computed lazily; index i covers block i.
    block_hashes: list[int] = field(default_factory=list)
    # Leading blocks of block_table that BlockManager.commit has looked at (registered, or kept private as
    # a copy of a registered block): the next commit starts there, so a step costs O(new blocks), not
    # O(context). Whoever replaces or cuts block_table below it lowers it (kv/blocks.py, kv/host_tier.py).
    num_committed_blocks: int = 0
    pending_forks: int = 0
    num_placeholders: int = 0  # trailing tokens still being sampled by a step in flight
    pending_row: int = -1  # sampling row of the newest placeholder in the step that samples it
    # >= 0: that row is the first of the step's verifying group number pending_group, and the newest
    # placeholder is the token sampled after the drafts that group keeps (known on the device first).
    pending_group: int = -1
    # The rows booked for it in the step after a verifying one still in flight (positions as if every
    # draft were kept): moved back by the drafts that step rejects when it completes (Speculator.verify).
    next_rows: list[Any] | None = None
    final_in_flight: bool = False  # the token in flight is its last (length limit): schedule no more
    finish_reason: FinishReason | None = None
    num_draft: int = 0  # draft tokens being verified (in the steps in flight), each group right before its placeholder
    draft_index: Any = None  # the drafter's index of this sequence's n-grams (engine/spec/drafter.py)
    draft_retry_step: int = 0  # overlap mode: the step from which drafting is tried again after misses
    draft_misses: int = 0  # consecutive speculative steps with no draft, none accepted, or drafts declined
    draft_len: int = 0  # drafts to ask for next (0: the scheduler's starting length)
    # The chance a draft of it is kept: its recent verifications' average; None: the speculator's prior (spec/policy.py).
    draft_accept: float | None = None
    grammar: Any = None  # GrammarState: where the reply stands in its request's grammar (None: unconstrained)
    # Output-side state owned by the engine's output processor (detokenizer, stop matcher).
    output_state: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def num_known_tokens(self) -> int:
        return len(self.token_ids) - self.num_placeholders - self.num_draft

    def drop_placeholders(self) -> None:
        """Cut the tokens in flight (and drafts being verified) off."""
        if self.num_placeholders or self.num_draft:
            self.cut_after(self.num_known_tokens)

    def cut_after(self, end: int) -> None:
        """Keep token_ids[:end], all known: whatever is in flight after them (tokens, drafts, the rows
        booked after drafts) is dropped."""
        del self.token_ids[end:]
        self.num_placeholders = self.num_draft = 0
        self.next_rows = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def length_limit_reached(self, num_tokens: int, max_model_len: int) -> bool:
        """The length rule, written once: whether the token at index num_tokens - 1 is this
        sequence's last, by max_tokens or by the context length."""
        return num_tokens - self.num_prompt_tokens >= self.request.params.max_tokens or num_tokens >= max_model_len

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def seats(self) -> int:
        """Running slots this sequence will occupy once forked."""
        return 1 + self.pending_forks


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the effective seed: params.seed, or one drawn at submit
    arrival_time: float = field(default_factory=time.monotonic)
    sequences: list[Sequence] = field(default_factory=list)
    num_cached_prompt_tokens: int = 0
    prompt_cache_recorded: bool = False
    session: Any = None  # the engine Session this request is a turn of
    first_scheduled: float | None = None  # monotonic time of its first step
    # Scheduling (resolved when queued: the params', else the session's, else interactive), and when the
    # scheduler first queued it (its clock; the start of aging).
    priority: int = 0
    tenant: str = ""
    queued_at: float | None = None
    queue_reported: bool = False
    # Its outputs' StreamInterval (engine/stream_interval.py), made by the emitter at its first output; False:
    # each output goes on as it comes.
    gathering: Any = None

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.sequences)
