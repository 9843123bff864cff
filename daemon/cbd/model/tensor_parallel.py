"""Tensor parallelism: how the model is cut across the ranks of one host, and the collectives it needs.

Each rank builds the ordinary CausalLM over a *local* spec (its share of the heads and of the MLP's
intermediate size, its slice of the vocabulary) and fills it from the full checkpoint, slicing each
tensor on the way (`shard_tensor`):

  q|k|v, gate|up          column-parallel: a rank owns whole KV-head groups (its KV heads and the
                          query heads that read them) and a slice of the intermediate rows
  o_proj, down_proj       row-parallel: the matching input columns; outputs are summed (all-reduce),
                          the bias is added on rank 0 only
  embed_tokens, lm_head   vocab-parallel: a slice of the rows; the lookup is masked and summed, the
                          logits are gathered
  norms                   replicated

Splits are as even as possible and need not be equal (9 query / 3 KV heads over 2 ranks: 6|3 / 2|1).
The collectives run on the tensors' device (NCCL on CUDA, gloo on CPU) and can be captured in CUDA graphs.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cbd.errors import UnsupportedModel
from cbd.model.spec import ModelSpec


def _split(total: int, world: int, rank: int) -> range:
    base, extra = divmod(total, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


@dataclass(frozen=True, slots=True)
class Shard:
    rank: int
    world: int
    kv_heads: range  # global KV-head indices of this rank
    heads: range  # global query-head indices (the groups of its KV heads)
    inter: range  # rows of the MLP's intermediate dimension
    vocab: range  # rows of the vocabulary
    vocab_per_rank: int  # padded slice size, the same on every rank (for the logits all-gather)


def shard_of(spec: ModelSpec, rank: int, world: int) -> Shard:
    if spec.num_kv_heads < world:
        raise UnsupportedModel(f"tensor_parallel_size {world} exceeds the model's {spec.num_kv_heads} KV heads")
    group = spec.num_heads // spec.num_kv_heads
    kv = _split(spec.num_kv_heads, world, rank)
    per = -(-spec.vocab_size // world)
    vocab = range(min(rank * per, spec.vocab_size), min((rank + 1) * per, spec.vocab_size))
    return Shard(
        rank,
        world,
        kv,
        range(kv.start * group, kv.stop * group),
        _split(spec.intermediate_size, world, rank),
        vocab,
        per,
    )


def local_spec(spec: ModelSpec, shard: Shard) -> ModelSpec:
    return dataclasses.replace(
        spec,
        num_heads=len(shard.heads),
        num_kv_heads=len(shard.kv_heads),
        intermediate_size=len(shard.inter),
        vocab_size=shard.vocab_per_rank,
    )


_LAYER = re.compile(r"^model\.layers\.\d+\.(.+)\.(weight|bias)$")


def shard_tensor(name: str, tensor: torch.Tensor, spec: ModelSpec, shard: Shard) -> torch.Tensor:
    """This rank's part of a full checkpoint tensor (HF names)."""
    d = spec.head_dim
    m = _LAYER.match(name)
    module, kind = (m.group(1), m.group(2)) if m else (name, "weight")
    rows = None
    if module == "self_attn.q_proj":
        rows = (shard.heads.start * d, shard.heads.stop * d)
    elif module in ("self_attn.k_proj", "self_attn.v_proj"):
        rows = (shard.kv_heads.start * d, shard.kv_heads.stop * d)
    elif module in ("mlp.gate_proj", "mlp.up_proj"):
        rows = (shard.inter.start, shard.inter.stop)
    elif module in ("self_attn.o_proj", "mlp.down_proj"):
        if kind == "bias":
            return tensor if shard.rank == 0 else torch.zeros_like(tensor)
        cols = (shard.heads.start * d, shard.heads.stop * d) if module == "self_attn.o_proj" else (
            shard.inter.start, shard.inter.stop)  # fmt: skip
        return tensor[:, cols[0] : cols[1]]
    elif name in ("model.embed_tokens.weight", "lm_head.weight"):
        part = tensor[shard.vocab.start : shard.vocab.stop]
        if part.shape[0] < shard.vocab_per_rank:  # the last rank's slice is padded with zero rows
            pad = torch.zeros(shard.vocab_per_rank - part.shape[0], *part.shape[1:], dtype=part.dtype)
            part = torch.cat((part, pad.to(part.device)))
        return part
    if rows is None:
        return tensor
    return tensor[rows[0] : rows[1]]


class TensorParallel:
    """The collectives of one rank; installed on a CausalLM as `model.tp`."""

    def __init__(self, shard: Shard, group: dist.ProcessGroup | None = None) -> None:
        self.shard = shard
        self.group = group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def embed(self, embedding: torch.nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.shard.vocab.start
        inside = (local >= 0) & (local < len(self.shard.vocab))
        x = embedding(torch.where(inside, local, 0)) * inside[:, None].to(embedding.weight.dtype)
        return self.all_reduce(x)

    def gather_logits(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        parts = [torch.empty_like(logits) for _ in range(self.shard.world)]
        dist.all_gather(parts, logits.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[:, :vocab_size]
