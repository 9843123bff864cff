"""Drafts from an agent's other work: the finished sequences of the same tenant, searched when a
sequence's own n-gram index (drafter.py) has no match.

Agents repeat themselves across sessions: the same tool-call skeletons turn after turn, a file read in
one session and quoted in another, a sibling session answering the same question. Each sequence that
finishes (stop or length) becomes a donor: its tokens and its own n-gram index, which it built while it
drafted (extended here to its last tokens, or built here when it never drafted: `STEP_BUDGET`
positions per step at most). A
session keeps one donor, its latest turn's (a later turn replaces it), and it is dropped when the
session closes or expires; a plain request's donor stays until the bound pushes it out.

Scope and bounds: donors are searched only within the tenant that made them (the prefix cache's
scope), so no tenant's text reaches another's drafts (the bound is shared: a busy tenant's donors can
push out another's, which then drafts from its own context only); the newest `SEARCHED` donors
are searched, newest first, for the context's last 4 tokens (shorter matches across different
texts are mostly chance, and a wrong draft costs compute); all donors together hold at most `max_tokens` tokens (oldest dropped
first; `speculative_index_tokens`, 0: off). An index handed on to a session's next turn may later
point into another token list, so a donor's match counts only if its own tokens hold the n-gram.
Drafts are verified like any other: outputs never depend on them. Engine-thread only; pure Python.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from cbd.engine.spec.drafter import STEP_BUDGET, WINDOW, NgramIndex

SEARCHED = 8  # donors searched per proposal at most, newest first
DONOR_NGRAMS = (4,)  # a donor's match must be this long: shorter ones across texts are mostly chance


@dataclass(slots=True, eq=False)
class Donor:
    tenant: str
    owner: Any  # the session whose latest turn it is (None: a plain request)
    tokens: list[int]
    index: NgramIndex
    own_index: bool  # extended here (built here, or a plain request's); else a session's, maybe handed on


class AgentIndex:
    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.num_tokens = 0  # held by all donors
        self._donors: OrderedDict[int, Donor] = OrderedDict()  # oldest first, by id(donor)
        self._by_tenant: dict[str, OrderedDict[int, Donor]] = {}
        self._by_owner: dict[int, Donor] = {}  # id(session) -> its donor (the session is kept alive by it)
        self.num_drafts = 0  # tokens proposed from donors
        self.budget = STEP_BUDGET  # positions the current step may still index (see new_step)

    def new_step(self) -> None:
        """A step's proposals start: donors are indexed `STEP_BUDGET` positions per step at most."""
        self.budget = STEP_BUDGET

    def add(self, tenant: str, owner: Any, tokens: list[int], index: NgramIndex | None) -> None:
        """A finished sequence's tokens (not changed afterwards) and its own index (None: none built)."""
        if owner is not None:
            self.drop(owner)
        if not 2 <= len(tokens) <= self.max_tokens:
            return
        if index is None or index.indexed > len(tokens) - 1:
            index, own = NgramIndex(indexed=max(0, len(tokens) - WINDOW)), True
        else:  # a plain request's index is its own (never handed on): it may be extended to its last tokens
            own = owner is None
        donor = Donor(tenant, owner, tokens, index, own)
        key = id(donor)
        self._donors[key] = donor
        self._by_tenant.setdefault(tenant, OrderedDict())[key] = donor
        if owner is not None:
            self._by_owner[id(owner)] = donor
        self.num_tokens += len(tokens)
        while self.num_tokens > self.max_tokens:
            self._remove(next(iter(self._donors.values())))

    def drop(self, owner: Any) -> None:
        """A session closed (or its turn is replaced by a later one): its donor goes."""
        donor = self._by_owner.get(id(owner))
        if donor is not None:
            self._remove(donor)

    def propose(self, tenant: str, owner: Any, context: list[int], end: int, k: int) -> list[int]:
        """Up to k tokens that followed the n-gram ending at context[end] in a donor of tenant's (not the
        asking session's own); [] when none has it."""
        donors = self._by_tenant.get(tenant)
        if not donors:
            return []
        for searched, donor in enumerate(reversed(donors.values())):
            if searched == SEARCHED:
                break
            if owner is not None and donor.owner is owner:
                continue
            index, tokens = donor.index, donor.tokens
            if donor.own_index and index.indexed < len(tokens) - 1 and self.budget > 0:
                done = index.indexed
                index.extend(tokens, len(tokens), self.budget)
                self.budget -= index.indexed - done
            drafts = index.lookup(context, end, k, tokens, sizes=DONOR_NGRAMS)
            if drafts:
                self.num_drafts += len(drafts)
                return drafts
        return []

    def _remove(self, donor: Donor) -> None:
        key = id(donor)
        del self._donors[key]
        tenant = self._by_tenant[donor.tenant]
        del tenant[key]
        if not tenant:
            del self._by_tenant[donor.tenant]
        if donor.owner is not None:
            self._by_owner.pop(id(donor.owner), None)
        self.num_tokens -= len(donor.tokens)
