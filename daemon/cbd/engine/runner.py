"""ModelRunner: turns a StepPlan into device work (`launch`) and hands back its tokens (`wait`).

Owns the KV pool `[layers, (num_blocks + 1) * block_size, 2, kv_heads, head_dim]` (the last block
is a scratch block that padded graph rows write to), the attention backend, the decode CUDA graphs
and the three streams. `launch` packs the step on the CPU, stages it (double-buffered), and
enqueues on the compute stream: copy-on-write block copies, carry-over, forward, sampling; then
the d2h copy of the sampled tokens. It returns at once; `wait` blocks on that copy's event.

Carry-over: a sequence scheduled while its previous token is still being sampled by the step in
flight has a placeholder as its last token; its input id is filled on the GPU from that step's
sampled-token tensor (`carry_dst`/`carry_src`), so step N+1 needs nothing from step N's host side.

One sampling row per sampled chunk; a chunk that ends a prompt with pending forks gets one row per
candidate, all reading the same logits row (prefill once, then fork).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from cbd.engine.cuda_graphs import DecodeGraphs
from cbd.engine.sampler import SampleResult, SamplingBatch, sample
from cbd.engine.scheduler import StepPlan
from cbd.engine.sequence import Sequence
from cbd.engine.step_inputs import InputStager, PackedStep, StagedStep
from cbd.engine.streams import DeviceStreams
from cbd.model.attention import BatchLayout
from cbd.model.attention_backends import select_backend
from cbd.model.llama import CausalLM


@dataclass(slots=True)
class SampleRow:
    seq: Sequence  # the sequence whose chunk produced the logits
    candidate_index: int
    position: int  # index of the sampled token within its candidate's token ids
    # Set by the engine core at launch: the sequence that receives the token (the parent or a fork).
    target: Sequence | None = None


@dataclass(slots=True)
class InflightStep:
    """A launched step. Holds every tensor its device work touches until `wait` has passed its event."""

    plan: StepPlan
    rows: list[SampleRow]
    sampled: torch.Tensor | None  # [R] int64 on the device (the next step's carry-over source)
    host: SampleResult | None  # pinned host copies, valid once `done` has passed
    done: torch.cuda.Event | None
    keep: list = field(default_factory=list)


@dataclass(slots=True)
class StepResult:
    rows: list[SampleRow]
    token_ids: list[int]
    logprobs: list[float] | None
    top_ids: list[list[int]] | None
    top_logprobs: list[list[float]] | None


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        attention_backend: str = "auto",
        cuda_graph_max_batch: int = 0,
    ) -> None:
        spec = model.spec
        self.model = model
        self.block_size = block_size
        self.device = model.embed_tokens.weight.device
        self.scratch_block = num_blocks
        self.kv_caches = torch.zeros(
            spec.num_layers, (num_blocks + 1) * block_size, 2, spec.num_kv_heads, spec.head_dim,
            dtype=model.embed_tokens.weight.dtype, device=self.device,
        )  # fmt: skip
        self.backend = select_backend(
            attention_backend, self.device, self.kv_caches.dtype, block_size, spec.sliding_window, spec.num_kv_heads
        )
        self.streams = DeviceStreams(self.device)
        self.stager = InputStager(self.streams)
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.graphs: DecodeGraphs | None = None
        if cuda_graph_max_batch > 0 and self.streams.cuda and self.backend.supports_cuda_graphs:
            assert self.streams.compute is not None
            self.graphs = DecodeGraphs(
                model, self.kv_caches, self.backend, block_size, cuda_graph_max_batch, self.max_blocks_per_seq,
                self.scratch_block, self.streams.compute,
            )  # fmt: skip
        self._last_sampled: torch.Tensor | None = None
        # Tensor parallelism: sends each step (and warm-up) to the worker ranks before running it here.
        self.broadcast: Callable[[tuple], None] | None = None
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
    def kv_bytes_per_block(model: CausalLM, block_size: int) -> int:
        spec = model.spec
        itemsize = model.embed_tokens.weight.element_size()
        return spec.num_layers * 2 * block_size * spec.num_kv_heads * spec.head_dim * itemsize

    def warm_up(self) -> None:
        """Compile every kernel variant a step can need and capture the decode graphs, so that the
        first requests after the daemon reports SERVING pay no JIT compilation."""
        if self.broadcast is not None:
            self.broadcast(("warm_up",))
        if self.streams.cuda:
            self._warm_eager()
        if self.graphs is not None and not self.graphs.graphs:
            self.graphs.capture()

    @torch.inference_mode()
    def _warm_eager(self) -> None:
        """Eager forwards of each kernel shape class (decode, short and long extends) on the scratch block."""
        bs, scratch = self.block_size, self.scratch_block
        with self.streams.on(self.streams.compute):
            for q_len in (1, 16, 80):
                num_seqs = 2
                width = -(-q_len // bs)
                pos = torch.arange(q_len, device=self.device).repeat(num_seqs)
                layout = BatchLayout(
                    slot_mapping=scratch * bs + pos % bs,
                    query_start=torch.arange(num_seqs + 1, device=self.device) * q_len,
                    context_lens=torch.full((num_seqs,), q_len, device=self.device),
                    block_tables=torch.full((num_seqs, width), scratch, device=self.device),
                    max_query_len=q_len,
                    max_context_len=q_len,
                )
                splits = self.backend.decode_splits(num_seqs) if q_len == 1 and hasattr(self.backend, "decode_splits") else 0
                meta = self.backend.prepare(layout, decode_splits=splits)
                ids = torch.zeros(num_seqs * q_len, dtype=torch.int64, device=self.device)
                rows = torch.arange(num_seqs, device=self.device) * q_len + q_len - 1
                self.model(ids, pos, self.kv_caches, meta, rows)
        torch.cuda.synchronize(self.device)

    # ---- launch -----------------------------------------------------------------------------
    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> InflightStep:
        rows, packed, info = self._pack(plan)
        if self.broadcast is not None:  # tensor-parallel workers run the same step on their shards
            self.broadcast(("step", packed, info, plan.block_copies, len(rows)))
        sampled, host, done, keep = self.launch_packed(packed, info, plan.block_copies, len(rows))
        return InflightStep(plan, rows, sampled, host, done, keep)

    @torch.inference_mode()
    def launch_packed(
        self, packed: PackedStep, info: dict, block_copies: list[tuple[int, int]], num_rows: int
    ) -> tuple[torch.Tensor | None, SampleResult | None, torch.cuda.Event | None, list]:
        """Stage and enqueue one packed step (rank 0 and tensor-parallel workers alike)."""
        staged = self.stager.stage(packed)
        s = self.streams
        with s.on(s.compute):
            s.wait(s.compute, staged.slot.h2d_done)
            timing = None
            if self.step_events is not None and s.cuda:
                timing = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                timing[0].record(s.compute)
            self._copy_blocks(block_copies)
            ids = staged["ids"]
            if "carry_dst" in staged.tensors:
                assert self._last_sampled is not None
                ids.index_copy_(0, staged["carry_dst"], self._last_sampled.index_select(0, staged["carry_src"]))
            logits = self._forward(staged, info)
            result = None
            if num_rows:
                if "row_logits" in staged.tensors:
                    logits = logits.index_select(0, staged["row_logits"])
                result = sample(logits[:num_rows], self._sampling_batch(staged, info))
            self.stager.release(staged)
            compute_done = s.event()
            s.record(compute_done, s.compute)
            if timing is not None:
                timing[1].record(s.compute)
                self.step_events.append(timing)  # type: ignore[union-attr]
        if result is None:
            self._last_sampled = None
            return None, None, None, [staged]
        host = _to_pinned(result, s)
        done = s.event()
        with s.on(s.d2h):
            s.wait(s.d2h, compute_done)
            _copy_result(host, result)
            s.record(done, s.d2h)
        self._last_sampled = result.token_ids
        return result.token_ids, host, done, [staged, result]

    def wait(self, step: InflightStep) -> StepResult:
        """Block until the step's tokens are on the host; the only host sync of the loop."""
        self.streams.synchronize(step.done)
        step.keep.clear()
        host = step.host
        if host is None:
            return StepResult(step.rows, [], None, None, None)
        n = len(step.rows)
        return StepResult(
            rows=step.rows,
            token_ids=host.token_ids[:n].tolist(),
            logprobs=None if host.logprobs is None else host.logprobs[:n].tolist(),
            top_ids=None if host.top_ids is None else host.top_ids[:n].tolist(),
            top_logprobs=None if host.top_logprobs is None else host.top_logprobs[:n].tolist(),
        )

    # ---- internals --------------------------------------------------------------------------
    def _pack(self, plan: StepPlan) -> tuple[list[SampleRow], PackedStep, dict]:
        ids: list[int] = []
        qstart: list[int] = [0]
        ctx: list[int] = []
        logits_rows: list[int] = []
        rows: list[SampleRow] = []
        row_logits: list[int] = []
        carry_dst: list[int] = []
        carry_src: list[int] = []
        tables: list[list[int]] = []
        for chunk in plan.chunks:
            seq, start, n = chunk.seq, chunk.seq.num_computed_tokens, chunk.num_new_tokens
            ids += seq.token_ids[start : start + n]
            if seq.num_placeholders:
                # Only the newest token can still be in flight, and a chunk always ends at it.
                assert seq.num_placeholders == 1 and start + n == seq.num_tokens
                carry_dst.append(len(ids) - 1)
                carry_src.append(seq.pending_row)
                ids[-1] = 0
            qstart.append(len(ids))
            ctx.append(start + n)
            tables.append(seq.block_table)
            if chunk.samples:
                logits_rows.append(len(ids) - 1)
                for c in range(seq.candidate_index, seq.candidate_index + 1 + seq.pending_forks):
                    rows.append(SampleRow(seq, c, seq.num_tokens))
                    row_logits.append(len(logits_rows) - 1)
        num_seqs = len(plan.chunks)
        decode_only = len(ids) == num_seqs and len(rows) == num_seqs
        batch = num_seqs
        graph_batch = None
        if decode_only and self.graphs is not None:
            graph_batch = self.graphs.bucket(num_seqs)
        if graph_batch is not None:
            batch = graph_batch  # pad to the bucket: rows that touch only the scratch block
            pad = batch - num_seqs
            ids += [0] * pad
            ctx += [1] * pad
            tables += [[self.scratch_block]] * pad
        width = max(len(t) for t in tables)
        flat_tables: list[int] = []
        for t in tables:
            flat_tables += t
            flat_tables += [self.scratch_block] * (width - len(t))
        packed = PackedStep()
        packed.add("ids", ids)
        packed.add("qstart", qstart)
        packed.add("ctx", ctx)
        packed.add("logits_rows", logits_rows)
        if len(row_logits) != len(logits_rows):
            packed.add("row_logits", row_logits)
        if carry_dst:
            packed.add("carry_dst", carry_dst)
            packed.add("carry_src", carry_src)
        packed.add("tables", flat_tables)
        params = [r.seq.request.params for r in rows]
        any_random = any(not p.greedy for p in params)
        if any_random:
            packed.add("seed", [r.seq.request.seed for r in rows])
            packed.add("stream", [r.candidate_index for r in rows])
            packed.add("position", [r.position for r in rows])
            packed.add("top_k", [p.top_k for p in params])
            packed.add_float("temperature", [p.temperature for p in params])
            packed.add_float("top_p", [p.top_p for p in params])
            packed.add_float("min_p", [p.min_p for p in params])
        info = {
            "num_seqs": num_seqs,
            "batch": batch,
            "width": width,
            "graph": graph_batch is not None,
            "decode_only": decode_only,
            "max_query_len": max(c.num_new_tokens for c in plan.chunks),
            "max_context_len": max(ctx[:num_seqs]),
            "any_random": any_random,
            "params": params,
        }
        return rows, packed, info

    def _forward(self, staged: StagedStep, info: dict) -> torch.Tensor:
        batch, width = info["batch"], info["width"]
        ids, ctx = staged["ids"], staged["ctx"]
        tables = staged["tables"].view(batch, width)
        if info["graph"]:
            assert self.graphs is not None
            return self.graphs.run(batch, ids, ctx, tables)
        qstart = staged["qstart"]
        num_tokens = ids.shape[0]
        bs = self.block_size
        if info["decode_only"]:
            seq_of_row = torch.arange(batch, device=self.device)
            positions = ctx - 1
        else:
            q_lens = qstart[1:] - qstart[:-1]
            seq_of_row = torch.repeat_interleave(
                torch.arange(batch, device=self.device), q_lens, output_size=num_tokens
            )
            positions = torch.arange(num_tokens, device=self.device) - qstart[seq_of_row] + (ctx - q_lens)[seq_of_row]
        slots = tables[seq_of_row, positions // bs] * bs + positions % bs
        layout = BatchLayout(slots, qstart, ctx, tables, info["max_query_len"], info["max_context_len"])
        splits = 0
        if info["decode_only"] and hasattr(self.backend, "decode_splits"):
            splits = self.backend.decode_splits(batch, info["max_context_len"])
        meta = self.backend.prepare(layout, decode_splits=splits)
        return self.model(ids, positions, self.kv_caches, meta, staged["logits_rows"])

    def _sampling_batch(self, staged: StagedStep, info: dict) -> SamplingBatch:
        params = info["params"]
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        any_random = info["any_random"]
        return SamplingBatch(
            temperature=staged.get("temperature"),  # type: ignore[arg-type]
            top_k=staged.get("top_k"),  # type: ignore[arg-type]
            top_p=staged.get("top_p"),  # type: ignore[arg-type]
            min_p=staged.get("min_p"),  # type: ignore[arg-type]
            seed=staged.get("seed"),  # type: ignore[arg-type]
            stream=staged.get("stream"),  # type: ignore[arg-type]
            position=staged.get("position"),  # type: ignore[arg-type]
            any_random=any_random,
            any_top_k_or_p=any(not p.greedy and (p.top_k > 0 or p.top_p < 1.0) for p in params),
            any_min_p=any(not p.greedy and p.min_p > 0.0 for p in params),
            max_logprobs=max(wanted) if wanted else None,
        )

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        bs = self.block_size
        for src, dst in copies:
            self.kv_caches[:, dst * bs : (dst + 1) * bs] = self.kv_caches[:, src * bs : (src + 1) * bs]


def _to_pinned(result: SampleResult, streams: DeviceStreams) -> SampleResult:
    if not streams.cuda:
        return result  # already on the host

    def pinned_like(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True)

    return SampleResult(
        pinned_like(result.token_ids),  # type: ignore[arg-type]
        pinned_like(result.logprobs),
        pinned_like(result.top_ids),
        pinned_like(result.top_logprobs),
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
