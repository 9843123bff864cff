"""Vectorised sampling on the logits' device, with no host sync.

Randomness is counter-based: the noise for row r and vocab entry v is a hash of
(seed_r, candidate_r, position_r, v). A candidate therefore draws the same token whatever else is
in the batch, after a preemption, or on another run; candidates of one request use separate streams.
Sampling is the Gumbel-max trick over the filtered, temperature-scaled logits, which draws exactly
from their softmax. A row whose temperature is below MIN_TEMPERATURE is greedy, and so is a sampled row
whose scaled logits are not finite (inf or NaN after the division): a token is never drawn from them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cbd.engine.sampling_params import MIN_TEMPERATURE

_MASK32 = 0xFFFFFFFF
_BELOW_ONE = 1.0 - 2.0**-24  # the largest float32 below 1


@dataclass(slots=True)
class SamplingBatch:
    """Per-row parameters, all [N] tensors on the logits' device."""

    temperature: torch.Tensor  # float32; below MIN_TEMPERATURE (e.g. 0) marks a greedy row
    top_k: torch.Tensor  # int64; 0 disables
    top_p: torch.Tensor  # float32; 1 disables
    min_p: torch.Tensor  # float32; 0 disables
    seed: torch.Tensor  # int64 in [0, 2**63)
    stream: torch.Tensor  # int64: candidate index
    position: torch.Tensor  # int64: index of the token being sampled within its sequence
    any_random: bool
    any_top_k_or_p: bool
    any_min_p: bool
    max_logprobs: int | None  # None: no logprobs this step


@dataclass(slots=True)
class SampleResult:
    token_ids: torch.Tensor  # [N] int64
    logprobs: torch.Tensor | None  # [N] float32: log-softmax of the raw logits at the chosen token
    top_ids: torch.Tensor | None  # [N, K] int64
    top_logprobs: torch.Tensor | None  # [N, K] float32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    # murmur3 finaliser on int64 tensors holding 32-bit values; products wrap, the mask keeps 32 bits.
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def uniform_noise(batch: SamplingBatch, vocab_size: int) -> torch.Tensor:
    """[N, V] float32 in (0, 1), a pure function of (seed, stream, position, vocab index)."""
    seed = batch.seed
    key = _fmix32((seed & _MASK32) ^ 0x243F6A88)
    key = _fmix32(key ^ ((seed >> 32) & _MASK32))
    key = _fmix32(key ^ (batch.stream & _MASK32) ^ 0x5BE0CD19)
    key = _fmix32(key ^ (batch.position & _MASK32))  # [N]
    vocab = torch.arange(vocab_size, device=seed.device, dtype=torch.int64)
    bits = _fmix32(key[:, None] ^ _fmix32(vocab * 0x9E3779B1 & _MASK32)[None, :])
    # (k + 0.5) / 2^24 for the top k rounds to exactly 1.0 in float32, where the Gumbel noise would be +inf
    # (a token drawn whatever its probability, NaN for a masked one): cap at the largest float below 1.
    return (((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))).clamp_(max=_BELOW_ONE)


def _filter(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Mask (to -inf) what top-k, top-p and min-p exclude; logits are already temperature-scaled."""
    if batch.any_top_k_or_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        k = torch.where(batch.top_k > 0, batch.top_k, vocab)[:, None]
        drop = ranks >= k
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token once the mass strictly before it already reaches top_p (the first always stays).
        drop |= (probs.cumsum(dim=-1) - probs) >= batch.top_p[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    if batch.any_min_p:
        probs = logits.softmax(dim=-1)
        threshold = batch.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SampleResult:
    """logits: [N, V] float32."""
    greedy_ids = logits.argmax(dim=-1)
    if batch.any_random:
        random_rows = batch.temperature >= MIN_TEMPERATURE
        temperature = torch.where(random_rows, batch.temperature, 1.0)[:, None]
        scaled = logits / temperature
        # amax is inf or NaN where any entry is (and -inf where nothing is allowed): such rows stay greedy.
        random_rows &= scaled.amax(dim=-1).isfinite()
        scaled = _filter(scaled, batch)
        gumbel = -torch.log(-torch.log(uniform_noise(batch, logits.shape[-1])))
        random_ids = (scaled + gumbel).argmax(dim=-1)
        token_ids = torch.where(random_rows, random_ids, greedy_ids)
    else:
        token_ids = greedy_ids
    if batch.max_logprobs is None:
        return SampleResult(token_ids, None, None, None)
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(-1, token_ids[:, None])[:, 0]
    if batch.max_logprobs == 0:
        return SampleResult(token_ids, chosen, None, None)
    top = logprobs.topk(batch.max_logprobs, dim=-1)
    return SampleResult(token_ids, chosen, top.indices, top.values)
