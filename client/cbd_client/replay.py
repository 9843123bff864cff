"""A streamed session turn that survives the loss of its daemon (Session(..., recover=True).stream).

The turn is run again on a re-opened session; `Replay` keeps what the caller has already been given,
checks that the re-run reproduces it (greedy or seeded sampling on the same model does) and passes
on only what is new, so the caller sees one uninterrupted stream. A re-run that departs from what was
already streamed cannot be spliced: the turn fails with ABORTED (the session stays usable, without
that turn).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

import grpc

from cbd_client.errors import CbdError
from cbd_client.replies import add_delta
from cbd_client.types import Candidate, Completion, Delta, ToolCallDelta

_Piece = TypeVar("_Piece", str, tuple[int, ...])


@dataclass(slots=True)
class _Seen:
    """How much of a candidate the current run has reproduced."""

    tokens: int = 0
    text: int = 0
    arguments: dict[int, int] = field(default_factory=dict)  # tool call index -> characters


class Replay:
    def __init__(self, n: int) -> None:
        self.request_id = ""
        self.candidates = [Candidate(i) for i in range(n)]  # what the caller has been given
        self._seen = [_Seen() for _ in range(n)]

    @property
    def started(self) -> bool:
        return any(c.token_ids or c.text or c.tool_calls or c.finish_reason for c in self.candidates)

    @property
    def finished(self) -> bool:
        """Every candidate has had its last delta: nothing is left to run again."""
        return all(c.finish_reason is not None for c in self.candidates)

    def restart(self) -> None:
        """A new run of the turn begins: it must first reproduce everything given so far."""
        self._seen = [_Seen() for _ in self.candidates]

    def feed(self, delta: Delta) -> Delta | None:
        """The part of a run's delta the caller has not had yet (None: nothing new)."""
        self.request_id = delta.request_id
        c, seen = self.candidates[delta.index], self._seen[delta.index]
        tokens = _fresh(delta.token_ids, c.token_ids, seen.tokens, delta.index, "tokens")
        seen.tokens += len(delta.token_ids)
        text = _fresh(delta.text, c.text, seen.text, delta.index, "text")
        seen.text += len(delta.text)
        logprobs = delta.logprobs[len(delta.logprobs) - len(tokens) :] if delta.logprobs else ()
        calls = []
        for t in delta.tool_calls:
            head = t.index >= len(c.tool_calls)  # a call the caller has not seen begin
            done = seen.arguments.get(t.index, 0)
            old = c.tool_calls[t.index].arguments if not head else ""
            arguments = _fresh(t.arguments, old, done, delta.index, "tool call")
            seen.arguments[t.index] = done + len(t.arguments)
            if head or arguments:
                calls.append(ToolCallDelta(t.index, t.id if head else "", t.name if head else "", arguments))
        finish = delta.finish_reason if c.finish_reason is None else None
        if not (tokens or text or calls or finish):
            return None
        whole = len(tokens) == len(delta.token_ids) and len(text) == len(delta.text) and finish == delta.finish_reason
        if whole and list(calls) == list(delta.tool_calls):
            fresh = delta  # nothing of it was given before (every delta of a first run)
        else:
            fresh = replace(delta, token_ids=tuple(tokens), text=str(text), logprobs=logprobs,
                            tool_calls=tuple(calls), finish_reason=finish, usage=delta.usage if finish else None)  # fmt: skip
        add_delta(c, fresh)
        return fresh

    def completion(self) -> Completion:
        return Completion(self.request_id, self.candidates, None)


def _fresh(new: _Piece, given: Sequence[object], seen: int, index: int, what: str) -> _Piece:
    """new: a run's next piece (tokens or text); given: what the caller has; seen: how much of `given` the
    run has reproduced before this piece. Returns the part of `new` past `given`."""
    overlap = max(0, min(len(new), len(given) - seen))
    if list(new[:overlap]) != list(given[seen : seen + overlap]):
        raise CbdError(
            grpc.StatusCode.ABORTED,
            f"the session's daemon was lost mid-stream and the turn run again on a re-opened session produced "
            f"different {what} for candidate {index} than already streamed (sampling without a seed, or a "
            f"different numeric path); the session is usable, run the turn again",
        )
    return new[overlap:]
