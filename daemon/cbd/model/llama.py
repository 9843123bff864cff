"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM2) over a paged KV pool.

Tokens of all scheduled sequences are packed into one row dimension `T`; there is no batch axis.
Projections are fused (q|k|v and gate|up) so each layer runs four GEMMs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cbd.model.attention import AttentionMetadata, paged_attention, write_kv
from cbd.model.spec import ModelSpec


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused kernel; bit-identical to the unfused form in fp32
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in fp32 and cast back before the weight, as transformers does.
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos, sin: [T, 1, D] (the half-split layout of HF checkpoints)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.qkv_proj = nn.Linear(spec.hidden_size, spec.q_size + 2 * spec.kv_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(spec.q_size, spec.hidden_size, bias=spec.o_bias)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.scale = spec.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,  # [S, 2, Hkv, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        s = self.spec
        qkv = self.qkv_proj(x)  # [T, q | k | v]
        num_tokens = qkv.shape[0]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qkv[:, : s.q_size], qkv[:, s.q_size : s.q_size + s.kv_size]
            q = self.q_norm(q.reshape(num_tokens, s.num_heads, s.head_dim))
            k = self.k_norm(k.reshape(num_tokens, s.num_kv_heads, s.head_dim))
            qk = torch.cat((q, k), dim=1)
        else:
            qk = qkv[:, : s.q_size + s.kv_size].view(num_tokens, s.num_heads + s.num_kv_heads, s.head_dim)
        qk = apply_rope(qk, cos, sin)  # q and k heads rotated together: half the elementwise launches
        q, k = qk[:, : s.num_heads], qk[:, s.num_heads :]
        v = qkv[:, s.q_size + s.kv_size :].view(num_tokens, s.num_kv_heads, s.head_dim)
        write_kv(kv_cache, k, v, meta.slot_mapping)
        out = paged_attention(q, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(-1, s.q_size))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(self, x, cos, sin, kv_cache, meta):  # type: ignore[no-untyped-def]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
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
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # [N] rows whose next-token logits are wanted
    ) -> torch.Tensor:  # [N, vocab] fp32
        x = self.embed_tokens(input_ids)
        cos = self.cos_table[positions].to(x.dtype)[:, None, :]
        sin = self.sin_table[positions].to(x.dtype)[:, None, :]
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, kv_cache, meta)
        x = self.norm(x[logits_indices])
        return self.lm_head(x).float()
