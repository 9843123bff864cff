"""CUDA graphs of the decode forward, one per batch-size bucket, all in one memory pool.

A decode step (one new token per sequence, no forks) with B sequences runs the graph of the
smallest bucket >= B; the host pads the batch to the bucket with rows that read and write only a
scratch KV block. Graph inputs are static tensors (token ids, context lengths, block tables);
positions and KV slots are derived from them inside the graph. Graphs are captured largest
first, so smaller ones reuse the pool's memory, during warm-up (before the daemon reports
SERVING). Steps outside the buckets run eagerly.

Verifying steps (speculative decoding: each sequence's newest token and its k drafts, one sample
row each, no forks) have graphs too, per (batch bucket, Q) for a few query counts Q = 1 + k (up to
`verify_batch`): the host pads every sequence to Q tokens (`query_lens` holds the real counts) and
the batch to the bucket. Inside the graph a padding token's position is clamped and its K/V goes
to the scratch block; the attention kernel sees every sequence with Q queries at the end of a
context of `ctx - query_len + Q` keys, so each real query attends exactly its causal prefix (the
padding comes after it); block-table columns past the step's width are reset to the scratch
block, so the keys past a context that padding queries read are in bounds. Logits come back for
all B x Q rows; the runner picks the sampled ones.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from cbd.model.attention import BatchLayout, slot_mapping
from cbd.model.attention_backends import AttentionBackend
from cbd.model.llama import CausalLM

log = logging.getLogger(__name__)

# Query counts (1 + drafts) of the verifying graphs; num_speculative_tokens + 1 is added when larger than these.
VERIFY_QUERIES = (3, 5, 9)
_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def batch_buckets(max_batch: int) -> list[int]:
    buckets = [b for b in _BUCKETS if b < max_batch]
    return buckets + [max_batch]


# The most query rows (queries x GQA group) of one verifying graph's attention program: beyond, the
# fp32 accumulator alone would take more registers than a thread has.
MAX_ROWS = 128


def verify_queries(num_speculative_tokens: int) -> tuple[int, ...]:
    """The query counts of the verifying graphs when sequences verify at most that many drafts."""
    most = num_speculative_tokens + 1
    return tuple(sorted({q for q in VERIFY_QUERIES if q < most} | {most}))


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
        verify_queries: tuple[int, ...] = (),
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.block_size = block_size
        self.buckets = batch_buckets(max_batch)
        self.verify_buckets = batch_buckets(min(verify_batch, max_batch)) if verify_batch and verify_queries else []
        # A decode-kernel program holds queries x (the GQA group, to a power of two) rows: at most MAX_ROWS.
        group = model.spec.num_heads // model.spec.num_kv_heads
        group_pad = 1 << (group - 1).bit_length()
        fits = [q for q in verify_queries if q * group_pad <= MAX_ROWS]
        self.queries = sorted(fits) if self.verify_buckets else []
        most = max(self.queries, default=1)
        # Room past the longest context for the keys that padding queries read (see the module docstring).
        self.width = max_blocks_per_seq + -(-most // block_size)
        self.scratch_block = scratch_block
        self.stream = stream
        device = kv_caches.device
        self.ids = torch.zeros(max_batch * most, dtype=torch.int64, device=device)
        self.context_lens = torch.ones(max_batch, dtype=torch.int64, device=device)
        self.query_lens = torch.ones(max_batch, dtype=torch.int64, device=device)
        self.block_tables = torch.full((max_batch, self.width), scratch_block, dtype=torch.int64, device=device)
        self.rows = torch.arange(max_batch * most + 1, dtype=torch.int64, device=device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool: Any = None  # the graphs' shared memory pool, made at capture
        self.replays = [0, 0]  # decode, verifying

    def bucket(self, num_seqs: int, max_queries: int = 1) -> tuple[int, int] | None:
        """The captured graph (batch, queries) for num_seqs sequences of at most max_queries new tokens each,
        or None (not captured, or too large: run eagerly)."""
        queries = 1 if max_queries == 1 else next((q for q in self.queries if q >= max_queries), None)
        buckets = self.buckets if max_queries == 1 else self.verify_buckets
        batch = next((b for b in buckets if b >= num_seqs), None)
        if queries is None or batch is None:
            return None
        return (batch, queries) if self.stream is None or (batch, queries) in self.graphs else None

    def forward(self, batch: int, queries: int) -> torch.Tensor:
        """The captured forward, from the static inputs alone: logits [batch * queries, V]."""
        ctx = self.context_lens[:batch]
        tables = self.block_tables[:batch]
        if queries == 1:
            positions = ctx - 1
            slots = slot_mapping(tables, positions, self.block_size)  # inside the graph: from the static inputs
            layout = BatchLayout(slots, self.rows[: batch + 1], ctx, tables, 1, self.width * self.block_size)
            meta = self.backend.prepare(layout, decode_splits=self.backend.decode_splits(batch))
            return self.model(self.ids[:batch], positions, self.kv_caches, meta, self.rows[:batch])
        num_tokens = batch * queries
        q_lens = self.query_lens[:batch]
        keys = ctx - q_lens + queries  # the attention's context: real tokens first, then the padding
        seq_of_row = self.rows[:num_tokens] // queries
        index = self.rows[:num_tokens] % queries
        real = index < q_lens[seq_of_row]
        positions = torch.where(real, keys[seq_of_row] - queries + index, 0)
        slots = slot_mapping(tables, positions, self.block_size, seq_of_row)
        slots = torch.where(real, slots, self.scratch_block * self.block_size)
        layout = BatchLayout(
            slots, self.rows[: batch + 1] * queries, keys, tables, queries, self.width * self.block_size
        )
        meta = self.backend.prepare(layout, decode_splits=self.backend.decode_splits(batch))
        return self.model(self.ids[:num_tokens], positions, self.kv_caches, meta, self.rows[:num_tokens])

    @torch.inference_mode()
    def capture(self) -> None:
        assert self.stream is not None
        start = time.monotonic()
        self.pool = torch.cuda.graph_pool_handle()
        shapes = [(b, 1) for b in self.buckets] + [(b, q) for b in self.verify_buckets for q in self.queries]
        with torch.cuda.stream(self.stream):
            for batch, queries in sorted(shapes, key=lambda s: -s[0] * s[1]):  # largest first: the pool fits all
                self.forward(batch, queries)  # compiles kernels and settles the allocator outside the capture
                self.stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                    logits = self.forward(batch, queries)
                self.graphs[batch, queries] = (graph, logits)
        self.stream.synchronize()
        log.info("captured %d decode graphs (batch %d..%d) and %d verifying graphs (queries %s) in %.1f s",
                 len(self.buckets), self.buckets[0], self.buckets[-1], len(shapes) - len(self.buckets),
                 self.queries, time.monotonic() - start)  # fmt: skip

    @torch.inference_mode()
    def measure(self, context: int = 512, repeats: int = 3) -> dict[tuple[int, int], float]:
        """Milliseconds per replay of each verifying graph and of the decode graphs up to the bucket its
        largest batch decodes in (sequences of `context` tokens reading the scratch block): what the
        speculation policy weighs."""
        assert self.stream is not None
        most = max(self.verify_buckets, default=0)
        most = next((b for b in self.buckets if b >= most), most)  # the decode bucket a plain step of `most` runs
        shapes = [key for key in self.graphs if key[0] <= most]
        costs = {}
        with torch.cuda.stream(self.stream):
            for batch, queries in shapes:
                self.context_lens[:batch].fill_(min(context, self.width * self.block_size - queries))
                self.query_lens[:batch].fill_(queries)
                self.block_tables[:batch].fill_(self.scratch_block)
                graph = self.graphs[batch, queries][0]
                graph.replay()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(self.stream)
                for _ in range(repeats):
                    graph.replay()
                end.record(self.stream)
                end.synchronize()
                costs[batch, queries] = start.elapsed_time(end) / repeats
        return costs

    def load(
        self, batch: int, queries: int, ids: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
        query_lens: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        """Copy one step's inputs into the static tensors: ids [batch * queries], context_lens [batch],
        block_tables [batch, W] (padded rows included), query_lens [batch] for a verifying step."""
        width = block_tables.shape[1]
        self.ids[: batch * queries].copy_(ids)
        self.context_lens[:batch].copy_(context_lens)
        self.block_tables[:batch, :width].copy_(block_tables)
        if queries > 1:
            assert query_lens is not None
            self.query_lens[:batch].copy_(query_lens)
            self.block_tables[:batch, width:].fill_(self.scratch_block)

    def run(
        self, batch: int, queries: int, ids: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
        query_lens: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """On the compute stream: load the inputs, replay the graph of (batch, queries); its logits.
        (Without a stream, the same forward runs eagerly from the same static inputs.)"""
        self.load(batch, queries, ids, context_lens, block_tables, query_lens)
        self.replays[queries > 1] += 1
        if self.stream is None:
            return self.forward(batch, queries)
        graph, logits = self.graphs[batch, queries]
        graph.replay()
        return logits
