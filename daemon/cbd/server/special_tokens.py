"""Client text never becomes a special token: only the chat template's own text may.

A tokenizer matches its special tokens (`<|im_end|>`, `<|eot_id|>`, ...) anywhere in the text it is given,
so a chat message whose content holds `<|im_end|>\\n<|im_start|>system\\n...` would forge a system turn, and
a raw text prompt could end itself early. Here every client string that goes into the template
(message contents, roles, tool-call ids and arguments, tools' names, descriptions and schemas, keys
included) has its special-token strings replaced by placeholders before rendering: `<nonce>`-tagged
letters and digits, which the template's filters (trim, tojson, concatenation) leave as they are.
The rendered text is then tokenized in pieces: the template's special tokens (all that is left in the
text) as their ids, and the text between them, placeholders restored, with special tokens split as
plain text. Without any special-token string in the client's strings, which is nearly always, the
conversation is tokenized exactly as before, in one call.

Special tokens are the tokenizer's added tokens marked special (what `split_special_tokens` splits);
added tokens that are not special (e.g. Qwen's `<tool_call>`) are ordinary vocabulary. An added token's
lstrip / rstrip (it takes the whitespace beside it) is honoured at the pieces' seams. The pieces are
tokenized as the tokenizer itself does (it splits on special tokens first), except that a SentencePiece
tokenizer that prefixes only the text's first word with "▁" prefixes each piece's: a difference of one
token after a special token, only in prompts whose client strings held special-token strings.
"""

from __future__ import annotations

import copy
import re
import secrets
from typing import Any


class SpecialTokens:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        # Splitting special tokens is a flag of the tokenizer's state, not of a call (transformers sets it on
        # the shared Rust tokenizer when a call asks otherwise): a copy that always splits, so that threads
        # tokenizing at once never flip it under each other.
        self.as_text = copy.deepcopy(tokenizer)
        self.as_text.split_special_tokens = True
        added = getattr(tokenizer, "added_tokens_decoder", {})
        self.tokens = {t.content: (i, t) for i, t in added.items() if t.special and t.content}
        strings = sorted(self.tokens, key=len, reverse=True)  # longest first: a token inside another loses
        self.pattern = re.compile("|".join(map(re.escape, strings))) if strings else None

    def encode_text(self, text: str, add_special_tokens: bool, allow_special_tokens: bool) -> list[int]:
        """A raw text prompt: special-token strings are text unless the caller asked for them."""
        if allow_special_tokens or self.pattern is None or not self.pattern.search(text):
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        return list(self.as_text.encode(text, add_special_tokens=add_special_tokens))

    def render(self, messages: list[dict], add_generation_prompt: bool, **template_kwargs: Any) -> list[int]:
        """Token ids of the conversation rendered with the chat template, client strings as text."""
        forged: list[str] = []
        nonce = secrets.token_hex(6)
        escaped: Any = self._escape([messages, template_kwargs], forged, nonce) if self.pattern else None
        if not forged:  # nearly always: the conversation as given, tokenized in one call
            rendered = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=True,
                **template_kwargs,
            )  # fmt: skip
            return list(rendered["input_ids"])
        messages, template_kwargs = escaped
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False, **template_kwargs
        )
        return self._encode_rendered(text, forged, nonce)

    def _escape(self, value: Any, forged: list[str], nonce: str) -> Any:
        """`value` with every special-token string in its strings (dict keys too) replaced by a placeholder."""
        if isinstance(value, str):
            # The pattern is None only when the tokenizer has no special tokens, and then nothing calls _escape.
            return self.pattern.sub(lambda m: _placeholder(nonce, forged, m.group(0)), value)  # type: ignore[union-attr]
        if isinstance(value, dict):
            return {self._escape(k, forged, nonce): self._escape(v, forged, nonce) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self._escape(v, forged, nonce) for v in value]
        return value

    def _encode_rendered(self, text: str, forged: list[str], nonce: str) -> list[int]:
        """Tokenize a rendering whose special-token strings are all the template's own."""
        assert self.pattern is not None
        # Placeholders match in any case: a template may upper-case or capitalise a string (e.g. a role).
        pieces = re.compile(f"(?i:cbd{nonce}x(\\d+)x)|{self.pattern.pattern}")
        ids: list[int] = []
        plain: list[str] = []  # text since the last special token, placeholders restored
        at, strip_left = 0, False  # strip_left: the last special token takes the whitespace after it
        for m in pieces.finditer(text):
            plain.append(text[at : m.start()])
            at = m.end()
            if m.group(1) is not None:
                plain.append(forged[int(m.group(1))])
                continue
            token_id, token = self.tokens[m.group(0)]
            ids += self._plain("".join(plain), strip_left, token.lstrip)
            ids.append(token_id)
            plain, strip_left = [], token.rstrip
        plain.append(text[at:])
        return ids + self._plain("".join(plain), strip_left, False)

    def _plain(self, text: str, strip_left: bool, strip_right: bool) -> list[int]:
        text = text.lstrip() if strip_left else text
        text = text.rstrip() if strip_right else text
        if not text:
            return []
        return list(self.as_text.encode(text, add_special_tokens=False))


def _placeholder(nonce: str, forged: list[str], token: str) -> str:
    forged.append(token)
    return f"cbd{nonce}x{len(forged) - 1}x"
