"""Live sessions found by the conversation they hold, for clients that resend the whole conversation.

After each turn the gateway records, per caller key, the digest of the conversation its session now
holds (the messages sent and the reply as returned). A later call whose messages begin with a recorded
conversation — compared message by message exactly: role, text, tool calls (arguments compared as
JSON values) and tool result ids — and go on after it continues that session with only the new
messages. Digests chain (each message's digest covers all before it), so finding the longest recorded
prefix of a call costs one hash per message. A session continued, closed or replaced is recorded
under its new conversation only; the least recently used beyond `capacity` are forgotten.

The text only finds a candidate: the continuation is confirmed by the daemon token for token
(GenerateRequest.whole_conversation, agentic/turns.py). Each entry keeps, in memory only, the gRPC
metadata of the call that recorded it (the owner's bearer token, which the daemon checks), so that a
session the index forgets (beyond capacity, or replaced by another session holding the same
conversation) can be closed: `record` returns those with their metadata. Shared by the Messages API and
stateless Chat Completions clients (agentic/resends.py).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from typing import Any

from cbd.gateway.agentic.convert import canonical_arguments

Meta = list[tuple[str, str]]  # the gRPC metadata that closes a session (agentic/caller.py)


def _key(m: dict[str, Any]) -> bytes:
    calls = [(c.get("id", ""), c.get("name", ""), canonical_arguments(c.get("arguments", "")))
             for c in m.get("tool_calls") or ()]  # fmt: skip
    return json.dumps([m["role"], m.get("content") or "", calls, m.get("tool_call_id") or ""]).encode()


def digests(owner: str, messages: list[dict[str, Any]]) -> list[str]:
    """digests[k]: the digest of messages[:k + 1] for this owner."""
    h = hashlib.sha256(owner.encode()).digest()
    out = []
    for m in messages:
        h = hashlib.sha256(h + _key(m)).digest()
        out.append(h.hex())
    return out


class Conversations:
    def __init__(self, capacity: int = 10_000) -> None:
        self.capacity = capacity
        self._sessions: OrderedDict[str, str] = OrderedDict()  # conversation digest -> session id
        self._held: dict[str, tuple[str, Meta]] = {}  # session id -> (its digest, its owner's metadata)

    def __len__(self) -> int:
        return len(self._sessions)

    def find(self, owner: str, messages: list[dict[str, Any]]) -> tuple[str, int] | None:
        """(a session holding messages[:k], k) for the longest such k that leaves new messages."""
        chain = digests(owner, messages)
        for k in range(len(messages) - 1, 0, -1):
            session = self._sessions.get(chain[k - 1])
            if session is not None:
                self._sessions.move_to_end(chain[k - 1])
                return session, k
        return None

    def record(
        self, owner: str, session_id: str, conversation: list[dict[str, Any]], metadata: Meta | None = None
    ) -> list[tuple[str, Meta]]:
        """Index the session under the conversation it holds; returns the sessions the index no longer
        holds (replaced, or the least recently used beyond capacity), each with its metadata."""
        self.forget(session_id)
        digest = digests(owner, conversation)[-1]
        dropped = []
        replaced = self._sessions.pop(digest, None)
        if replaced is not None:
            dropped.append((replaced, self._held.pop(replaced)[1]))
        self._sessions[digest] = session_id
        self._held[session_id] = (digest, list(metadata or ()))
        while len(self._sessions) > self.capacity:
            _, old = self._sessions.popitem(last=False)
            dropped.append((old, self._held.pop(old)[1]))
        return dropped

    def forget(self, session_id: str) -> None:
        found = self._held.pop(session_id, None)
        if found is not None:
            self._sessions.pop(found[0], None)
