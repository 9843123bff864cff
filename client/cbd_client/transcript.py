"""What a session holds, kept on the client, so that a session whose daemon is gone can be re-opened.

A session is a chat, a token history or a text, fixed by its first input. The transcript records the
prefix it was opened with, every turn's input and the reply that continues (candidate 0 of a one-candidate
turn; with n > 1 the candidate the next turn names). `as_prefix()` is then the whole history as one input
of the same kind: re-opened from it, a session renders (chat) or holds (tokens) what the lost one held.
"""

from __future__ import annotations

from typing import Any

from cbd_client.types import Candidate, Completion, Prompt


class Transcript:
    def __init__(self, prefix: Prompt | None) -> None:
        self.kind: str | None = None
        self.items: Any = None
        self._pending: list[Any] | None = None  # each candidate's reply of a turn with n > 1
        if prefix is not None:
            self._add(prefix)

    def _add(self, value: Any) -> None:
        if isinstance(value, str):
            kind, value = "text", value
        elif value and all(isinstance(m, dict) for m in value):
            kind, value = "chat", [dict(m) for m in value]
        else:
            kind, value = "tokens", list(value)
        if self.kind is None:
            self.kind, self.items = kind, value
        else:
            self.items = self.items + value

    def _reply(self, candidate: Candidate) -> Any:
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": candidate.text}
            if candidate.tool_calls:
                message["tool_calls"] = [{"id": c.id, "name": c.name, "arguments": c.arguments}
                                         for c in candidate.tool_calls]  # fmt: skip
            return [message]
        return candidate.text if self.kind == "text" else list(candidate.token_ids)

    def continue_from(self, parent: int | None) -> None:
        """The next turn continues the pending candidate `parent` (its reply joins the history)."""
        if self._pending is not None and parent is not None and 0 <= parent < len(self._pending):
            self._add(self._pending[parent])
        self._pending = None

    def turn(self, prompt: Prompt, completion: Completion) -> None:
        self._add(prompt)
        replies = [self._reply(c) for c in completion.candidates]
        if len(replies) == 1:
            self._add(replies[0])
        else:
            self._pending = replies

    def as_prefix(self) -> Prompt | None:
        return self.items

    def fork(self, candidate: int | None) -> Transcript:
        """The transcript of a fork of this session (from the pending `candidate`, if any)."""
        copy = Transcript(None)
        copy.kind, copy.items = self.kind, (self.items[:] if isinstance(self.items, list) else self.items)
        copy._pending = self._pending
        copy.continue_from(candidate)
        return copy
