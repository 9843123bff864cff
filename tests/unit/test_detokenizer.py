"""Incremental detokenisation: streamed text reads as the whole output decoded at once, and each push decodes
a bounded window whatever the output holds (skipped special tokens, runs of broken bytes)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from cbd.engine.detokenizer import HOLD_LIMIT, IncrementalDetokenizer, special_ids


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from cbd.model.files import load_tokenizer
    from cbd.model.loader import resolve_checkpoint

    return load_tokenizer(resolve_checkpoint(None))


@pytest.fixture(scope="module")
def metaspace() -> Any:
    """A Llama-style tokenizer (SentencePiece pieces, byte fallback, the first piece's leading space stripped):
    its text depends on the tokens before, unlike the default model's byte-level one."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {
        "<unk>": 0,
        "<s>": 1,
        "</s>": 2,
        **{f"<0x{b:02X}>": 3 + b for b in range(256)},
        "▁Hello": 259,
        "▁world": 260,
    }
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(["<s>", "</s>"])
    return SimpleNamespace(backend_tokenizer=tok, decode=tok.decode)


def metaspace_bytes(text: str) -> list[int]:
    return [3 + b for b in text.encode()]


class SlowTokenizer:
    """A tokenizer without a fast backend: decode and the special ids only (the window path)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.all_special_ids = sorted(special_ids(tokenizer))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> str:
    out = []
    for token_id in ids:
        out.append(detok.push(token_id))
        assert detok.held < HOLD_LIMIT
    return "".join(out)


def readme_ids(tokenizer: Any) -> list[int]:
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()[:6000]
    return tokenizer.encode(text, add_special_tokens=False)


def broken_bytes(tokenizer: Any) -> list[int]:
    """Tokens that are each a lone UTF-8 continuation byte (they complete a two-byte character after its
    first byte): alone, every one decodes to a replacement character."""
    lead = tokenizer.convert_tokens_to_ids("Ã")  # the byte-level vocabulary's byte 0xC3 (the start of "é")
    assert tokenizer.decode([lead]) == "\ufffd"
    found = [
        i for i in range(tokenizer.vocab_size)
        if tokenizer.decode([i]) == "\ufffd" and len(tokenizer.decode([lead, i])) == 1
    ]  # fmt: skip
    assert len(found) > 50
    return found


@pytest.mark.parametrize("slow", [False, True])
@pytest.mark.parametrize("skip", [True, False])
def test_streamed_text_equals_the_whole_decode(tokenizer: Any, skip: bool, slow: bool) -> None:
    ids = readme_ids(tokenizer)
    specials = sorted(special_ids(tokenizer))
    # Special tokens between the text's tokens, some in long runs (the end-of-turn token a model repeats).
    mixed = []
    for n, token_id in enumerate(ids):
        mixed.append(token_id)
        if n % 97 == 0:
            mixed += [specials[n % len(specials)]] * (1 + n % 40)
    tok = SlowTokenizer(tokenizer) if slow else tokenizer
    assert stream(IncrementalDetokenizer(tok, skip), mixed) == tokenizer.decode(mixed, skip_special_tokens=skip)


@pytest.mark.parametrize("slow", [False, True])
def test_runs_of_broken_bytes_come_out_as_replacement_characters_without_holding_the_run(
    tokenizer: Any, slow: bool
) -> None:
    garbage = broken_bytes(tokenizer)
    ids = readme_ids(tokenizer)[:200]
    # Text, a long run of lone continuation bytes, text again, and multi-byte characters split across tokens.
    run = ids[:100] + [garbage[i % len(garbage)] for i in range(500)] + ids[100:]
    run += tokenizer.encode(" héllo wörld — ✓ 日本語 🙂", add_special_tokens=False)
    tok = SlowTokenizer(tokenizer) if slow else tokenizer
    assert stream(IncrementalDetokenizer(tok), run) == tokenizer.decode(run, skip_special_tokens=True)


@pytest.mark.parametrize("slow", [False, True])
@pytest.mark.parametrize("bad", [1, HOLD_LIMIT - 1, HOLD_LIMIT, HOLD_LIMIT + 1, 2 * HOLD_LIMIT - 1, 3 * HOLD_LIMIT])
def test_characters_after_broken_bytes_come_out_whole(tokenizer: Any, slow: bool, bad: int) -> None:
    garbage = broken_bytes(tokenizer)
    hello = tokenizer.encode("Hello", add_special_tokens=False)
    for tail in (" é world", "é", "🙂 ok", " 日本語", "🙂🙂"):
        ids = hello + garbage[:bad] + tokenizer.encode(tail, add_special_tokens=False)
        tok = SlowTokenizer(tokenizer) if slow else tokenizer
        assert stream(IncrementalDetokenizer(tok), ids) == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("slow", [False, True])
@pytest.mark.parametrize("bad", [1, HOLD_LIMIT - 1, HOLD_LIMIT, HOLD_LIMIT + 1, 3 * HOLD_LIMIT])
def test_a_leading_space_that_depends_on_the_tokens_before_survives_broken_bytes(
    metaspace: Any, slow: bool, bad: int
) -> None:
    for tail in ([260], metaspace_bytes("é") + [260], metaspace_bytes("🙂") + [260, 260]):
        ids = [1, 259] + [3 + 0x80] * bad + tail  # <s> "▁Hello", lone continuation bytes, then more
        tok = SlowTokenizer(metaspace) if slow else metaspace
        assert stream(IncrementalDetokenizer(tok), ids) == metaspace.decode(ids, skip_special_tokens=True)


def test_a_thousand_skipped_special_tokens_hold_nothing(tokenizer: Any) -> None:
    eos = sorted(special_ids(tokenizer))[0]
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    assert stream(detok, [eos] * 1000) == ""
    assert detok.held == 0
    assert detok.push(tokenizer.encode("Hello", add_special_tokens=False)[0]) == "Hello"
