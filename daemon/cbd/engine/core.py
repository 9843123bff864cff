"""EngineCore: one engine step = plan, launch on the device, complete (read tokens, emit outputs).

    plan = scheduler.schedule()                     chunks, sample rows (forks included), booked as launched
    step = runner.launch(pack_step(plan, ...))      typed inputs in, device work enqueued; no requests
    runner.sample_masked(step, masks)               only with constrained rows (grammar_masks.py)
    scheduler.update_from_output(plan, tokens)      tokens in place of their placeholders
    emitter.tokens(...)                             per live row: detokenise, stop checks, finish (emitter.py)

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
aborted. Outputs for records with an `on_output` wait in the emitter's outbox until the owner calls
`deliver()`: the threaded engine first refreshes its stats snapshot, so a caller that has seen its
request finish never reads stats from before it. What the core is built from: build.py; stats: stats.py.
Not thread-safe: the threaded Engine (engine.py) is the only caller of its mutating methods.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any

from cbd.config import EngineConfig
from cbd.engine.admission import Admission
from cbd.engine.build import build_parts
from cbd.engine.device.block_tables import BlockTableRows
from cbd.engine.device.runner import InflightStep
from cbd.engine.device.step_inputs import pack_step
from cbd.engine.device.token_rows import TokenRows
from cbd.engine.emitter import Emitter
from cbd.engine.grammar.masks import GrammarMasks
from cbd.engine.kv.host_pool import HostCopy
from cbd.engine.live import LiveRequest, OutputCallback
from cbd.engine.output_processor import OutputProcessor
from cbd.engine.outputs import EngineStats, RequestOutput
from cbd.engine.sampling_params import SamplingParams, validate_request
from cbd.engine.sched.plan import StepPlan
from cbd.engine.sequence import FinishReason, Request, Sequence
from cbd.engine.sessions.records import TurnInput
from cbd.engine.spec import policy
from cbd.engine.spec.policy import StepCosts
from cbd.engine.stats import StatsReader
from cbd.engine.step_phases import BOOK, EMIT, LAUNCH, MASK, SCHEDULE, WAIT, StepPhases
from cbd.errors import UnknownRequest
from cbd.model.loader import LoadedModel

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Launched:
    """A step on the device: its plan (for the accounting at completion) and its device work."""

    plan: StepPlan
    step: InflightStep
    graph: tuple[int, int] | None = None  # the CUDA graph (batch, tokens) it ran, if any


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
        parts = build_parts(loaded, config, tp_group, self._fork)
        self.max_model_len = parts.max_model_len
        self.block_manager, self.runner, self.host_tier = parts.block_manager, parts.runner, parts.host_tier
        self.sessions, self.scheduler, self.overlap = parts.sessions, parts.scheduler, parts.overlap
        self.checkpoints = parts.checkpoints
        self._free_target = parts.free_target
        self.live = live if live is not None else Admission.unbounded()
        processor = OutputProcessor(loaded.tokenizer, loaded.eos_token_ids, self.max_model_len, detokenize)
        self.emitter = Emitter(processor, self.live, self.scheduler, self.sessions)
        self.grammar_masks = GrammarMasks(
            self.runner.mask_buffer, config.grammar_mask_budget_ms, config.grammar_mask_budget_steps
        )
        self._stats = StatsReader(
            self.scheduler, self.sessions, self.host_tier, self.runner,
            self.checkpoints.disk if self.checkpoints is not None else None,
        )  # fmt: skip
        # Rows of the device's block table (device/block_tables.py): one more than a step's sequences, and padding's.
        self.tables = BlockTableRows(config.max_num_seqs + 2, self.runner.table_columns, self.runner.scratch_block)
        # The device's token table, the same rows (device/token_rows.py), where it drafts in the overlap loop.
        device_drafts = self.overlap and config.speculative_device_drafts and config.speculative != "off"
        self.tokens = TokenRows(self.tables.num_rows) if device_drafts else None
        self.scheduler.speculator.device_drafts = device_drafts
        self.phases = StepPhases()  # where each step's host time goes (the engine loop starts and files it)
        self._inflight: _Launched | None = None
        # The graph of the one step completed since the last deliver() (None: none, or more than one: their
        # outputs are not one step's), whose host time for handing its outputs over deliver() then times.
        self._delivered_graph: tuple[int, int] | None = None
        self._completed = False
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        self.num_steps = 0

    # ---- intake --------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequest for a request that can never run. Reads only config (safe from any thread)."""
        validate_request(
            prompt_token_ids, params, self.loaded.spec.vocab_size, self.max_model_len, self.loaded.tokenizer is not None,
            self.config.max_num_seqs,
        )  # fmt: skip

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
        num_computed: int = 0, session: Any = None, host_prefix: HostCopy | None = None,
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
        request = self._start(live, start.prompt, params, start.block_table, start.num_computed, session, start.host)
        request.sequences[0].draft_index = start.draft_index
        return request

    def abort_request(self, request_id: str) -> RequestOutput:
        live = self.live.get(request_id)
        if live is None or live.request is None:
            raise UnknownRequest(f"no live request with id {request_id!r}")
        return self.emitter.fail(live.request, FinishReason.ABORT)

    # ---- the step ---------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    def warm_up(self) -> None:
        """Capture CUDA graphs and compile kernels; call before serving. With speculation "auto" and
        verifying graphs (one process), time the graphs for the speculation policy (spec/policy.py)."""
        self.runner.warm_up()
        graphs = self.runner.graphs
        sharded = self.runner.broadcast is not None  # graphs replay with the workers only: none timed alone
        if self.config.speculative == "auto" and graphs is not None and graphs.verify_buckets and not sharded:
            costs = StepCosts(graphs.measure(), graphs.max_queries - 1, overlap=self.overlap)
            self.scheduler.speculator.costs = costs
            plain = {}  # per verifying bucket: its plain step's cost (decode graphs reach past every verifying bucket)
            for b in costs.batches:
                d = costs.plain_bucket(b)
                assert d is not None
                plain[b] = costs.costs[d, d]
            log.info("speculation: verifying-step costs over the decode step of the same batch (batch: tokens: "
                     "ratio) %s", {b: {t: round(costs.costs[b, t] / plain[b], 2) for t in costs.tokens[b]}
                                   for b in costs.batches})  # fmt: skip

    def step(self) -> list[RequestOutput]:
        """Launch step N+1, complete step N (in flight since the last call), then sample N+1 under its rows'
        token masks if it has constrained rows (the masks need N's tokens, now accepted by the grammars).
        N+1 may verify drafts made after a guess of N's tokens (spec/speculator.py). Synchronous (no overlap;
        or a constrained sequence drafts, which needs its tokens known): N is completed before N+1 is
        planned and N+1 before returning, so no step is ever in flight at the next call."""
        outputs = self._end_slow_grammars()
        self.phases.lap(EMIT)
        speculator = self.scheduler.speculator
        speculate = speculator.worth_trying(self.scheduler.running, self.overlap)
        sync = not self.overlap or (speculate and speculator.needs_known_tokens(self.scheduler.running))
        if sync and self._inflight is not None:  # drafts follow known tokens: complete the step in flight
            drained, self._inflight = self._inflight, None
            outputs += self._complete(drained)
        began = time.perf_counter()
        launched = self._launch_next(speculate)
        launching = time.perf_counter() - began
        previous, self._inflight = self._inflight, launched
        if previous is not None:
            outputs += self._complete(previous)
        if launched is not None:
            if launched.step.pending is not None:  # constrained rows: the forward is on the device already
                began = time.perf_counter()
                self.runner.sample_masked(launched.step, self.grammar_masks.fill(launched.plan))
                launching += time.perf_counter() - began
                self.phases.lap(MASK)
            if speculator.costs is not None and launched.graph is not None:
                speculator.costs.observe_host(*launched.graph, policy.LAUNCH, 1e3 * launching)
            if sync:
                self._inflight = None
                outputs += self._complete(launched)
        return outputs

    def _launch_next(self, speculate: bool) -> _Launched | None:
        """Schedule the next step and launch it (None: nothing to run), then start the host tier's restores."""
        if not self.scheduler.has_work():
            return None
        plan = self.scheduler.schedule(speculate)
        self.phases.lap(SCHEDULE)
        launched = self._launch(plan) if plan else None
        self.phases.lap(LAUNCH)
        self.scheduler.issue_restores()  # after the launch: its block copies read before restores write
        self.phases.lap(SCHEDULE)
        return launched

    def _launch(self, plan: StepPlan) -> _Launched:
        """Launch a planned (and already booked) step: its forward, and its sampling unless it has constrained
        rows (those wait for their masks: `runner.sample_masked`, see step())."""
        try:
            batch = pack_step(plan, self.runner.graph_bucket, self.tables, self.tokens)
            if plan.fences and self.host_tier is not None:  # it reuses GPU blocks a copy to the host still reads
                self.host_tier.fence_compute(plan.fences)
            step = self.runner.launch(batch)
        except BaseException:
            self.tables.invalidate()  # its table writes may not have reached the device
            if self.tokens is not None:
                self.tokens.invalidate()
            raise
        self.num_steps += 1
        if self.host_tier is not None:  # keep some GPU blocks free ahead of need (see offload_ahead)
            self.sessions.eviction.offload_ahead(self._free_target)
        return _Launched(plan, step, (batch.meta.batch, batch.meta.graph_tokens) if batch.meta.graph else None)

    def _complete(self, launched: _Launched) -> list[RequestOutput]:
        """Wait for a launched step's tokens, book them, and emit the outputs of its live rows."""
        assert launched.step.pending is None, "a step with constrained rows is sampled before it completes"
        phases = self.phases
        sampled = self.runner.wait(launched.step)
        waited = time.perf_counter()
        costs, timing = self.scheduler.speculator.costs, launched.step.timing
        if costs is not None and launched.graph is not None and timing is not None and timing[1].query():
            costs.observe(*launched.graph, timing[0].elapsed_time(timing[1]))  # the step's whole device time
        phases.lap(WAIT)
        rows = self.scheduler.update_from_output(launched.plan, sampled.token_ids, sampled.drafts)
        phases.lap(BOOK)
        outputs = self.emitter.tokens(launched.plan, sampled, rows)
        phases.lap(EMIT)
        if costs is not None and launched.graph is not None:  # its host work after the wait
            costs.observe_host(*launched.graph, policy.COMPLETE, 1e3 * (time.perf_counter() - waited))
        self._delivered_graph = None if self._completed else launched.graph
        self._completed = True
        return outputs

    def _end_slow_grammars(self) -> list[RequestOutput]:
        """End with ERROR, between steps as an abort, the requests whose grammar went over its mask budget."""
        outputs = []
        for seq in self.grammar_masks.take_over_budget():
            if seq.request.is_finished:
                continue
            out = self.emitter.fail(seq.request, FinishReason.ERROR, self.grammar_masks.error())
            log.warning("request %s: %s", seq.request.request_id, out.error)
            outputs.append(out)
        return outputs

    def _fork(self, parent: Sequence, candidate: int, token_ids: list[int]) -> Sequence:
        """The scheduler's fan-out hook: a new candidate of parent's request (its blocks are the scheduler's)."""
        return self._new_sequence(parent.request, candidate, token_ids)

    def _new_sequence(self, request: Request, candidate: int, token_ids: list[int]) -> Sequence:
        seq = Sequence(next(self._seq_ids), request, candidate, token_ids, len(request.prompt_token_ids))
        if request.params.grammar is not None:
            # Forks are made before the parent's first token: every candidate starts the grammar afresh.
            seq.grammar = request.params.grammar.new_state()
        request.sequences.append(seq)
        self.emitter.processor.attach(seq)
        return seq

    # ---- ending, stats, checks ------------------------------------------------------------------
    def fail_all(self, reason: FinishReason) -> list[RequestOutput]:
        self._delivered_graph = None  # what is delivered next is no step's outputs
        if self._inflight is not None:
            step, self._inflight = self._inflight, None
            try:
                self.runner.wait(step.step)  # let the device finish before its blocks are released
            except Exception:
                log.exception("the step in flight failed too")
        requests = [live.request for live in list(self.live.live.values()) if live.request is not None]
        return [self.emitter.fail(request, reason) for request in requests]

    def deliver(self) -> None:
        """Hand the outputs made since the last call to their requests' callbacks, in order."""
        costs, graph = self.scheduler.speculator.costs, self._delivered_graph
        self._delivered_graph, self._completed = None, False
        if costs is None or graph is None:
            self.emitter.deliver()
            return
        began = time.perf_counter()
        self.emitter.deliver()
        costs.observe_host(*graph, policy.DELIVER, 1e3 * (time.perf_counter() - began))

    def stats(self) -> EngineStats:
        return self._stats.read(self.num_steps, self.emitter.num_generated_tokens, self.phases.snapshot())

    def check_integrity(self) -> None:
        """The block manager's invariants, with every holder of a reference: live sequences, sessions'
        histories and pending branches, saves not gathered yet (tests call this after every step)."""
        holders = [seq.block_table for live in self.live.live.values() if live.request is not None
                   for seq in live.request.sequences]  # fmt: skip
        for session in self.sessions.sessions.values():
            holders.append(session.block_table)
            holders.extend(b.block_table for b in session.branches)
        if self.checkpoints is not None:
            holders.extend(self.checkpoints.held_blocks())
        self.block_manager.check_integrity(holders)
        if self.host_tier is not None:
            copies = self.sessions.host_copies()
            copies += [c for live in self.live.live.values() if live.request is not None
                       for seq in live.request.sequences for c in (seq.host_prefix, seq.host_backup) if c is not None]  # fmt: skip
            if self.checkpoints is not None:
                copies += self.checkpoints.loads.load_copies()
            self.host_tier.check_integrity(copies)
