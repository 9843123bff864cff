"""Drafts looked up again on the device in the overlap loop (engine/device/draft_lookup.py): a step planned
while the step before it is in flight verifies drafts that follow the sequence's real tokens, not the host's
guess of them; outputs stay those without speculation."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from cbd.engine.sampling_params import SamplingParams
from cbd.engine.sequence import Sequence
from cbd.engine.spec.drafter import NgramDrafter
from cbd.model.loader import LoadedModel, load_model
from helpers import make_core, run_all

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import speculative_gpu  # noqa: E402


@pytest.fixture(scope="module")
def chain_model(tiny_checkpoint) -> LoadedModel:
    """A tiny model whose greedy next token is a fixed function of the last one, by a wide margin (the 8B
    replay's model of bench/speculative_gpu.py: its layers add nothing, its LM head is the embedding table
    permuted)."""
    loaded = load_model(str(tiny_checkpoint("llama")))
    speculative_gpu._next_token_model(loaded)
    return loaded


class _GuessBlind:
    """The host's n-gram drafter, except that after a guess of tokens in flight it proposes tokens that are
    never right: only drafts made in the real context can be kept."""

    def __init__(self, wrong: int) -> None:
        self.ngram, self.wrong = NgramDrafter(), wrong

    def propose(self, seq: Sequence, k: int, end: int | None = None) -> list[int]:
        drafts = self.ngram.propose(seq, k, end)
        if end is not None and end > seq.num_known_tokens and drafts:
            return [drafts[0]] + [self.wrong] * (len(drafts) - 1)  # its first stands for the token in flight
        return drafts


def test_drafts_after_a_guess_follow_the_real_tokens(chain_model) -> None:
    loaded = chain_model
    params = SamplingParams(max_tokens=59, temperature=0.0, ignore_eos=True)
    chain = [3] + run_all(make_core(loaded, speculative="off"), [[3]], params)[0]["tokens"][0]
    prompt = chain + [7, 8] + chain[:3]  # the model continues the chain: every later token is in the prompt
    wrong = next(t for t in range(10, 200) if t not in chain)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    off = run_all(make_core(loaded, speculative="off"), [prompt], params)[0]["tokens"]
    assert off[0] == chain[3:43]
    kept = {}
    for device in (False, True):
        core = make_core(loaded, overlap="on", speculative="ngram", speculative_device_drafts=device, block_size=4)
        speculator = core.scheduler.speculator
        speculator.drafter, speculator.backoff = _GuessBlind(wrong), False
        assert run_all(core, [prompt], params)[0]["tokens"] == off
        kept[device] = speculator.num_accepted_tokens
        assert (speculator.num_device_drafted > 0) == device
        assert core.block_manager.num_used_blocks == 0
        _reported(core.stats(), speculator.num_device_drafted)
    # With the host's guessed drafts only the first of each run after a guess could be kept.
    assert kept[True] >= 2 * kept[False], kept


def _reported(stats, device_drafted: int) -> None:  # type: ignore[no-untyped-def]
    """The count reaches GetStats (device_drafted_steps) and the metrics (cbd_spec_device_drafted_steps_total)."""
    from prometheus_client import generate_latest

    from cbd.server.info import stats as stats_message
    from cbd.server.metrics import Metrics

    assert stats.speculation is not None and stats.speculation.num_device_drafted == device_drafted
    assert stats_message(stats, 0, 1.0).device_drafted_steps == device_drafted
    metrics = Metrics()
    metrics.watch_engine(lambda: stats, lambda: 0, dict, dict)
    assert f"cbd_spec_device_drafted_steps_total {float(device_drafted)}" in generate_latest(metrics.registry).decode()
