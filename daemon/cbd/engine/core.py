"""EngineCore: one engine step = plan, launch on the device, complete (read tokens, emit outputs).

    plan = scheduler.schedule()                     chunks, sample rows (forks included), booked as launched
    step = runner.launch(pack_step(plan, ...))      typed inputs in, device work enqueued; no requests
    scheduler.update_from_output(plan, tokens)      tokens in place of their placeholders
    then, per live row: detokenise, stop checks, finish; outputs delivered

Sync mode completes each step right after launching it. Overlap mode (the default on CUDA) keeps
one step in flight: step() plans and launches step N+1, then waits for step N's tokens and
processes them, so the CPU work of N+1 (scheduling, packing, staging) and of N (detokenising,
stop checks, streaming) runs while the GPU computes. The scheduler books a plan as launched when it
makes it (computed-token counts advance, forks are created, and every sampled sequence gets a
placeholder token that the device fills in: carry-over), so the next plan never waits for tokens.
Outputs of a sequence that finished or was aborted while a later step was already in flight are
discarded, never streamed.
Live requests are records in `live` (an `Admission`, the one registry; see live.py): a request is
reserved there before it is queued, and its record is released when it finishes, fails or is
aborted. Outputs for records with an `on_output` wait in an outbox until the owner calls
`deliver()`: the threaded engine first refreshes its stats snapshot, so a caller that has seen its
request finish never reads stats from before it.
Not thread-safe: the threaded Engine (engine.py) is the only caller of its mutating methods.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from dataclasses import dataclass, replace
from typing import Any, cast

import torch

from cbd.config import EngineConfig
from cbd.engine.admission import Admission
from cbd.engine.block_manager import BlockManager
from cbd.engine.cuda_graphs import verify_queries
from cbd.engine.drafter import NgramDrafter
from cbd.engine.host_pool import HostPool
from cbd.engine.kv_copier import HostTierMoves, KvCopier
from cbd.engine.live import LiveRequest, OutputCallback
from cbd.engine.output_processor import OutputProcessor
from cbd.engine.outputs import (
    CandidateDelta,
    EngineStats,
    HostTierStats,
    RequestOutput,
    SpeculationStats,
    TokenLogprob,
    Usage,
    merge_deltas,
)  # fmt: skip
from cbd.engine.runner import InflightStep, ModelRunner, SampledTokens
from cbd.engine.sampling_params import SamplingParams, validate_request
from cbd.engine.scheduler import SampleRow, Scheduler, StepPlan
from cbd.engine.sequence import FinishReason, Request, Sequence
from cbd.engine.sessions import SessionManager, TurnInput
from cbd.engine.step_inputs import pack_step
from cbd.engine.tp_messages import Setup
from cbd.errors import SettingError, UnknownRequest
from cbd.model import blas
from cbd.model.loader import LoadedModel

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Launched:
    """A step on the device: its plan (for the accounting at completion) and its device work."""

    plan: StepPlan
    step: InflightStep


class EngineCore:
    def __init__(
        self, loaded: LoadedModel, config: EngineConfig, tp_group: Any = None, live: Admission | None = None,
        detokenize: bool = True,
    ) -> None:  # fmt: skip
        """tp_group: rank 0's TensorParallelGroup when the model is sharded (its workers mirror every step).
        live: the registry of live requests (the threaded Engine's admission); uncapped when None.
        detokenize: False leaves the text of candidates without stop strings to the reader (OutputProcessor)."""
        self.config = config
        self.loaded = loaded
        spec = loaded.spec
        bs = config.block_size
        num_blocks = config.num_kv_blocks or max(
            2,
            int(config.kv_cache_gib * 2**30) // ModelRunner.kv_bytes_per_block(loaded.model, bs, config.kv_cache_dtype),
        )
        self.max_model_len = min(config.max_model_len or spec.max_position_embeddings, num_blocks * bs)
        self.block_manager = BlockManager(num_blocks, bs, config.enable_prefix_caching)
        graph_batch = min(config.cuda_graph_max_batch, config.max_num_seqs) if config.cuda_graphs else 0
        # Verifying steps get graphs up to the batch where speculation runs: auto's cap; with "ngram" at least
        # 8; never beyond 32 (each (batch, queries) graph keeps its own logits rows).
        verify_batch = 0
        if config.speculative == "auto":
            verify_batch = min(graph_batch, config.speculative_max_batch, 32)
        elif config.speculative == "ngram":
            verify_batch = min(graph_batch, max(config.speculative_max_batch, 8), 32)
        queries = verify_queries(config.num_speculative_tokens) if verify_batch else ()
        blas.select(config.blas_library, loaded.model.embed_tokens.weight.device)
        self.runner = ModelRunner(
            loaded.model, num_blocks, bs, self.max_model_len, config.attention_backend, graph_batch,
            config.kv_cache_dtype, verify_batch, queries,
        )  # fmt: skip
        # The host tier (not with tensor parallelism: each rank would have to move its own shard).
        num_host = 0
        if tp_group is None:
            block_bytes = ModelRunner.kv_bytes_per_block(loaded.model, bs, config.kv_cache_dtype)
            num_host = config.num_host_kv_blocks or 0
            if config.num_host_kv_blocks is None:
                num_host = config.host_kv_bytes(num_blocks * block_bytes) // block_bytes
        # The host memory first: a size the host cannot give fails here, naming the setting (by default,
        # the daemon goes on without a host tier instead).
        self.copier = None
        if num_host:
            try:
                self.copier = KvCopier(self.runner.kv_caches, bs, num_host, self.runner.streams)
            except SettingError as exc:
                if config.host_kv_gib is not None or config.num_host_kv_blocks is not None:
                    raise
                log.warning("no host KV tier: %s", exc)
                num_host = 0
        self.host_pool = HostPool(num_host) if num_host else None
        # With a host tier, idle sessions are copied out while 1/20 of the GPU pool is not free.
        self._free_target = max(1, num_blocks // 20)
        tier = (
            HostTierMoves(self.host_pool, self.copier, self.block_manager) if self.host_pool and self.copier else None
        )
        self.sessions = SessionManager(
            self.block_manager, config.max_sessions, config.session_ttl, self.host_pool,
            tier.offload if tier is not None else None, tier.keys if tier is not None else None,
        )  # fmt: skip
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, reclaim=self.sessions.evict,
            max_model_len=self.max_model_len, new_fork=self._fork, host_tier=tier,
            aging_seconds=config.priority_aging_seconds,
            drafter=NgramDrafter() if config.speculative != "off" else None,
            num_speculative_tokens=config.num_speculative_tokens,
        )  # fmt: skip
        if tp_group is not None:
            tp_group.broadcast(Setup(num_blocks, self.max_model_len, graph_batch, verify_batch, queries))
            self.runner.broadcast = tp_group.broadcast
        self.overlap = config.overlap_enabled(self.runner.device)
        self.scheduler.draft_backoff = self.overlap  # there, a step that finds no draft cost a synchronous step
        self._inflight: _Launched | None = None
        self._slow_grammars: list[Sequence] = []  # over their mask budget: ended before the next step
        self._gpu_busy_at, self._gpu_busy_value = 0.0, cast(float | None, None)
        self.outputs = OutputProcessor(loaded.tokenizer, loaded.eos_token_ids, self.max_model_len, detokenize)
        self.live = live if live is not None else Admission.unbounded()
        # Outputs made and not yet handed to their callbacks (see deliver); pairs, in order.
        self._outbox: list[tuple[LiveRequest, RequestOutput]] = []
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.host_tier_stats = HostTierStats()

    # ---- admission --------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequest for a request that can never run. Reads only config (safe from any thread)."""
        validate_request(
            prompt_token_ids, params, self.loaded.spec.vocab_size, self.max_model_len, self.loaded.tokenizer is not None
        )

    @property
    def requests(self) -> dict[str, LiveRequest]:
        """Live requests by id (read-only use)."""
        return self.live.live

    def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
        on_output: OutputCallback | None = None,
    ) -> Request:  # fmt: skip
        """Validate, reserve and queue a request (the threaded Engine does the first two in the caller's thread)."""
        self.validate(prompt_token_ids, params)
        live = self.live.reserve(request_id or f"req-{next(self._request_ids)}", len(prompt_token_ids), on_output)
        return self.start_request(live, prompt_token_ids, params)

    def start_request(self, live: LiveRequest, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        """Queue a request already validated and reserved in `live`."""
        return self._start(live, list(prompt_token_ids), params)

    def _start(
        self, live: LiveRequest, prompt: list[int], params: SamplingParams, block_table: list[int] | None = None,
        num_computed: int = 0, session: Any = None, host_prefix: tuple[list[int], int] | None = None,
    ) -> Request:  # fmt: skip
        """Create the request and its first sequence (starting from `block_table` KV, if any) and queue it."""
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        request = Request(live.request_id, prompt, params, seed)
        request.tenant = params.tenant
        if params.priority is not None:
            request.priority = params.priority
        elif session is not None:
            request.priority = session.priority
        seq = self._new_sequence(request, 0, list(prompt))
        seq.block_table, seq.num_computed_tokens = block_table or [], num_computed
        seq.host_prefix = host_prefix
        seq.pending_forks = params.n - 1
        live.request = request
        if session is not None:
            self.sessions.turn_started(session, request)
        self.scheduler.add(seq)
        return request

    def add_session_turn(
        self,
        session_id: str,
        tokens: list[int],
        params: SamplingParams,
        *,
        replace: bool = False,
        parent_candidate: int | None = None,
        request_id: str | None = None,
        on_output: OutputCallback | None = None,
        expected_idle: float | None = None,
        retention: int | None = None,
        extends: bool = False,
    ) -> Request:
        """Reserve and queue a turn of a session (see start_turn; expected_idle, retention, extends: TurnInput's)."""
        live = self.live.reserve(request_id or f"req-{next(self._request_ids)}", len(tokens), on_output)
        turn = TurnInput(tokens, replace, parent_candidate, expected_idle, retention, extends)
        try:
            return self.start_turn(live, session_id, turn, params)
        except BaseException:
            self.live.release(live.request_id)
            raise

    def start_turn(self, live: LiveRequest, session_id: str, turn: TurnInput, params: SamplingParams) -> Request:
        """A turn of a session, reserved in `live`: its prompt is the history plus the turn's tokens (or,
        with `replace`, the re-rendered conversation); its first sequence starts from the session's
        resident KV. Raises UnknownSession, SessionBusy, InvalidRequest and changes nothing then."""
        session = self.sessions.get(session_id)
        start = self.sessions.begin_turn(session, turn, lambda prompt: self.validate(prompt, params))
        host_prefix = (start.host_table, start.host_tokens) if start.host_table else None
        request = self._start(live, start.prompt, params, start.block_table, start.num_computed, session, host_prefix)
        request.sequences[0].draft_index = start.draft_index
        return request

    def abort_request(self, request_id: str) -> RequestOutput:
        live = self.live.get(request_id)
        if live is None or live.request is None:
            raise UnknownRequest(f"no live request with id {request_id!r}")
        return self._fail(live.request, FinishReason.ABORT)

    # ---- the step ---------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    def warm_up(self) -> None:
        """Capture CUDA graphs and compile kernels; call before serving."""
        self.runner.warm_up()

    def step(self) -> list[RequestOutput]:
        outputs = self._end_slow_grammars()
        speculate = self._speculate()
        if speculate and self._inflight is not None:  # drafts follow known tokens: complete the step in flight
            drained, self._inflight = self._inflight, None
            outputs += self._complete(drained)
        launched = None
        if self.scheduler.has_work():
            plan = self.scheduler.schedule(speculate)
            if plan:
                launched = self._launch(plan)
            if self.scheduler.restoring:  # after the launch: its block copies read before restores write
                self.scheduler.issue_restores()
        if not self.overlap or (launched is not None and launched.plan.speculative):
            # Synchronous: without overlap always; with drafts, the next plan depends on how many are kept.
            return outputs + (self._complete(launched) if launched is not None else [])
        previous, self._inflight = self._inflight, launched
        outputs += self._complete(previous) if previous is not None else []
        if launched is not None and launched.step.pending is not None:
            # Constrained rows: the forward of this step is on the device already; its sampling waits
            # for the masks, which need the previous step's tokens (just accepted by the grammars).
            self.runner.sample_masked(launched.step, self._masks(launched.plan))
        return outputs

    def _speculate(self) -> bool:
        """Whether this step may verify drafts: speculation on, the batch small enough for "auto" and, in
        overlap mode (where it costs a synchronous step), some running sequence due to try."""
        scheduler = self.scheduler
        running = scheduler.running
        if scheduler.drafter is None or not running:
            return False
        if self.config.speculative == "auto" and len(running) > self.config.speculative_max_batch:
            return False
        return not self.overlap or any(scheduler.can_speculate(seq) for seq in running)

    def fail_all(self, reason: FinishReason) -> list[RequestOutput]:
        if self._inflight is not None:
            step, self._inflight = self._inflight, None
            try:
                self.runner.wait(step.step)  # let the device finish before its blocks are released
            except Exception:
                log.exception("the step in flight failed too")
        return [self._fail(live.request, reason) for live in list(self.live.live.values()) if live.request is not None]

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            # Candidates: a fan-out's parent counts for the n it becomes once its prompt is computed.
            num_running=sum(seq.seats for seq in self.scheduler.running),
            num_waiting=sum(seq.seats for seq in self.scheduler.waiting),
            num_blocks=bm.num_blocks,
            num_blocks_used=bm.num_used_blocks,
            num_blocks_free=bm.num_free_blocks,
            num_blocks_cached=bm.num_cached_free_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            num_priority_preemptions=self.scheduler.num_priority_preemptions,
            num_steps=self.num_steps,
            num_generated_tokens=self.num_generated_tokens,
            num_sessions=len(self.sessions.sessions),
            num_session_evictions=self.sessions.num_evictions,
            gpu_busy=self._gpu_busy(),
            host=self._host_stats(),
            speculation=SpeculationStats(
                self.scheduler.num_speculative_steps,
                self.scheduler.num_draft_tokens,
                self.scheduler.num_accepted_tokens,
            ),  # fmt: skip
        )

    def _host_stats(self) -> HostTierStats | None:
        if self.host_pool is None or self.copier is None:
            return None
        stats = self.host_tier_stats
        for seconds in self.copier.drain_latencies():
            stats.observe_restore(seconds)
        stats.num_blocks, stats.num_blocks_used = self.host_pool.num_blocks, self.host_pool.num_used_blocks
        stats.bytes_per_block = self.copier.bytes_per_block
        stats.num_offloaded_blocks = self.sessions.num_offloaded_blocks + self.scheduler.num_set_aside_blocks
        stats.num_restored_blocks = self.scheduler.num_restored_blocks
        stats.num_restored_tokens = self.scheduler.num_restored_tokens
        stats.num_host_evictions = self.sessions.num_host_evictions
        stats.session_hits = dict(self.sessions.hits)
        return replace(stats, restore_buckets=list(stats.restore_buckets), session_hits=dict(stats.session_hits))

    def check_integrity(self) -> None:
        """The block manager's invariants, with every holder of a reference: live sequences, sessions'
        histories and pending branches (tests call this after every step)."""
        holders = [seq.block_table for live in self.live.live.values() if live.request is not None
                   for seq in live.request.sequences]  # fmt: skip
        for session in self.sessions.sessions.values():
            holders.append(session.block_table)
            holders.extend(b.block_table for b in session.branches)
        self.block_manager.check_integrity(holders)
        if self.host_pool is not None:
            host = self.sessions.host_holders()
            host += [seq.host_prefix[0] for live in self.live.live.values() if live.request is not None
                     for seq in live.request.sequences if seq.host_prefix is not None]  # fmt: skip
            host += [r.host_ids for r in self.scheduler.restoring]
            host += [seq.host_backup[0] for live in self.live.live.values() if live.request is not None
                     for seq in live.request.sequences if seq.host_backup is not None]  # fmt: skip
            self.host_pool.check_integrity(host)

    def _gpu_busy(self) -> float | None:
        now = time.monotonic()
        if now - self._gpu_busy_at > 1.0:  # reading events costs a little: at most once a second
            self._gpu_busy_at, self._gpu_busy_value = now, self.runner.gpu_busy_fraction()
        return self._gpu_busy_value

    # ---- internals --------------------------------------------------------------------------
    def _launch(self, plan: StepPlan) -> _Launched:
        """Launch a planned (and already booked) step. A step with constrained rows is launched with
        their token masks (sync: every grammar is up to date) or with its sampling deferred (overlap:
        the grammars still wait for the tokens of the step in flight; see step())."""
        batch = pack_step(plan, self.runner.graph_bucket, self.runner.scratch_block)
        if plan.fences and self.copier is not None:  # it reuses GPU blocks a copy to the host still reads
            self.copier.fence_compute(plan.fences)
        if any(row.target.grammar is not None for row in plan.samples):
            if self.overlap and not plan.speculative:  # (a plan with drafts follows a completed step)
                batch.defer_sample = True
            else:
                batch.masks = self._masks(plan)
        step = self.runner.launch(batch)
        self.num_steps += 1
        if self.host_pool is not None:  # keep some GPU blocks free ahead of need (see offload_ahead)
            self.sessions.offload_ahead(self._free_target)
        return _Launched(plan, step)

    def _masks(self, plan: StepPlan) -> torch.Tensor:
        """[rows, ceil(vocab / 32)] int32 bitmask of each sample row's allowed tokens (all for rows
        without a grammar, and for rows whose sequence ended while this step was being prepared)."""
        masks = self.runner.mask_buffer(len(plan.samples))
        skip = 0
        for i, row in enumerate(plan.samples):
            if skip:  # a verifying row, filled with the first of its group
                skip -= 1
                continue
            state, seq = row.target.grammar, row.target
            if row.num_draft:
                skip = row.num_draft
            if state is None or state.finished or seq.is_finished:
                continue
            started = time.perf_counter()
            if row.num_draft:  # rows after the last known token and after each draft
                state.fill_drafted(masks, i, seq.token_ids[row.position : row.position + row.num_draft])
            else:
                state.fill(masks, i)
            budget = self.config.grammar_mask_budget_ms / 1000 * (1 + row.num_draft)
            if state.over_budget(time.perf_counter() - started, budget) == self.config.grammar_mask_budget_steps:
                self._slow_grammars.append(seq)
        return masks

    def _end_slow_grammars(self) -> list[RequestOutput]:
        """End with ERROR (between steps, as an abort) the requests whose masks took longer than
        grammar_mask_budget_ms in grammar_mask_budget_steps consecutive steps: a grammar whose mask costs
        grow with its length (an ambiguous EBNF) would otherwise slow every sequence of the batch."""
        outputs = []
        for seq in self._slow_grammars:
            if seq.request.is_finished:
                continue
            cfg = self.config
            out = self._fail(seq.request, FinishReason.ERROR)
            out.error = (
                f"grammar too expensive: filling its token mask took over {cfg.grammar_mask_budget_ms:g} ms "
                f"in {cfg.grammar_mask_budget_steps} steps in a row (grammar_mask_budget_ms)"
            )  # fmt: skip
            log.warning("request %s: %s", seq.request.request_id, out.error)
            outputs.append(out)
        self._slow_grammars.clear()
        return outputs

    def _complete(self, launched: _Launched) -> list[RequestOutput]:
        sampled = self.runner.wait(launched.step)
        plan = launched.plan
        deltas: dict[str, tuple[Sequence, list[CandidateDelta]]] = {}
        for i in self.scheduler.update_from_output(plan, sampled.token_ids):
            row = plan.samples[i]
            seq = row.target
            if seq.is_finished:  # it stopped at an earlier token of the drafts it kept: nothing past it
                continue
            delta = self.outputs.on_token(seq, row.position, _logprob(sampled, row, i))
            self.num_generated_tokens += 1
            if delta.finish_reason is not None:
                del seq.token_ids[row.position + 1 :]  # a token already in flight for it is dropped
                seq.num_placeholders = 0
                if seq.request.session is not None:  # keep its KV for the session's next turn
                    self.sessions.candidate_finished(seq.request.session, seq)
                self.scheduler.finish(seq)
                delta.usage = self._usage(seq.request, seq.num_output_tokens)
            deltas.setdefault(seq.request.request_id, (seq, []))[1].append(delta)
        return [self._output(seq.request, merge_deltas(ds)) for seq, ds in deltas.values()]

    def _fork(self, parent: Sequence, candidate: int, token_ids: list[int]) -> Sequence:
        """The scheduler's fan-out hook: a new candidate of parent's request (its blocks are the scheduler's)."""
        return self._new_sequence(parent.request, candidate, token_ids)

    def _new_sequence(self, request: Request, candidate: int, token_ids: list[int]) -> Sequence:
        seq = Sequence(next(self._seq_ids), request, candidate, token_ids, len(request.prompt_token_ids))
        if request.params.grammar is not None:
            # Forks are made before the parent's first token: every candidate starts the grammar afresh.
            seq.grammar = request.params.grammar.new_state()
        request.sequences.append(seq)
        self.outputs.attach(seq)
        return seq

    def _fail(self, request: Request, reason: FinishReason) -> RequestOutput:
        deltas = []
        for seq in request.sequences:
            if not seq.is_finished:
                seq.drop_placeholders()
                self.scheduler.finish(seq)
                seq.finish_reason = reason
                usage = self._usage(request, seq.num_output_tokens)
                deltas.append(CandidateDelta(seq.candidate_index, [], "", None, reason, usage))
            for c in range(seq.candidate_index + 1, seq.candidate_index + 1 + seq.pending_forks):
                deltas.append(CandidateDelta(c, [], "", None, reason, self._usage(request, 0)))
            seq.pending_forks = 0
        return self._output(request, deltas)

    def _output(self, request: Request, deltas: list[CandidateDelta]) -> RequestOutput:
        out = RequestOutput(request.request_id, deltas)
        if not request.queue_reported and request.first_scheduled is not None:
            out.queue_seconds = request.first_scheduled - request.arrival_time
            out.priority = request.priority
            request.queue_reported = True
        if request.is_finished:
            if request.session is not None:
                ok = all(sq.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) for sq in request.sequences)
                self.sessions.end_turn(request.session, request, ok and len(request.sequences) == request.params.n)
            out.finished = True
            out.usage = self._usage(request, sum(s.num_output_tokens for s in request.sequences))
            live = self.live.release(request.request_id)
        else:
            live = self.live.get(request.request_id)
        if live is not None and live.on_output is not None:
            self._outbox.append((live, out))
        return out

    def deliver(self) -> None:
        """Hand the outputs made since the last call to their requests' callbacks, in order."""
        outbox, self._outbox = self._outbox, []
        for live, out in outbox:
            try:
                live.on_output(out)  # type: ignore[misc]
            except Exception:
                log.exception("output callback for %s failed", live.request_id)

    @staticmethod
    def _usage(request: Request, completion_tokens: int) -> Usage:
        return Usage(len(request.prompt_token_ids), request.num_cached_prompt_tokens, completion_tokens)


def _logprob(sampled: SampledTokens, row: SampleRow, i: int) -> TokenLogprob | None:
    if sampled.logprobs is None:
        return None
    want = row.source.request.params.logprobs
    if want is None:
        return None
    top = []
    if want and sampled.top_ids is not None and sampled.top_logprobs is not None:
        top = list(zip(sampled.top_ids[i][:want], sampled.top_logprobs[i][:want]))
    return TokenLogprob(sampled.token_ids[i], sampled.logprobs[i], top)
