"""Incremental detokenisation and stop-string matching for one candidate."""

from __future__ import annotations

import weakref
from typing import Any

# Tokens pushed with no text out yet after which their bytes are given out as they stand. A character is at most
# four bytes, so valid text never waits this long: only a run of broken bytes does (each push would otherwise
# decode the whole run again: a request that samples garbage would cost the process quadratic time).
HOLD_LIMIT = 8
_KEEP = 3  # tokens a forced release keeps back: a character's last bytes may still come
_SPECIAL_IDS: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()


class IncrementalDetokenizer:
    """Turns token ids into text as they arrive; multi-byte characters split across tokens come out whole.

    Each push decodes a bounded window of tokens, whatever the output holds:
    - skipped special tokens (skip_special_tokens) never enter it: they have no text;
    - with a fast tokenizer, the tokenizers library's DecodeStream; once HOLD_LIMIT tokens in a row gave no
      text (broken bytes), the window below takes over from where the stream stood;
    - otherwise a window of the tokens since the last text and those before it (their text decides how
      the new ones read, e.g. a leading space): text goes out when it grows and holds no partial character,
      or when HOLD_LIMIT tokens wait: then as it stands (replacement characters for the broken bytes) up to
      the last few tokens, which may begin a character, never splitting one.
    Valid text reads as the whole output decoded at once, also after broken bytes.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self._skip = skip_special_tokens
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend
        self._decode: Any = backend.decode if backend is not None else tokenizer.decode
        self._special = special_ids(tokenizer) if skip_special_tokens else frozenset()
        self._stream: Any = None
        if backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._held: list[int] = []  # stream mode: pushed since its last text
        self._context: int | None = None  # stream mode: the token that gave its last text
        # Window mode: ids[start:read] gave the last text (`prefix`); ids[read:] have given none yet.
        self._ids: list[int] = []
        self._start = self._read = 0
        self._prefix = ""

    @property
    def held(self) -> int:
        """Tokens pushed whose text has not come out (at most HOLD_LIMIT - 1 between pushes)."""
        return len(self._held) if self._stream is not None else len(self._ids) - self._read

    def push(self, token_id: int) -> str:
        if token_id in self._special:
            return ""
        if self._stream is not None:
            text = self._stream.step(self._backend, token_id)
            if text:
                self._context = token_id
                if self._held:
                    self._held.clear()
                return text
            self._held.append(token_id)
            if len(self._held) < HOLD_LIMIT:
                return ""
            # Broken bytes: go on in window mode, the stream's last text as the window's context.
            self._stream = None
            context = [] if self._context is None else [self._context]
            self._ids = context + self._held
            self._start, self._read = 0, len(context)
            self._prefix = self._decode(context, skip_special_tokens=self._skip) if context else ""
            return self._window_text(force=True)
        self._ids.append(token_id)
        return self._window_text(force=len(self._ids) - self._read >= HOLD_LIMIT)

    def _window_text(self, force: bool) -> str:
        ids, prefix = self._ids, self._prefix
        text = self._decode(ids[self._start :], skip_special_tokens=self._skip)
        end = len(ids)
        if len(text) <= len(prefix) or text.endswith("\ufffd"):  # no new whole character yet
            if not force:
                return ""
            end, text = self._cut(text)
        new = text[len(prefix) :] if text.startswith(prefix) else text
        self._start, self._read = self._read, end
        self._prefix = self._decode(ids[self._start : end], skip_special_tokens=self._skip)
        if self._start > 64:  # what lies before the window is never read again
            del ids[: self._start]
            self._read -= self._start
            self._start = 0
        return new

    def _cut(self, text: str) -> tuple[int, str]:
        """Where a forced release ends, and the window's text up to there: before the last _KEEP tokens
        (they may begin a character the next ones complete), moved back until the text there is what the
        whole window (`text`) reads: a character is never split, and what follows keeps its context."""
        ids, start = self._ids, self._start
        end = len(ids) - _KEEP
        head = self._decode(ids[start:end], skip_special_tokens=self._skip)
        while end > self._read + 1 and not text.startswith(head):
            end -= 1
            head = self._decode(ids[start:end], skip_special_tokens=self._skip)
        return end, head


def special_ids(tokenizer: Any) -> frozenset[int]:
    """The ids that decoding with skip_special_tokens leaves out (the backend's special added tokens)."""
    try:
        return _SPECIAL_IDS[tokenizer]
    except KeyError:
        pass
    except TypeError:  # not weakly referenceable: not cached
        return _special_ids(tokenizer)
    found = _SPECIAL_IDS[tokenizer] = _special_ids(tokenizer)
    return found


def _special_ids(tokenizer: Any) -> frozenset[int]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return frozenset(i for i, token in backend.get_added_tokens_decoder().items() if token.special)
    return frozenset(getattr(tokenizer, "all_special_ids", ()))


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
