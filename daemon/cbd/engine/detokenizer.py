"""Incremental detokenisation and stop-string matching for one candidate."""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Turns token ids into text as they arrive; multi-byte characters split across tokens come out whole.

    Uses the tokenizers library's DecodeStream when the tokenizer has a fast backend; otherwise
    decodes the whole output and emits the new suffix once it holds no partial character.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream: Any = None
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []
        self._emitted = 0

    def push(self, token_id: int) -> str:
        if self._stream is not None:
            return self._stream.step(self._backend, token_id) or ""
        self._ids.append(token_id)
        text = self._tokenizer.decode(self._ids, skip_special_tokens=self._skip)
        if text.endswith("\ufffd"):
            return ""
        new, self._emitted = text[self._emitted :], len(text)
        return new


class StopStringMatcher:
    """Finds the earliest stop string in the growing text and holds back the tail that could start one (the
    longest tail that is a beginning of a stop string: text that cannot start one is released at once).

    The text it releases never contains a stop string or a part of one.
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = stops
        self._holdback = max((len(s) for s in stops), default=1) - 1
        self._firsts = frozenset(s[0] for s in stops if s)
        self._text = ""
        self._released = 0

    def feed(self, new_text: str) -> tuple[str, bool]:
        """Returns (text safe to release now, whether a stop string was found)."""
        if not new_text:
            return "", False
        search_from = max(0, len(self._text) - self._holdback)
        self._text += new_text
        hits = [p for p in (self._text.find(s, search_from) for s in self._stops) if p >= 0]
        if hits:
            end = min(hits)
            self._text = self._text[:end]
            return self._take(max(end, self._released)), True
        return self._take(self._start_of_a_stop()), False

    def _start_of_a_stop(self) -> int:
        """Where the longest unreleased tail that begins some stop string starts (the text's end: none)."""
        text = self._text
        for at in range(max(self._released, len(text) - self._holdback), len(text)):
            if text[at] in self._firsts:
                tail = text[at:]
                if any(stop.startswith(tail) for stop in self._stops):
                    return at
        return len(text)

    def flush(self) -> str:
        """Release the held-back tail (the candidate finished for another reason)."""
        return self._take(len(self._text))

    def _take(self, end: int) -> str:
        out, self._released = self._text[self._released : end], end
        return out
