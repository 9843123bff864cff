"""What a KV format costs in quality: the same tokens through a float pool and an FP8 pool.

Teacher-forced: the token sequence is fed in prefill chunks (each chunk attends over what the
earlier chunks left in the pool, so every key and value is read back from the pool, as in
serving), and the next-token distribution at every position is compared: top-1 agreement and
KL(float || fp8). Used by the tests (CPU, the torch reference) and bench/long_context_gpu.py (CUDA,
the Triton kernels).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cbd.model import kv_format
from cbd.model.attention import layout_from_lists
from cbd.model.attention_backends import select_backend
from cbd.model.llama import CausalLM


@dataclass(frozen=True, slots=True)
class KvQuality:
    positions: int
    top1_agreement: float  # share of positions whose argmax is the same
    mean_kl: float  # nats, KL(reference || fp8) averaged over positions
    max_kl: float


@torch.inference_mode()
def teacher_forced_logits(
    model: CausalLM, token_ids: list[int], fp8: bool, chunk: int = 256, block_size: int = 16, backend: str = "auto"
) -> torch.Tensor:
    """[len(token_ids), vocab] fp32 logits, the sequence prefilled chunk by chunk through a paged pool."""
    spec = model.spec
    device = model.embed_tokens.weight.device
    num_blocks = -(-len(token_ids) // block_size)
    shape = kv_format.pool_shape(num_blocks * block_size, spec.num_kv_heads, spec.head_dim, fp8)
    pool = torch.zeros(
        spec.num_layers, *shape, dtype=torch.uint8 if fp8 else model.embed_tokens.weight.dtype, device=device
    )
    attention = select_backend(
        backend, device, model.embed_tokens.weight.dtype, block_size, spec.sliding_window, spec.num_kv_heads, fp8,
        spec.head_dim,
    )  # fmt: skip
    table = list(range(num_blocks))
    ids = torch.tensor(token_ids, device=device)
    out = []
    for start in range(0, len(token_ids), chunk):
        end = min(start + chunk, len(token_ids))
        layout = layout_from_lists([end - start], [end], [table], block_size, device)
        meta = attention.prepare(layout)
        positions = torch.arange(start, end, device=device)
        out.append(model(ids[start:end], positions, pool, meta, torch.arange(end - start, device=device)))
    return torch.cat(out)


def compare(reference: torch.Tensor, fp8: torch.Tensor) -> KvQuality:
    """Per-position comparison of two [N, vocab] logits tensors."""
    ref_log = torch.log_softmax(reference.float(), -1)
    fp8_log = torch.log_softmax(fp8.float(), -1)
    kl = (ref_log.exp() * (ref_log - fp8_log)).sum(-1)
    agree = (reference.argmax(-1) == fp8.argmax(-1)).float().mean()
    return KvQuality(reference.shape[0], float(agree), float(kl.mean()), float(kl.max()))


def measure(model: CausalLM, token_ids: list[int], chunk: int = 256, backend: str = "auto") -> KvQuality:
    """FP8 pool against the model's own dtype on the same tokens."""
    reference = teacher_forced_logits(model, token_ids, fp8=False, chunk=chunk, backend=backend)
    quantized = teacher_forced_logits(model, token_ids, fp8=True, chunk=chunk, backend=backend)
    return compare(reference, quantized)
