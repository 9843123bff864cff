"""A turn that must extend its session's history token for token (TurnInput.extends, the engine's half of
GenerateRequest.whole_conversation): continued only when the history is a prefix of the new prompt,
refused with nothing changed otherwise. The oracle is a stateless engine fed the whole prompt."""

from __future__ import annotations

import pytest
from test_sessions import GREEDY, _stateless, _turn

from cbd.errors import HistoryMismatch
from helpers import checked_step, make_core


def test_a_whole_prompt_continues_only_a_token_prefix_of_it(tiny_loaded) -> None:
    core = make_core(tiny_loaded, block_size=4)
    session = core.sessions.open(ttl=60.0)
    first = [5, 6, 7, 8, 9, 10, 11]
    _turn(core, session.session_id, first, replace=True, extends=True)  # an empty history extends anything
    history = list(session.token_ids)
    assert history[: len(first)] == first and len(history) == len(first) + GREEDY.max_tokens
    used = core.block_manager.num_used_blocks
    edited = [*history[:3], 99, *history[4:], 12, 13]
    for prompt in (edited, history, history[:-1]):  # edited; nothing new; shorter than the history
        with pytest.raises(HistoryMismatch):
            core.add_session_turn(session.session_id, prompt, GREEDY, replace=True, extends=True)
        assert session.token_ids == history and session.busy is None and not core.has_work()
    assert core.block_manager.num_used_blocks == used
    whole = [*history, 12, 13, 14]
    result = _turn(core, session.session_id, whole, replace=True, extends=True)
    assert result["usage"].cached_prompt_tokens >= len(history) - 1  # only the new tokens were computed
    assert result["tokens"][0] == _stateless(tiny_loaded, whole)["tokens"][0]
    # Without `extends` the same edited prompt is a replacing turn that keeps the common prefix's KV.
    _turn(core, session.session_id, [*whole[:3], 99, 100], replace=True)
    while core.has_work():
        checked_step(core)
    core.sessions.close(session.session_id)
    assert core.block_manager.num_used_blocks == 0
