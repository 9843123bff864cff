"""Draft tokens for speculative decoding, from the sequence's own tokens (n-gram / prompt lookup).

Agents copy: a tool result quoted back, a file rewritten with one change, a path repeated from the
context. If the last n tokens of a sequence (n = 4, then 3, then 2) occurred before in it (prompt,
session history, or its own output), the tokens that followed that earlier occurrence, most recent
occurrence first, are proposed as the next tokens. The target model then checks them all in one step
(spec/speculator.py) and keeps the longest run that it would have produced itself.

Cost: each sequence keeps an index {n-gram: position after its latest occurrence} of its last
`WINDOW` tokens at most, extended incrementally as tokens are appended, by at most `STEP_BUDGET`
positions per proposal (a long prompt is indexed over a few steps, newest part last, so no step
stalls for it); a proposal is then a few dict lookups whatever the context length. A session hands
its history's index to its next turn (sessions.py), and drops it when its KV leaves the GPU (the
session's donor in agent_index.py may keep it until the session's next turn ends or it closes). When the
sequence's own tokens have no match, the tenant's other finished sequences are searched (agent_index.py).
No device work, no model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from cbd.engine.sequence import Sequence

if TYPE_CHECKING:
    from cbd.engine.spec.agent_index import AgentIndex

NGRAM_SIZES = (4, 3, 2)  # the longest match first: fewer false starts
WINDOW = 16384  # tokens a fresh index starts from, counted back from the sequence's end
STEP_BUDGET = 2048  # positions indexed per proposal at most (~1 ms of host time)


@dataclass(slots=True)
class NgramIndex:
    """{n-gram of the tokens: the position right after its latest occurrence}, over token_ids[:indexed + 1]."""

    positions: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0  # n-grams ending before this position are in the index

    def extend(self, tokens: list[int], end: int, budget: int | None = None) -> None:
        """Index the n-grams ending at positions [indexed, end - 1) (each has a known follower), at most
        `budget` of them."""
        positions = self.positions
        stop = end - 1 if budget is None else min(end - 1, self.indexed + budget)
        for i in range(self.indexed, stop):
            for n in NGRAM_SIZES:
                if i + 1 >= n:
                    positions[tuple(tokens[i + 1 - n : i + 1])] = i + 1
        self.indexed = max(self.indexed, stop)

    def lookup(self, context: list[int], end: int, k: int, tokens: list[int] | None = None,
               known: int | None = None, sizes: tuple[int, ...] = NGRAM_SIZES) -> list[int]:  # fmt: skip
        """Up to k tokens of `tokens` (default: the context itself; before `known` only) that followed the
        latest earlier occurrence of the longest n-gram ending at context[end]; [] when none occurred. From
        another list (tokens given), a match counts only if that list holds the n-gram before it."""
        other = tokens is not None
        tokens = context if tokens is None else tokens
        known = len(tokens) if known is None else known
        positions = self.positions
        for n in sizes:
            if end < n:
                continue
            gram = tuple(context[end - n : end])
            start = positions.get(gram)
            if start is not None and start < known and not (other and tuple(tokens[start - n : start]) != gram):
                return tokens[start : min(start + k, known)]
        return []


class Drafter(Protocol):
    def propose(self, seq: Sequence, k: int, end: int | None = None) -> list[int]:
        """Up to k tokens likely to follow seq.token_ids[:end] (default: all of them); [] when it has no
        guess. Tokens past seq.num_known_tokens (drafts still being verified) are read as guesses."""
        ...


class NgramDrafter:
    """Proposes up to k tokens after a context whose tail may be guesses (drafts in flight): the index
    holds known tokens only, the lookup's n-gram is the context's last n tokens, and what it proposes
    was known to follow their latest earlier occurrence."""

    def __init__(self, agents: AgentIndex | None = None) -> None:
        self.agents = agents  # a tenant's finished sequences, searched when the sequence's own index has no match

    def propose(self, seq: Sequence, k: int, end: int | None = None) -> list[int]:
        if k <= 0:
            return []
        tokens = seq.token_ids
        end = len(tokens) if end is None else end
        known = min(seq.num_known_tokens, end)
        index = seq.draft_index
        if index is None or index.indexed > known - 1:  # new, or the sequence was cut back (rare)
            index = seq.draft_index = NgramIndex(indexed=max(0, known - WINDOW))
        index.extend(tokens, known, STEP_BUDGET)
        drafts = index.lookup(tokens, end, k, known=known)
        if not drafts and self.agents is not None:
            request = seq.request
            drafts = self.agents.propose(request.tenant, request.session, tokens, end, k)
        return drafts
