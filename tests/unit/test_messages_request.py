"""The Messages API body as chat messages (gateway/messages/request.py), without a daemon."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")
from cbd.gateway.messages.request import parse  # noqa: E402


def test_consecutive_messages_of_one_role_are_one_turn() -> None:
    call = parse({
        "max_tokens": 8,
        "system": "Be brief.",
        "messages": [
            {"role": "user", "content": "Read a.txt. "},
            {"role": "user", "content": [{"type": "text", "text": "Then b.txt."}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "read", "input": {"p": "a"}}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t2", "name": "read", "input": {"p": "b"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "A"},
                                         {"type": "tool_result", "tool_use_id": "t2", "content": "B"}]},
            {"role": "user", "content": "Compare them."},
            {"role": "assistant", "content": "They"},
            {"role": "assistant", "content": " differ"},
        ],
    })  # fmt: skip
    assert [(m["role"], m["content"]) for m in call.messages] == [
        ("system", "Be brief."),
        ("user", "Read a.txt. Then b.txt."),
        ("assistant", ""),
        ("tool", "A"),
        ("tool", "B"),
        ("user", "Compare them."),
        ("assistant", "They differ"),
    ]
    assert [c["id"] for c in call.messages[2]["tool_calls"]] == ["t1", "t2"]
    assert call.prefill  # the merged final turn is the start of the reply
