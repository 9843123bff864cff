"""Continuing the sessions of clients that resend the whole conversation every call.

The Messages API and stateless /v1/chat/completions clients (no X-Cbd-Session) send everything each
call. The gateway indexes, per caller key (caller.py), the conversation each of its sessions holds
(conversations.py, by text: a candidate finder only). A call whose messages extend an indexed
conversation continues that session with the whole conversation, and the daemon continues it only when
the session's history is exactly a token prefix of the conversation's rendering
(GenerateRequest.whole_conversation); otherwise, or when nothing is indexed, the conversation starts on
a fresh session. Either way the prompt is token for token what a fresh call renders.

One index per gateway, bounded by `--max-conversations`: a session it forgets is closed (with the
metadata of the call that recorded it), so the gateway never holds more sessions than that on the
daemon beyond the turns in flight. A session is claimed (taken out of the index) while a turn runs on
it, so no other call continues it meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cbd.gateway.agentic.conversations import Conversations, Meta
from cbd.gateway.agentic.turns import Plan, Started, Turns


class Resends:
    def __init__(self, turns: Turns, capacity: int) -> None:
        self.turns = turns
        self.index = Conversations(capacity)

    def plan(self, owner: str, messages: list[dict[str, Any]], **settings: Any) -> Plan:
        """The turn's plan: continue the owner's session that holds the longest indexed prefix (claimed
        here), or a fresh session. settings: Plan's ttl_seconds and retention."""
        plan = Plan(messages, whole=True, keep=self.index.capacity > 0, **settings)  # 0: plain calls
        found = self.index.find(owner, messages) if plan.keep else None
        if found is not None:
            plan.session_id, held = found
            plan.new_messages = messages[held:]
            self.index.forget(plan.session_id)
        return plan

    def record(self, owner: str, session_id: str, conversation: list[dict[str, Any]], metadata: Meta) -> None:
        """The session holds `conversation`: a later resend that extends it may continue it."""
        for dropped, its_metadata in self.index.record(owner, session_id, conversation, metadata):
            self.turns.close(dropped, its_metadata)


@dataclass(slots=True)
class ResentTurn:
    """One call of a resending client, from its plan to its settled session."""

    resends: Resends
    owner: str
    plan: Plan
    metadata: Meta
    started: Started | None = None
    recorded: bool = False
    settled: bool = False

    async def start(self, template: Any) -> Started:
        self.started = await self.resends.turns.start(template, self.plan, self.metadata)
        return self.started

    def completed(self, reply: dict[str, Any]) -> None:
        """The turn ended well: its session holds the conversation and `reply` (normalised as the messages)."""
        s = self.started
        if s is not None and s.session_id is not None:
            self.resends.record(self.owner, s.session_id, [*self.plan.messages, reply], self.metadata)
            self.recorded = True

    def settle(self) -> None:
        """After the call (once; later calls do nothing): stop the stream; the session the plan found, unless
        the turn continued it to completion or the daemon refused it as no prefix, holds what it held and is
        indexed again (a turn that failed or was abandoned leaves it so, and so does a fall-back to a fresh
        session while it was busy); a session opened for a turn that did not complete is closed."""
        if self.settled:
            return
        self.settled = True
        s, plan = self.started, self.plan
        if s is not None:
            s.cancel()
        continued = s is not None and s.continued
        if plan.session_id is not None and not plan.dropped and not (self.recorded and continued):
            held = plan.messages[: len(plan.messages) - len(plan.new_messages)]
            self.resends.record(self.owner, plan.session_id, held, self.metadata)
        if not self.recorded and s is not None and s.opened and s.session_id is not None:
            self.resends.turns.close(s.session_id, self.metadata)
