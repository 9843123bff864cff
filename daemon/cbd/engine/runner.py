"""ModelRunner: turns a StepPlan into device work and returns sampled tokens.

Owns the KV pool `[layers, num_blocks * block_size, 2, kv_heads, head_dim]` and stages each step's
inputs. One sampling row per sampled chunk; a chunk that ends a prompt with pending forks gets one
row per candidate, all reading the same logits row (prefill once, then fork).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cbd.engine.sampler import SampleResult, SamplingBatch, sample
from cbd.engine.scheduler import StepPlan
from cbd.engine.sequence import Sequence
from cbd.model.attention import build_metadata
from cbd.model.llama import CausalLM


@dataclass(slots=True)
class SampleRow:
    seq: Sequence
    candidate_index: int


@dataclass(slots=True)
class StepResult:
    rows: list[SampleRow]
    token_ids: list[int]
    logprobs: list[float] | None
    top_ids: list[list[int]] | None
    top_logprobs: list[list[float]] | None


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int) -> None:
        spec = model.spec
        self.model = model
        self.block_size = block_size
        self.device = model.embed_tokens.weight.device
        self.kv_caches = torch.zeros(
            spec.num_layers, num_blocks * block_size, 2, spec.num_kv_heads, spec.head_dim,
            dtype=model.embed_tokens.weight.dtype, device=self.device,
        )  # fmt: skip

    @staticmethod
    def kv_bytes_per_block(model: CausalLM, block_size: int) -> int:
        spec = model.spec
        itemsize = model.embed_tokens.weight.element_size()
        return spec.num_layers * 2 * block_size * spec.num_kv_heads * spec.head_dim * itemsize

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        self._copy_blocks(plan.block_copies)
        ids: list[int] = []
        positions: list[int] = []
        logits_rows: list[int] = []
        rows: list[SampleRow] = []
        row_of_logits: list[int] = []
        for chunk in plan.chunks:
            seq, start = chunk.seq, chunk.seq.num_computed_tokens
            ids += seq.token_ids[start : start + chunk.num_new_tokens]
            positions += range(start, start + chunk.num_new_tokens)
            if chunk.samples:
                logits_rows.append(len(ids) - 1)
                if seq.pending_forks:
                    candidates = range(seq.candidate_index, seq.candidate_index + seq.pending_forks + 1)
                else:
                    candidates = range(seq.candidate_index, seq.candidate_index + 1)
                for c in candidates:
                    rows.append(SampleRow(seq, c))
                    row_of_logits.append(len(logits_rows) - 1)
        meta = build_metadata(
            [c.num_new_tokens for c in plan.chunks],
            [c.seq.num_computed_tokens + c.num_new_tokens for c in plan.chunks],
            [c.seq.block_table for c in plan.chunks],
            self.block_size,
            self.model.spec.sliding_window,
            self.device,
        )
        logits = self.model(
            torch.tensor(ids, device=self.device),
            torch.tensor(positions, device=self.device),
            self.kv_caches,
            meta,
            torch.tensor(logits_rows, device=self.device, dtype=torch.int64),
        )
        if not rows:
            return StepResult(rows, [], None, None, None)
        if len(row_of_logits) != len(logits_rows):
            logits = logits[torch.tensor(row_of_logits, device=self.device)]
        result = sample(logits, self._sampling_batch(rows))
        return _to_host(rows, result)

    def _sampling_batch(self, rows: list[SampleRow]) -> SamplingBatch:
        params = [r.seq.request.params for r in rows]
        wanted = [p.logprobs for p in params if p.logprobs is not None]

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        return SamplingBatch(
            temperature=tensor([p.temperature for p in params], torch.float32),
            top_k=tensor([p.top_k for p in params], torch.int64),
            top_p=tensor([p.top_p for p in params], torch.float32),
            min_p=tensor([p.min_p for p in params], torch.float32),
            seed=tensor([r.seq.request.seed for r in rows], torch.int64),
            stream=tensor([r.candidate_index for r in rows], torch.int64),
            position=tensor([r.seq.num_tokens for r in rows], torch.int64),
            any_random=any(not p.greedy for p in params),
            any_top_k_or_p=any(not p.greedy and (p.top_k > 0 or p.top_p < 1.0) for p in params),
            any_min_p=any(not p.greedy and p.min_p > 0.0 for p in params),
            max_logprobs=max(wanted) if wanted else None,
        )

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        bs = self.block_size
        for src, dst in copies:
            self.kv_caches[:, dst * bs : (dst + 1) * bs] = self.kv_caches[:, src * bs : (src + 1) * bs]


def _to_host(rows: list[SampleRow], result: SampleResult) -> StepResult:
    return StepResult(
        rows=rows,
        token_ids=result.token_ids.tolist(),
        logprobs=None if result.logprobs is None else result.logprobs.tolist(),
        top_ids=None if result.top_ids is None else result.top_ids.tolist(),
        top_logprobs=None if result.top_logprobs is None else result.top_logprobs.tolist(),
    )
