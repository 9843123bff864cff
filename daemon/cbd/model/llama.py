"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM2) over a paged KV pool.

Tokens of all scheduled sequences are packed into one row dimension `T`; there is no batch axis.
Projections are fused (q|k|v and gate|up) so each layer runs four GEMMs; on Hopper and newer a prefill-sized
step's gate|up GEMM applies SiLU-mul in its epilogue (swiglu_gemm.py). Only the sampled rows need the
last layer past its K/V: given their attention metadata (`sampled`), that layer's attention, output
projection and MLP run on those rows alone (a prefill chunk that samples nothing writes its KV and stops).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cbd.model import ops, swiglu_gemm
from cbd.model.spec import ModelSpec


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual); one fused kernel on CUDA."""
        return ops.rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.qkv_proj = nn.Linear(spec.hidden_size, spec.q_size + 2 * spec.kv_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(spec.q_size, spec.hidden_size, bias=spec.o_bias)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.scale = spec.head_dim**-0.5
        self.tp: Any = None  # tensor-parallel collectives, when this rank holds a shard

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [T]
        cos_table: torch.Tensor,  # [P, D] fp32
        sin_table: torch.Tensor,
        kv_cache: torch.Tensor,  # [S, 2, Hkv, D]
        meta,  # backend metadata: .slot_mapping, .attend(q, kv_cache, scale)
        rows: torch.Tensor | None = None,  # [N]: only these rows go on past the K/V write (their queries)
        rows_meta=None,  # with rows: the metadata of their attention (attention.sampled_layout)
    ) -> torch.Tensor:  # [T or N, hidden]
        s = self.spec
        qkv = self.qkv_proj(x)  # [T, q | k | v]
        num_tokens = qkv.shape[0]
        q = qkv[:, : s.q_size].view(num_tokens, s.num_heads, s.head_dim)
        k = qkv[:, s.q_size : s.q_size + s.kv_size].view(num_tokens, s.num_kv_heads, s.head_dim)
        v = qkv[:, s.q_size + s.kv_size :].view(num_tokens, s.num_kv_heads, s.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.reshape(-1, s.head_dim))[0].view(num_tokens, s.num_heads, s.head_dim)
            k = self.k_norm(k.reshape(-1, s.head_dim))[0].view(num_tokens, s.num_kv_heads, s.head_dim)
        q = ops.rope_and_write_kv(q, k, v, positions, cos_table, sin_table, kv_cache, meta.slot_mapping)
        if rows is not None:
            q, meta = q.index_select(0, rows), rows_meta
        # A step that samples nothing (prefill chunks only) needs no attention past its K/V.
        out = q if q.shape[0] == 0 else meta.attend(q, kv_cache, self.scale)
        out = self.o_proj(out.reshape(-1, s.q_size))
        return out if self.tp is None else self.tp.all_reduce(out)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)
        self.tp: Any = None
        # gate|up GEMM with SiLU-mul in its epilogue, for eager steps of swiglu_gemm.MIN_ROWS rows or more
        # (installed by swiglu_gemm.install where it can run; never inside a CUDA graph)
        self.swiglu: swiglu_gemm.SwiGLU | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            self.swiglu is not None
            and x.shape[0] >= swiglu_gemm.MIN_ROWS
            and not (x.is_cuda and torch.cuda.is_current_stream_capturing())
        ):
            h = self.swiglu(x, self.gate_up_proj.weight)
        else:
            h = ops.silu_mul(self.gate_up_proj(x))
        out = self.down_proj(h)
        return out if self.tp is None else self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(self, x, residual, positions, cos_table, sin_table, kv_cache, meta, rows=None, rows_meta=None):
        """x: this layer's input delta; residual: the running sum (None before the first layer). With rows (and
        their attention's rows_meta): every row's K/V written, the outputs of those rows only."""
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, cos_table, sin_table, kv_cache, meta, rows, rows_meta)
        if rows is not None:
            residual = residual.index_select(0, rows)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class CausalLM(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        # Given its (uninitialised) weight: the loader fills every weight, and nn.Embedding's own random init
        # on the meta device would import torch's compiler stack (~1 s of every engine start).
        self.embed_tokens = nn.Embedding(
            spec.vocab_size, spec.hidden_size, _weight=torch.empty(spec.vocab_size, spec.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.tp: Any = None
        self.full_vocab_size = spec.vocab_size
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # cos/sin tables [max_positions, D] in fp32, filled by set_rope().
        self.register_buffer("cos_table", torch.empty(0), persistent=False)
        self.register_buffer("sin_table", torch.empty(0), persistent=False)

    def set_rope(self, inv_freq: torch.Tensor, scale: float, max_positions: int) -> None:
        device = self.embed_tokens.weight.device
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq.float())  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_table = (emb.cos() * scale).to(device)
        self.sin_table = (emb.sin() * scale).to(device)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: torch.Tensor,  # [L, S, 2, Hkv, D]
        meta,  # attention backend metadata for this step
        logits_indices: torch.Tensor,  # [N] rows whose next-token logits are wanted
        sampled=None,  # metadata of those rows' attention: the last layer computes only them past its K/V
    ) -> torch.Tensor:  # [N, vocab] fp32
        tp = self.tp
        x = self.embed_tokens(input_ids) if tp is None else tp.embed(self.embed_tokens, input_ids)
        residual = None
        last = len(self.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            rows = logits_indices if sampled is not None and i == last else None
            x, residual = layer(x, residual, positions, self.cos_table, self.sin_table, kv_cache, meta, rows, sampled)
        assert residual is not None  # set by the first layer
        if sampled is None:
            x, residual = x[logits_indices], residual[logits_indices]
        x, _ = self.norm(x, residual)
        logits = self.lm_head(x)
        if tp is not None:
            logits = tp.gather_logits(logits, self.full_vocab_size)
        return logits.float()

    def set_tensor_parallel(self, tp, full_vocab_size: int) -> None:
        """Install the collectives of a tensor-parallel rank (see tensor_parallel.py) on every layer."""
        self.tp, self.full_vocab_size = tp, full_vocab_size
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            layer.self_attn.tp = layer.mlp.tp = tp
