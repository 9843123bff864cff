"""CUDA graphs of the decode forward, one per batch-size bucket, all in one memory pool.

A decode step (one new token per sequence, no forks) with B sequences runs the graph of the
smallest bucket >= B; the host pads the batch to the bucket with rows that read and write only a
scratch KV block. Graph inputs are static tensors (token ids, context lengths, block tables);
positions and KV slots are derived from them inside the graph. Graphs are captured largest
first, so smaller ones reuse the pool's memory, during warm-up (before the daemon reports
SERVING). Steps outside the buckets run eagerly.
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

_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def batch_buckets(max_batch: int) -> list[int]:
    buckets = [b for b in _BUCKETS if b < max_batch]
    return buckets + [max_batch]


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
        stream: torch.cuda.Stream,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.block_size = block_size
        self.buckets = batch_buckets(max_batch)
        self.width = max_blocks_per_seq
        self.scratch_block = scratch_block
        self.stream = stream
        device = kv_caches.device
        self.ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.context_lens = torch.ones(max_batch, dtype=torch.int64, device=device)
        self.block_tables = torch.full((max_batch, self.width), scratch_block, dtype=torch.int64, device=device)
        self.rows = torch.arange(max_batch + 1, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool: Any = None  # the graphs' shared memory pool, made at capture

    def bucket(self, num_seqs: int) -> int | None:
        """The captured graph for num_seqs sequences, or None (not captured yet, or too large: run eagerly)."""
        for b in self.buckets:
            if b >= num_seqs:
                return b if b in self.graphs else None
        return None

    def _forward(self, batch: int) -> torch.Tensor:
        ctx = self.context_lens[:batch]
        tables = self.block_tables[:batch]
        positions = ctx - 1
        slots = slot_mapping(tables, positions, self.block_size)  # inside the graph: from the static inputs
        layout = BatchLayout(slots, self.rows[: batch + 1], ctx, tables, 1, self.width * self.block_size)
        meta = self.backend.prepare(layout, decode_splits=self.backend.decode_splits(batch))
        return self.model(self.ids[:batch], positions, self.kv_caches, meta, self.rows[:batch])

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.monotonic()
        self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.stream(self.stream):
            for batch in reversed(self.buckets):
                self._forward(batch)  # compiles kernels and settles the allocator outside the capture
                self.stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                    logits = self._forward(batch)
                self.graphs[batch] = (graph, logits)
        self.stream.synchronize()
        log.info("captured %d decode graphs (batch %d..%d) in %.1f s", len(self.graphs), self.buckets[0],
                 self.buckets[-1], time.monotonic() - start)  # fmt: skip

    def run(
        self, batch: int, ids: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor
    ) -> torch.Tensor:
        """On the compute stream: ids/context_lens [batch], block_tables [batch, W] (padded rows included)."""
        width = block_tables.shape[1]
        self.ids[:batch].copy_(ids)
        self.context_lens[:batch].copy_(context_lens)
        self.block_tables[:batch, :width].copy_(block_tables)
        graph, logits = self.graphs[batch]
        graph.replay()
        return logits
