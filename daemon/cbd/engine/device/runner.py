"""ModelRunner: turns a packed step (`StepBatch`) into device work (`launch`) and hands back its tokens (`wait`).

It knows no requests: the step arrives packed (step_inputs.pack_step) with typed metadata, and
what comes back is one token per sample row. Owns the KV pool
`[layers, (num_blocks + 1) * block_size, 2, kv_heads, head_dim]` (FP8: `[layers, slots, slot bytes]`,
see kv_format.py; the last block is a scratch block
that padded graph rows write to), the attention backend, the decode CUDA graphs and the three
streams. `launch` stages the step (double-buffered) and enqueues on the compute stream:
copy-on-write block copies, carry-over, forward, sampling; then the d2h copy of the sampled tokens.
It returns at once; `wait` blocks on that copy's event. A step with constrained rows (`meta.masked`)
takes one more call: `launch` enqueues its forward only, and `sample_masked(step, masks)` its sampling
under the rows' token masks, once the caller has filled them (the one way masks reach the sampler).

Carry-over: a sequence scheduled while its previous token is still being sampled by the step in
flight has input id 0 there; it is filled on the GPU from that step's sampled-token tensor
(`carry_dst`/`carry_src`), so step N+1 needs nothing from step N's host side; after drafts in flight,
from the row their kept count names, with the chunk moved back by those rejected (draft_carry.py);
then a verifying step's drafts are looked up again in the real context (draft_lookup.py), and the
drafts it verified go back to the host with its tokens (`SampledTokens.drafts`).

A chunk that ends a prompt with pending forks has one sample row per candidate, all reading the
same logits row (prefill once, then fork: `row_logits`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from cbd.engine.device.cuda_graphs import DecodeGraphs
from cbd.engine.device.draft_carry import DraftCarry
from cbd.engine.device.draft_lookup import DraftLookup
from cbd.engine.device.sampler import SampleResult, SamplingBatch, sample
from cbd.engine.device.step_inputs import InputStager, StagedStep, StepBatch, StepMeta, StepTensors
from cbd.engine.device.streams import DeviceStreams
from cbd.engine.device.token_masks import TokenMasks
from cbd.engine.device.tp_messages import RunStep, SampleStep, WarmUp, WorkerMessage
from cbd.model import kv_format
from cbd.model.attention import BatchLayout, sampled_layout, slot_mapping
from cbd.model.attention_backends import AttentionBackend, PreparedAttention, select_backend
from cbd.model.flash_attention import GATHER_MIN_QUERIES
from cbd.model.llama import CausalLM

# A step whose rows that sample nothing (prefill chunks) number at least this runs its last layer past the K/V on
# the sampled rows alone: the skipped rows' share of one layer, against the host's cost of one more metadata.
LAST_LAYER_MIN_SKIPPED = 256


@dataclass(slots=True)
class PendingSample:
    """A launched forward whose sampling waits for its rows' token masks (`sample_masked`)."""

    logits: torch.Tensor  # [R, V] the rows to sample
    tensors: StepTensors
    meta: StepMeta
    staged: StagedStep


@dataclass(slots=True)
class InflightStep:
    """A launched step. Holds every tensor its device work touches until `wait` has passed its event."""

    num_rows: int
    sampled: torch.Tensor | None  # [R] int64 on the device (the next step's carry-over source)
    host: SampleResult | None  # pinned host copies, valid once `done` has passed
    done: torch.cuda.Event | None
    keep: list = field(default_factory=list)
    pending: PendingSample | None = None  # set while its sampling waits for masks
    timing: tuple | None = None  # (start, end) CUDA events of its compute-stream work (one launch, unmasked)
    drafts: torch.Tensor | None = None  # the drafts it verified, where the device drafted some (host copy)


@dataclass(slots=True)
class SampledTokens:
    """A completed step's samples on the host, one entry per sample row."""

    token_ids: list[int]
    logprobs: list[float] | None
    top_ids: list[list[int]] | None
    top_logprobs: list[list[float]] | None
    # Where the device drafted for some verifying group (device/draft_lookup.py): every group's drafts, [G * D]
    # as the step's `verify_ids` lay them out.
    drafts: list[int] | None = None


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        attention_backend: str = "auto",
        cuda_graph_max_batch: int = 0,
        kv_cache_dtype: str = "auto",
        verify_graph_batch: int = 0,
        verify_queries: int = 1,  # the most tokens a sequence brings to a verifying graph (1 + drafts)
    ) -> None:
        spec = model.spec
        self.model = model
        self.block_size = block_size
        self.device = model.embed_tokens.weight.device
        self.scratch_block = num_blocks
        fp8 = kv_cache_dtype == "fp8"
        shape = kv_format.pool_shape((num_blocks + 1) * block_size, spec.num_kv_heads, spec.head_dim, fp8)
        dtype = torch.uint8 if fp8 else model.embed_tokens.weight.dtype
        self.kv_caches = torch.zeros(spec.num_layers, *shape, dtype=dtype, device=self.device)
        self.backend: AttentionBackend = select_backend(
            attention_backend, self.device, model.embed_tokens.weight.dtype, block_size, spec.sliding_window,
            spec.num_kv_heads, fp8, spec.head_dim,
        )  # fmt: skip
        self.streams = DeviceStreams(self.device)
        self.stager = InputStager(self.streams)
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        # Block-table columns a sequence can need: its context (drafts never take it past max_model_len).
        self.table_columns = self.max_blocks_per_seq
        self._tables: torch.Tensor | None = None  # the persistent block table (block_tables.py), made at first use
        self.graphs: DecodeGraphs | None = None
        if cuda_graph_max_batch > 0 and self.streams.cuda and self.backend.supports_cuda_graphs:
            assert self.streams.compute is not None
            self.graphs = DecodeGraphs(
                model, self.kv_caches, self.backend, block_size, cuda_graph_max_batch, self.max_blocks_per_seq,
                self.scratch_block, self.streams.compute, verify_graph_batch, verify_queries,
            )  # fmt: skip
        self._last_sampled: torch.Tensor | None = None
        self.draft_carry = DraftCarry()  # kept drafts on the device, for the step after a verifying one
        self.draft_lookup = DraftLookup(self.device)  # drafts in the verifying step's real context
        # The logits rows are the whole vocabulary, also on a tensor-parallel rank whose spec is its shard's.
        self.masks = TokenMasks(self.streams, model.full_vocab_size)
        # Tensor parallelism: sends each step (and warm-up) to the worker ranks before running it here.
        self.broadcast: Callable[[WorkerMessage], None] | None = None
        # Every launch appends (start, end) CUDA events bracketing its compute-stream work: the last 64
        # steps on CUDA (the GPU-busy gauge); a benchmark may put a plain list here to keep them all.
        self.step_events: deque | list | None = deque(maxlen=64) if self.streams.cuda else None

    def gpu_busy_fraction(self) -> float | None:
        """Device time of the recent steps' work over the wall time they span (None on CPU / no steps)."""
        events = [e for e in list(self.step_events or []) if e[1].query()]
        if len(events) < 2:
            return None
        span = events[0][0].elapsed_time(events[-1][1])
        return min(1.0, sum(a.elapsed_time(b) for a, b in events) / span) if span > 0 else None

    @staticmethod
    def kv_bytes_per_block(model: CausalLM, block_size: int, kv_cache_dtype: str = "auto") -> int:
        spec = model.spec
        itemsize = model.embed_tokens.weight.element_size()
        per_token = kv_format.bytes_per_token(spec.num_kv_heads, spec.head_dim, itemsize, kv_cache_dtype == "fp8")
        return spec.num_layers * block_size * per_token

    def warm_up(self) -> None:
        """Compile every kernel variant a step can need and capture the decode and verifying graphs, so that the
        first requests after the daemon reports SERVING pay no JIT compilation."""
        if self.broadcast is not None:
            self.broadcast(WarmUp())
        if self.streams.cuda:
            self._warm_eager()
        if self.graphs is not None and not self.graphs.graphs:
            self.graphs.capture()

    @torch.inference_mode()
    def _warm_eager(self) -> None:
        """Eager forwards of each kernel shape class (decode, short and long extends) on the scratch block."""
        bs, scratch = self.block_size, self.scratch_block
        with self.streams.on(self.streams.compute):
            # Query lengths per sequence. FA4 compiles apart: 16 queries x a GQA group in one tile; 100 x a
            # group of 2+ past one tile; 160, whole tiles of queries per head (flash_attention.PACK_GQA_BELOW);
            # (1, 160): a mixed step, its leading decode on Triton's extend kernel; GATHER_MIN_QUERIES, a long
            # chunk read from a gathered copy of its keys.
            for lens in ((1, 1), (16, 16), (100, 100), (160, 160), (1, 160), (GATHER_MIN_QUERIES,)):
                if max(lens) > self.model.cos_table.shape[0]:  # a model this short never runs such a step
                    continue
                q_lens = torch.tensor(lens, device=self.device)
                num_seqs, num_tokens, q_max = len(lens), sum(lens), max(lens)
                tables = torch.full((num_seqs, -(-q_max // bs)), scratch, device=self.device)
                seq_of_row = torch.arange(num_seqs, device=self.device).repeat_interleave(q_lens)
                starts = torch.zeros(num_seqs + 1, dtype=torch.int64, device=self.device)
                starts[1:] = torch.cumsum(q_lens, 0)
                pos = torch.arange(num_tokens, device=self.device) - starts[seq_of_row]
                num_decodes = next((i for i, n in enumerate(lens) if n != 1), num_seqs)
                layout = BatchLayout(
                    slot_mapping(tables, pos, bs, seq_of_row), starts, q_lens, tables, q_max, q_max, num_decodes
                )
                splits = self.backend.decode_splits(num_seqs) if q_max == 1 else 0
                meta = self.backend.prepare(layout, decode_splits=splits)
                ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
                rows = starts[1:] - 1
                sampled = None if splits else self._sampled(layout, seq_of_row, rows, meta)
                self.model(ids, pos, self.kv_caches, meta, rows, sampled)
        torch.cuda.synchronize(self.device)

    # ---- launch -----------------------------------------------------------------------------
    def graph_bucket(self, num_seqs: int, num_tokens: int, max_query_len: int) -> tuple[int, int] | None:
        """The captured graph (batch, tokens) for a step of num_seqs sequences and num_tokens new tokens, every
        one sampled, at most max_query_len a sequence (a decode step: one each; verifying: 1 + its drafts),
        or None (run eagerly)."""
        return self.graphs.bucket(num_seqs, num_tokens, max_query_len) if self.graphs is not None else None

    def mask_buffer(self, num_rows: int) -> torch.Tensor:
        """A host bitmask of num_rows rows, every token allowed, for the caller to restrict (see TokenMasks)."""
        return self.masks.buffer(num_rows)

    @torch.inference_mode()
    def launch(self, batch: StepBatch) -> InflightStep:
        """Stage and enqueue one packed step; returns at once. Tensor-parallel workers get the same
        step first and run it on their shards (rank 0 and workers alike call this). With constrained
        rows (`batch.meta.masked`) only the forward is enqueued; `sample_masked` enqueues the sampling."""
        if self.broadcast is not None:
            self.broadcast(RunStep(batch))
        meta = batch.meta
        staged = self.stager.stage(batch.packed)
        t = staged.tensors
        s = self.streams
        with s.on(s.compute):
            s.wait(s.compute, staged.slot.h2d_done)
            timing = self._start_timing()
            self._copy_blocks(batch.block_copies)
            if t.carry_dst is not None:
                assert self._last_sampled is not None
                t.ids.index_copy_(0, t.carry_dst, self._last_sampled.index_select(0, self.draft_carry.carry_rows(t)))
            self.draft_carry.move_back(t)
            self.draft_lookup.before_forward(t, meta)
            logits = self._forward(t, meta)
            if meta.num_rows:
                if t.row_logits is not None:
                    logits = logits.index_select(0, t.row_logits)
                logits = logits[: meta.num_rows]
                if meta.masked:
                    self._end_timing(timing)
                    return InflightStep(
                        meta.num_rows, None, None, None, [staged], PendingSample(logits, t, meta, staged)
                    )
        return self._sample(logits if meta.num_rows else None, t, meta, staged, None, timing)

    @torch.inference_mode()
    def sample_masked(self, step: InflightStep, masks: torch.Tensor) -> None:
        """Enqueue the sampling of a launched step with constrained rows under `masks` (from mask_buffer,
        filled by the caller; rows without a grammar all ones)."""
        if self.broadcast is not None:
            self.broadcast(SampleStep(masks))
        pending, step.pending = step.pending, None
        assert pending is not None
        staged_masks = self.masks.stage(masks)
        done = self._sample(pending.logits, pending.tensors, pending.meta, pending.staged, staged_masks, None)
        step.sampled, step.host, step.done, step.drafts = done.sampled, done.host, done.done, done.drafts
        step.keep += done.keep

    def _sample(
        self, logits: torch.Tensor | None, t: StepTensors, meta: StepMeta, staged: StagedStep,
        masks: tuple[torch.Tensor, torch.cuda.Event | None] | None, timing: tuple | None,
    ) -> InflightStep:  # fmt: skip
        """On the compute stream: mask, sample, release the staged inputs; then the d2h copy of the tokens."""
        s = self.streams
        result = None
        with s.on(s.compute):
            if logits is not None:
                if masks is not None:
                    s.wait(s.compute, masks[1])
                    timing = self._start_timing()  # after the forward's: the wait for the masks is not busy time
                    logits = self.masks.apply(logits, masks[0])
                result = sample(logits, _sampling_batch(t, meta))
            self.draft_carry.after_sample(t, result.token_ids if result is not None else None)
            drafts = self.draft_lookup.step_drafts(t)
            self.stager.release(staged)
            compute_done = s.event()
            s.record(compute_done, s.compute)
            self._end_timing(timing)
        if result is None:
            self._last_sampled = None
            return InflightStep(0, None, None, None, [staged])
        host = _to_pinned(result, s)
        host_drafts = _pinned_like(drafts) if s.cuda else drafts
        done = s.event()
        with s.on(s.d2h):
            s.wait(s.d2h, compute_done)
            _copy_result(host, result)
            if drafts is not None and host_drafts is not None and host_drafts is not drafts:
                host_drafts.copy_(drafts, non_blocking=True)
            s.record(done, s.d2h)
        self._last_sampled = result.token_ids
        keep = [staged, result] if masks is None else [staged, result, masks[0]]
        if drafts is not None:
            keep.append(drafts)
        return InflightStep(
            meta.num_rows, result.token_ids, host, done, keep, timing=timing if masks is None else None,
            drafts=host_drafts,
        )  # fmt: skip

    def _start_timing(self) -> tuple | None:
        """(start, end) CUDA events bracketing compute-stream work, for the GPU-busy gauge (None on CPU)."""
        if self.step_events is None or not self.streams.cuda:
            return None
        timing = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        timing[0].record(self.streams.compute)
        return timing

    def _end_timing(self, timing: tuple | None) -> None:
        if timing is not None:
            timing[1].record(self.streams.compute)
            self.step_events.append(timing)  # type: ignore[union-attr]

    def wait(self, step: InflightStep) -> SampledTokens:
        """Block until the step's tokens are on the host; the only host sync of the loop."""
        self.streams.synchronize(step.done)
        step.keep.clear()
        host = step.host
        if host is None:
            return SampledTokens([], None, None, None)
        n = step.num_rows
        return SampledTokens(
            token_ids=host.token_ids[:n].tolist(),
            logprobs=None if host.logprobs is None else host.logprobs[:n].tolist(),
            top_ids=None if host.top_ids is None else host.top_ids[:n].tolist(),
            top_logprobs=None if host.top_logprobs is None else host.top_logprobs[:n].tolist(),
            drafts=None if step.drafts is None else step.drafts.tolist(),
        )

    # ---- internals --------------------------------------------------------------------------
    def _forward(self, t: StepTensors, meta: StepMeta) -> torch.Tensor:
        batch = meta.batch
        ids, ctx = t.ids, t.ctx
        tables = self._block_tables(t, meta)
        if meta.graph:
            assert self.graphs is not None
            logits = self.graphs.run(batch, meta.graph_tokens, ids, ctx, tables, t.qstart)
            # A verifying graph's logits are every row's, padding included: keep the sampled ones.
            return logits if meta.graph_tokens == batch else logits.index_select(0, t.logits_rows)
        qstart = t.qstart
        num_tokens = ids.shape[0]
        splits = 0
        if meta.decode_only:  # row b is sequence b's one new token
            positions = ctx - 1
            slots = slot_mapping(tables, positions, self.block_size)
            splits = self.backend.decode_splits(batch, meta.max_context_len)
        else:
            q_lens = qstart[1:] - qstart[:-1]
            seq_of_row = torch.repeat_interleave(
                torch.arange(batch, device=self.device), q_lens, output_size=num_tokens
            )
            positions = torch.arange(num_tokens, device=self.device) - qstart[seq_of_row] + (ctx - q_lens)[seq_of_row]
            slots = slot_mapping(tables, positions, self.block_size, seq_of_row)
        layout = BatchLayout(slots, qstart, ctx, tables, meta.max_query_len, meta.max_context_len, meta.num_decodes)
        meta_attn = self.backend.prepare(layout, decode_splits=splits)
        rows = t.logits_rows
        sampled = None if meta.decode_only or meta.drafts else self._sampled(layout, seq_of_row, rows, meta_attn)
        return self.model(ids, positions, self.kv_caches, meta_attn, rows, sampled)

    def _sampled(
        self, layout: BatchLayout, seq_of_row: torch.Tensor, rows: torch.Tensor, step: PreparedAttention
    ) -> PreparedAttention | None:
        """The attention metadata of a step's sampled rows (at most one per sequence) when the last layer may
        skip the rest: at least LAST_LAYER_MIN_SKIPPED rows that sample nothing (prefill chunks); else None."""
        if layout.slot_mapping.shape[0] - rows.shape[0] < LAST_LAYER_MIN_SKIPPED:
            return None
        if rows.shape[0] == 0:  # chunks that sample nothing: the last layer stops at their K/V (llama.py reads no
            return step  # metadata then; the step's own stands in)
        return self.backend.prepare(sampled_layout(layout, seq_of_row, rows))

    def _block_tables(self, t: StepTensors, meta: StepMeta) -> torch.Tensor:
        """The step's block tables [batch, width]: the writes it brings applied to the persistent table, then
        its sequences' rows gathered (block_tables.py)."""
        if self._tables is None:
            self._tables = torch.full(meta.table_shape, self.scratch_block, dtype=torch.int64, device=self.device)
        assert self._tables.shape == meta.table_shape, "the block table's shape is fixed by its first step"
        if t.table_index is not None and t.table_values is not None:
            self._tables.view(-1).index_copy_(0, t.table_index, t.table_values)
        return self._tables[:, : meta.width].index_select(0, t.table_rows)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        bs = self.block_size
        for src, dst in copies:
            self.kv_caches[:, dst * bs : (dst + 1) * bs] = self.kv_caches[:, src * bs : (src + 1) * bs]


def _sampling_batch(t: StepTensors, meta: StepMeta) -> SamplingBatch:
    # Without a random row nothing but greedy is packed: the sampler reads no parameter tensor then.
    return SamplingBatch(
        temperature=t.temperature,  # type: ignore[arg-type]
        top_k=t.top_k,  # type: ignore[arg-type]
        top_p=t.top_p,  # type: ignore[arg-type]
        min_p=t.min_p,  # type: ignore[arg-type]
        seed=t.seed,  # type: ignore[arg-type]
        stream=t.stream,  # type: ignore[arg-type]
        position=t.position,  # type: ignore[arg-type]
        any_random=meta.any_random,
        any_top_k_or_p=meta.any_top_k_or_p,
        any_min_p=meta.any_min_p,
        max_logprobs=meta.max_logprobs,
    )


def _pinned_like(t: torch.Tensor | None) -> torch.Tensor | None:
    """A pinned host tensor of t's shape and dtype, for its copy back from the device."""
    return None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True)


def _to_pinned(result: SampleResult, streams: DeviceStreams) -> SampleResult:
    if not streams.cuda:
        return result  # already on the host
    return SampleResult(
        _pinned_like(result.token_ids),  # type: ignore[arg-type]
        _pinned_like(result.logprobs),
        _pinned_like(result.top_ids),
        _pinned_like(result.top_logprobs),
    )


def _copy_result(host: SampleResult, device: SampleResult) -> None:
    if host is device:
        return
    for dst, src in (
        (host.token_ids, device.token_ids),
        (host.logprobs, device.logprobs),
        (host.top_ids, device.top_ids),
        (host.top_logprobs, device.top_logprobs),
    ):
        if dst is not None and src is not None:
            dst.copy_(src, non_blocking=True)
