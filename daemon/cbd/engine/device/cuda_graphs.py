"""CUDA graphs of the decode forward, one per batch-size bucket, all in one memory pool.

A decode step (one new token per sequence, no forks) with B sequences runs the graph of the
smallest bucket >= B; the host pads the batch to the bucket with rows that read and write only a
scratch KV block. Graph inputs are static tensors (token ids, context lengths, block tables);
positions and KV slots are derived from them inside the graph. Graphs are captured largest
first, so smaller ones reuse the pool's memory, during warm-up (before the daemon reports
SERVING). Steps outside the buckets run eagerly.

Verifying steps (speculative decoding: each sequence's newest token and its own k drafts, one sample
row each, no forks) have graphs too, per (batch bucket, tokens) (up to `verify_batch`), the rows laid
out ragged: sequence b's 1 + k_b rows follow sequence b - 1's (`query_start`), so a step costs the
tokens it verifies, not the batch times its longest run. The host pads the batch to the bucket with
sequences of no rows and the rows to the graph's token count (`verify_tokens`: the bucket plus 2, 4,
8, ... drafts, up to every sequence's most); inside the graph the padding rows' K/V go to the scratch
block and the attention leaves them out. Logits come back for every row; the runner picks the sampled
ones.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from cbd import gc_heap
from cbd.model.attention import BatchLayout, row_sequences, slot_mapping
from cbd.model.attention_backends import AttentionBackend
from cbd.model.llama import CausalLM

log = logging.getLogger(__name__)

_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512)
# Drafts per verifying graph beyond its batch bucket (a step pads to the next), up to bucket x the most per sequence.
_DRAFT_BUCKETS = (2, 4, 8, 16, 32, 64, 128, 256)


def batch_buckets(max_batch: int) -> list[int]:
    buckets = [b for b in _BUCKETS if b < max_batch]
    return buckets + [max_batch]


def verify_tokens(batch: int, max_queries: int) -> list[int]:
    """The token counts of the verifying graphs of a batch bucket whose sequences verify at most
    max_queries - 1 drafts each."""
    most = batch * (max_queries - 1)
    return [batch + d for d in _DRAFT_BUCKETS if d < most] + [batch + most]


# The most query rows (queries x GQA group) of one verifying graph's attention program: beyond, the
# fp32 accumulator alone would take more registers than a thread has.
MAX_ROWS = 128


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: torch.Tensor,
        backend: AttentionBackend,  # one with supports_cuda_graphs
        block_size: int,
        max_batch: int,
        max_blocks_per_seq: int,
        scratch_block: int,
        stream: torch.cuda.Stream | None,  # None: run the same forwards eagerly (tests on any device)
        verify_batch: int = 0,
        verify_queries: int = 1,  # the most tokens a sequence brings to a verifying step (1 + its drafts)
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.block_size = block_size
        self.buckets = batch_buckets(max_batch)
        # A decode-kernel program holds queries x (the GQA group, to a power of two) rows: at most MAX_ROWS.
        group = model.spec.num_heads // model.spec.num_kv_heads
        group_pad = 1 << (group - 1).bit_length()
        self.max_queries = min(verify_queries, MAX_ROWS // group_pad) if verify_batch else 1
        self.verify_buckets = batch_buckets(min(verify_batch, max_batch)) if self.max_queries > 1 else []
        self.tokens = {b: verify_tokens(b, self.max_queries) for b in self.verify_buckets}
        self.width = max_blocks_per_seq
        self.scratch_block = scratch_block
        self.stream = stream
        device = kv_caches.device
        most = max([max_batch] + [t[-1] for t in self.tokens.values()])
        self.ids = torch.zeros(most, dtype=torch.int64, device=device)
        self.context_lens = torch.ones(max_batch, dtype=torch.int64, device=device)
        self.query_start = torch.zeros(max_batch + 1, dtype=torch.int64, device=device)
        self.block_tables = torch.full((max_batch, self.width), scratch_block, dtype=torch.int64, device=device)
        self.rows = torch.arange(most + 1, dtype=torch.int64, device=device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool: Any = None  # the graphs' shared memory pool, made at capture
        self.replays = [0, 0]  # decode, verifying

    def bucket(self, num_seqs: int, num_tokens: int, max_query_len: int) -> tuple[int, int] | None:
        """The captured graph (batch, tokens) for a step of num_seqs sequences and num_tokens new tokens, each
        sampled, at most max_query_len per sequence (num_tokens == num_seqs: a decode step), or None (not
        captured, or too large: run eagerly)."""
        if num_tokens == num_seqs:
            key = next(((b, b) for b in self.buckets if b >= num_seqs), None)
        elif max_query_len > self.max_queries:
            key = None
        else:
            batch = next((b for b in self.verify_buckets if b >= num_seqs), None)
            tokens = None if batch is None else next((t for t in self.tokens[batch] if t >= num_tokens), None)
            key = None if batch is None or tokens is None else (batch, tokens)
        return key if key is not None and (self.stream is None or key in self.graphs) else None

    def forward(self, batch: int, tokens: int) -> torch.Tensor:
        """The captured forward, from the static inputs alone: logits [tokens, V]."""
        ctx = self.context_lens[:batch]
        tables = self.block_tables[:batch]
        if tokens == batch:  # decode: row b is sequence b's one token
            positions = ctx - 1
            slots = slot_mapping(tables, positions, self.block_size)  # inside the graph: from the static inputs
            layout = BatchLayout(slots, self.rows[: batch + 1], ctx, tables, 1, self.width * self.block_size)
            meta = self.backend.prepare(layout, decode_splits=self.backend.decode_splits(batch))
            return self.model(self.ids[:batch], positions, self.kv_caches, meta, self.rows[:batch])
        starts = self.query_start[: batch + 1]
        rows = self.rows[:tokens]
        seq_of_row = row_sequences(starts, tokens)
        real = seq_of_row >= 0  # rows past the last sequence's are padding
        seq = seq_of_row.clamp(min=0)
        positions = torch.where(real, (ctx - starts[1:] + starts[:-1])[seq] + rows - starts[seq], 0)
        slots = slot_mapping(tables, positions, self.block_size, seq)
        slots = torch.where(real, slots, self.scratch_block * self.block_size)
        layout = BatchLayout(
            slots, starts, ctx, tables, self.max_queries, self.width * self.block_size, seq_of_row=seq_of_row
        )
        meta = self.backend.prepare(layout, decode_splits=self.backend.decode_splits(batch))
        return self.model(self.ids[:tokens], positions, self.kv_caches, meta, rows)

    @torch.inference_mode()
    def capture(self) -> None:
        assert self.stream is not None
        start = time.monotonic()
        self.pool = torch.cuda.graph_pool_handle()
        shapes = [(b, b) for b in self.buckets] + [(b, t) for b in self.verify_buckets for t in self.tokens[b]]
        with gc_heap.paused(), torch.cuda.stream(self.stream):  # no finalizer's CUDA call inside a capture
            for batch, tokens in sorted(shapes, key=lambda s: -s[1]):  # largest first: the pool fits all
                self.forward(batch, tokens)  # compiles kernels and settles the allocator outside the capture
                self.stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                    logits = self.forward(batch, tokens)
                self.graphs[batch, tokens] = (graph, logits)
        self.stream.synchronize()
        log.info("captured %d decode graphs (batch %d..%d) and %d verifying graphs (up to %d tokens a sequence) "
                 "in %.1f s", len(self.buckets), self.buckets[0], self.buckets[-1], len(shapes) - len(self.buckets),
                 self.max_queries, time.monotonic() - start)  # fmt: skip

    @torch.inference_mode()
    def measure(self, context: int = 512, repeats: int = 3) -> dict[tuple[int, int], float]:
        """Milliseconds per replay of each verifying graph (its tokens spread evenly over its sequences) and
        of the decode graphs up to the bucket its largest batch decodes in (sequences of `context` tokens
        reading the scratch block): what the speculation policy weighs."""
        assert self.stream is not None
        most = max(self.verify_buckets, default=0)
        most = next((b for b in self.buckets if b >= most), most)  # the decode bucket a plain step of `most` runs
        shapes = [key for key in self.graphs if key[0] <= most]
        costs = {}
        with torch.cuda.stream(self.stream):
            for batch, tokens in shapes:
                self.context_lens[:batch].fill_(min(context, self.width * self.block_size))
                self.query_start[: batch + 1].copy_(self.rows[: batch + 1] * tokens // batch)
                self.block_tables[:batch].fill_(self.scratch_block)
                graph = self.graphs[batch, tokens][0]
                graph.replay()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(self.stream)
                for _ in range(repeats):
                    graph.replay()
                end.record(self.stream)
                end.synchronize()
                costs[batch, tokens] = start.elapsed_time(end) / repeats
        return costs

    def load(
        self, batch: int, tokens: int, ids: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
        query_start: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        """Copy one step's inputs into the static tensors: ids [tokens], context_lens [batch], block_tables
        [batch, W] (padded rows included), query_start [batch + 1] for a verifying step."""
        width = block_tables.shape[1]
        self.ids[:tokens].copy_(ids)
        self.context_lens[:batch].copy_(context_lens)
        self.block_tables[:batch, :width].copy_(block_tables)
        if tokens > batch:
            assert query_start is not None
            self.query_start[: batch + 1].copy_(query_start)

    def run(
        self, batch: int, tokens: int, ids: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
        query_start: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """On the compute stream: load the inputs, replay the graph of (batch, tokens); its logits.
        (Without a stream, the same forward runs eagerly from the same static inputs.)"""
        self.load(batch, tokens, ids, context_lens, block_tables, query_start)
        self.replays[tokens > batch] += 1
        if self.stream is None:
            return self.forward(batch, tokens)
        graph, logits = self.graphs[batch, tokens]
        graph.replay()
        return logits
