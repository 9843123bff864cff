"""The session extension: a chat bound to a cbd session, so its KV stays resident between API calls.

A client names its conversation with the `X-Cbd-Session` header (or `cbd_session` in the body). The
API sends the whole conversation every call; the gateway remembers, per name, the cbd session and the
conversation it holds (the messages sent and the assistant's reply). When a call's messages extend
that conversation, only the new messages go to the daemon as the session's next turn (with n > 1, the
reply the client kept names the candidate that continues). Otherwise (a new name, an edited history, a
session the daemon closed or expired) the gateway opens a fresh session for the whole conversation: the
fallback is transparent, it only costs the prefill the session would have saved.

Names are scoped by the caller's Authorization header: the map is keyed by (a SHA-256 of the header,
"" without one; the name), so a caller reusing another's name gets a session of its own and can
neither continue nor close the other's. The raw token is never stored.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

SessionKey = tuple[str, str]  # (the caller's key: agentic/caller.py, the session's name)


def _key(m: dict[str, Any]) -> tuple[Any, ...]:
    calls = tuple((c.get("name", ""), c.get("arguments", "")) for c in m.get("tool_calls") or ())
    return (m.get("role"), m.get("content") or "", calls, m.get("tool_call_id") or "")


@dataclass(slots=True)
class Bound:
    session_id: str
    history: list[tuple[Any, ...]]  # the conversation the session holds, as message keys
    replies: list[tuple[Any, ...]]  # the last turn's candidates (one unless n > 1), as message keys

    def continuation(self, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int | None] | None:
        """(the new messages, the candidate they continue) when `messages` extend what the session holds."""
        keys = [_key(m) for m in messages]
        h = len(self.history)
        if keys[:h] != self.history or len(keys) <= h or keys[h] not in self.replies:
            return None
        if len(keys) == h + 1:
            return None  # nothing new after the reply: not a turn
        candidate = self.replies.index(keys[h])
        return messages[h + 1 :], (candidate if len(self.replies) > 1 else None)


class SessionMap:
    """(token hash, name) -> bound sessions; the least recently used beyond `capacity` are forgotten."""

    def __init__(self, capacity: int = 10_000) -> None:
        self.capacity = capacity
        self._bound: OrderedDict[SessionKey, Bound] = OrderedDict()

    def get(self, name: SessionKey) -> Bound | None:
        bound = self._bound.get(name)
        if bound is not None:
            self._bound.move_to_end(name)
        return bound

    def bind(
        self, name: SessionKey, session_id: str, messages: list[dict[str, Any]], replies: list[dict[str, Any]]
    ) -> None:
        self._bound[name] = Bound(session_id, [_key(m) for m in messages], [_key(r) for r in replies])
        self._bound.move_to_end(name)
        while len(self._bound) > self.capacity:
            self._bound.popitem(last=False)

    def drop(self, name: SessionKey) -> Bound | None:
        return self._bound.pop(name, None)
