"""Drafts from a tenant's other finished sequences (engine/spec/agent_index.py): scope, bounds, the
session's donor replaced and dropped, and matches only where the donor's own tokens hold the n-gram."""

from __future__ import annotations

from cbd.engine.spec.agent_index import SEARCHED, AgentIndex
from cbd.engine.spec.drafter import NgramIndex


class _Session:
    """Stands for an engine session (only its identity matters here)."""


def _tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_a_donor_proposes_what_followed_the_context_s_n_gram_within_its_tenant_only() -> None:
    agents = AgentIndex(1000)
    agents.add("a", None, [1, 2, 3, 4, 5, 6, 7, 8], None)
    assert agents.propose("a", None, [0, 1, 2, 3, 4], 5, 3) == [5, 6, 7]
    assert agents.propose("a", None, [4, 5, 6, 7], 4, 5) == [8]  # up to the donor's end
    assert agents.propose("a", None, [9, 2, 3, 4], 4, 3) == []  # only 4-grams count across texts: (9, 2, 3, 4) unseen
    assert agents.propose("b", None, [1, 2, 3, 4], 4, 3) == []  # another tenant's donors are never searched
    assert agents.num_drafts == 4


def test_the_bound_drops_the_oldest_donors_first() -> None:
    agents = AgentIndex(250)
    for i in range(5):
        agents.add("a", None, _tokens(1000 * i, 100), None)
        assert agents.num_tokens <= 250
    assert agents.num_tokens == 200  # the last two
    assert agents.propose("a", None, [3001, 3002, 3003, 3004], 4, 2) == [3005, 3006]
    assert agents.propose("a", None, [2001, 2002, 2003, 2004], 4, 2) == []  # pushed out
    agents.add("a", None, _tokens(9000, 251), None)  # larger than the bound: never kept
    assert agents.num_tokens == 200
    assert AgentIndex(0).propose("a", None, [1, 2, 3, 4], 4, 2) == []


def test_a_session_keeps_one_donor_its_latest_turn_and_it_goes_when_the_session_closes() -> None:
    agents = AgentIndex(1000)
    session, other = _Session(), _Session()
    agents.add("a", session, [1, 2, 3, 4], None)
    agents.add("a", session, [1, 2, 3, 4, 10, 11, 12], None)  # its next turn replaces it
    assert agents.num_tokens == 7
    assert agents.propose("a", other, [1, 2, 3, 4], 4, 2) == [10, 11]  # a sibling session gets the later turn's
    assert agents.propose("a", session, [1, 2, 3, 4], 4, 2) == []  # its own turn is not searched (its own index is)
    agents.drop(session)
    assert agents.num_tokens == 0 and agents.propose("a", other, [1, 2, 3, 4], 4, 2) == []
    agents.drop(session)  # twice: nothing


def test_a_handed_on_index_counts_only_where_the_donor_s_tokens_hold_the_n_gram() -> None:
    agents = AgentIndex(1000)
    donor = [1, 2, 3, 4, 5, 6, 7]
    index = NgramIndex()
    index.extend(donor, len(donor))
    agents.add("a", None, donor, index)
    assert agents.propose("a", None, [2, 3, 4, 5], 4, 2) == [6, 7]
    # The index went on with a later turn whose tokens were re-rendered: (2, 3, 4, 5) now points into that list.
    later = [7, 8, 9, 2, 3, 4, 5, 6, 6]
    index.extend(later, len(later))
    assert index.positions[2, 3, 4, 5] == 7
    assert agents.propose("a", None, [2, 3, 4, 5], 4, 2) == []  # past the donor's tokens: no draft
    # An entry inside the donor's tokens that does not follow its n-gram there is never used either.
    index.positions[2, 3, 4, 5] = 4  # donor[0:4] is (1, 2, 3, 4)
    assert agents.propose("a", None, [2, 3, 4, 5], 4, 2) == []
    index.positions[2, 3, 4, 5] = 5
    assert agents.propose("a", None, [2, 3, 4, 5], 4, 2) == [6, 7]


def test_only_the_newest_donors_are_searched_and_a_new_donor_is_indexed_within_the_step_budget() -> None:
    agents = AgentIndex(10**6)
    agents.add("a", None, [500, 501, 502, 503, 504], None)
    assert agents.propose("a", None, [500, 501, 502, 503], 4, 1) == [504]
    for i in range(SEARCHED):
        agents.add("a", None, _tokens(1000 * (i + 1), 10), None)
    assert agents.propose("a", None, [500, 501, 502, 503], 4, 1) == []  # the oldest, past the newest SEARCHED
    big = _tokens(100_000, 5000)
    agents.add("a", None, big, None)
    assert agents.propose("a", None, big[-5:-1], 4, 1) == []  # indexed oldest-first, 2048 positions per step
    for _ in range(3):
        agents.propose("a", None, [0, 0, 0, 0], 4, 1)  # the same step: its budget is spent
    assert agents.propose("a", None, big[-5:-1], 4, 1) == []
    for _ in range(2):
        agents.new_step()
        agents.propose("a", None, [0, 0, 0, 0], 4, 1)
    agents.new_step()
    assert agents.propose("a", None, big[-5:-1], 4, 1) == [big[-1]]
