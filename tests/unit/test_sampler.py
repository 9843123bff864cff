"""Sampler: filters, greedy, seeded reproducibility independent of the batch, empirical distribution."""

from __future__ import annotations

import pytest
import torch

from cbd.engine.device.sampler import SamplingBatch, sample, uniform_noise


def batch(n: int, **values) -> SamplingBatch:
    def col(name: str, default, dtype):
        v = values.get(name, default)
        return torch.tensor(v if isinstance(v, list) else [v] * n, dtype=dtype)

    t = col("temperature", 1.0, torch.float32)
    k, p, m = col("top_k", 0, torch.int64), col("top_p", 1.0, torch.float32), col("min_p", 0.0, torch.float32)
    return SamplingBatch(
        temperature=t, top_k=k, top_p=p, min_p=m,
        seed=col("seed", 7, torch.int64), stream=col("stream", 0, torch.int64),
        position=col("position", 0, torch.int64),
        any_random=bool((t > 0).any()), any_top_k_or_p=bool((k > 0).any() or (p < 1).any()),
        any_min_p=bool((m > 0).any()), max_logprobs=values.get("max_logprobs"),
    )  # fmt: skip


def test_greedy_is_argmax_and_logprobs_are_log_softmax() -> None:
    logits = torch.randn(4, 50)
    result = sample(logits, batch(4, temperature=0.0, max_logprobs=3))
    assert result.token_ids.tolist() == logits.argmax(-1).tolist()
    expected = logits.log_softmax(-1)
    torch.testing.assert_close(result.logprobs, expected.max(-1).values)
    torch.testing.assert_close(result.top_logprobs, expected.topk(3).values)


def test_same_seed_same_token_whatever_the_batch() -> None:
    torch.manual_seed(0)
    row = torch.randn(1, 1000)
    alone = sample(row, batch(1, seed=1234, position=17)).token_ids.item()
    others = torch.randn(5, 1000)
    mixed = torch.cat([others[:2], row, others[2:]])
    seeds, positions = [1, 2, 1234, 4, 5, 6], [0, 0, 17, 3, 9, 9]
    got = sample(mixed, batch(6, seed=seeds, position=positions)).token_ids.tolist()
    assert got[2] == alone


def test_different_seeds_streams_and_positions_differ() -> None:
    b = batch(4, seed=[1, 2, 1, 1], stream=[0, 0, 1, 0], position=[0, 0, 0, 1])
    noise = uniform_noise(b, 4096)
    for i in range(4):
        for j in range(i + 1, 4):
            assert not torch.equal(noise[i], noise[j])
    assert bool((noise > 0).all() and (noise < 1).all())


def test_sampling_follows_the_softmax_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 20000
    logits = probs.log().repeat(n, 1)
    tokens = sample(logits, batch(n, seed=list(range(n)))).token_ids
    freq = torch.bincount(tokens, minlength=4).float() / n
    torch.testing.assert_close(freq, probs, atol=0.015, rtol=0)


def test_temperature_sharpens() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0]]).repeat(4000, 1)
    cold = sample(logits, batch(4000, temperature=0.1, seed=list(range(4000)))).token_ids
    assert (cold == 0).float().mean() > 0.99


@pytest.mark.parametrize(
    "kw, allowed",
    [
        (dict(top_k=2), {0, 1}),
        (dict(top_p=0.6), {0, 1}),  # 0.5 < 0.6, so the second token is still needed
        (dict(top_p=0.4), {0}),
        (dict(min_p=0.5), {0, 1}),  # p >= 0.5 * 0.5
        (dict(min_p=0.7), {0}),
    ],
)
def test_filters_restrict_the_support(kw, allowed) -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 3000
    tokens = sample(probs.log().repeat(n, 1), batch(n, seed=list(range(n)), **kw)).token_ids
    assert set(tokens.tolist()) == allowed


_M32 = 0xFFFFFFFF


def _fmix32(x: int) -> int:
    """murmur3's finaliser, the hash the sampler's noise is built from."""
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & _M32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def _unfmix32(x: int) -> int:
    """The inverse of `_fmix32` (each of its steps is a bijection on 32 bits)."""
    x ^= x >> 16
    x = (x * pow(0xC2B2AE35, -1, 1 << 32)) & _M32
    x ^= (x >> 13) ^ (x >> 26)
    x = (x * pow(0x85EBCA6B, -1, 1 << 32)) & _M32
    return x ^ (x >> 16)


def test_noise_never_reaches_one_so_a_token_without_probability_is_never_drawn() -> None:
    # The noise's top bucket ((2^24 - 0.5) / 2^24) rounds to exactly 1.0 in float32: infinite Gumbel noise,
    # a token drawn whatever its probability. Rather than hope a random draw lands there (one in 2^24), each
    # row's position is solved for (the hash inverted) so that its draw for one chosen token has every bit set.
    vocab, seed = 49152, 7
    assert all(_unfmix32(_fmix32(x)) == x for x in (0, 1, 0xDEADBEEF, _M32))
    key = _fmix32((seed & _M32) ^ 0x243F6A88)
    key = _fmix32(key ^ (seed >> 32))
    key = _fmix32(key ^ 0 ^ 0x5BE0CD19)  # stream 0
    chosen = [0, 1, 4097, vocab - 1]
    positions = [_unfmix32(_unfmix32(_M32) ^ _fmix32(v * 0x9E3779B1 & _M32)) ^ key for v in chosen]
    rows = len(chosen)
    b = batch(rows, seed=seed, position=positions)
    noise = uniform_noise(b, vocab)
    assert noise[torch.arange(rows), chosen].tolist() == [1.0 - 2.0**-24] * rows  # the top bucket, capped
    assert float(noise.max()) < 1.0 and float(noise.min()) > 0.0
    logits = torch.full((rows, vocab), float("-inf"))
    allowed = torch.tensor([5, 6, 7, 8])  # one possible token per row, never the one whose noise is at the top
    logits[torch.arange(rows), allowed] = 0.0
    assert sample(logits, b).token_ids.tolist() == allowed.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tiny", [1e-45, 1e-300])
def test_a_temperature_below_the_floor_is_greedy_with_finite_logprobs(dtype, tiny) -> None:
    from cbd.engine.sampling_params import MIN_TEMPERATURE, SamplingParams

    assert SamplingParams(temperature=tiny).greedy and not SamplingParams(temperature=MIN_TEMPERATURE).greedy
    torch.manual_seed(3)
    logits = (torch.randn(64, 300) * 8).to(dtype)
    # Every other row samples at temperature 1, so the sampling path runs beside the tiny-temperature rows.
    temperatures = [tiny if i % 2 == 0 else 1.0 for i in range(64)]
    result = sample(logits, batch(64, temperature=temperatures, seed=list(range(64)), max_logprobs=3))
    greedy = logits.argmax(-1)
    assert result.token_ids[0::2].tolist() == greedy[0::2].tolist()
    assert result.token_ids[1::2].tolist() != greedy[1::2].tolist()  # the others did sample
    assert result.logprobs is not None and result.top_logprobs is not None
    assert bool(result.logprobs.isfinite().all() and result.top_logprobs.isfinite().all())


def test_a_row_whose_scaled_logits_overflow_is_greedy_not_drawn_from_infinities() -> None:
    # Legal temperature, huge logits: both leaders overflow to +inf (and the softmax of top_p to NaN), where
    # an argmax over the noisy scores would take the first inf (token 0), not the most likely token (1).
    logits = torch.tensor([[1e35, 2e35, 0.0, 1.0], [0.0, 1.0, 0.5, 0.2]])
    for seed in range(20):
        for kw in ({}, {"top_p": 0.9}):
            result = sample(logits, batch(2, temperature=[1e-4, 0.0], seed=seed, **kw))
            assert result.token_ids.tolist() == [1, 1]
