"""Session records: what a session is, and the checks on what a client may set on one.

A `Session` holds its history's token ids (`Branch.token_ids`) and the KV that covers the first
`num_computed` of them; a fan-out turn's candidates are kept as `branches` until the next turn picks
the one that continues. Invariant: a branch's KV is in one tier at a time: on the GPU (`block_table`,
shared block references), on the host (`host`, a `HostCopy` holding host block references), only in
the session's file (`disk`: restored at start, read back when a turn or fork needs it), or neither
(the next turn recomputes). The table of sessions and their turns are the `SessionManager`'s
(session_manager.py); which idle session's KV leaves the GPU first is `SessionEviction`'s
(session_eviction.py). Engine-thread only.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

from cbd.engine.kv.host_pool import HostCopy
from cbd.engine.kv.session_files import DiskCopy
from cbd.engine.sequence import Request
from cbd.errors import InvalidRequest


@dataclass(slots=True)
class Branch:
    """A token history and the resident KV of its first `num_computed` tokens (shared references).

    A session's own history is one; so is each candidate of a fan-out turn, kept until the next
    turn picks it."""

    token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)  # resident KV for token_ids[:num_computed]
    num_computed: int = 0
    host: HostCopy | None = None  # or its KV is on the host tier (never both: one tier at a time)
    disk: DiskCopy | None = None  # or only in a session file, not read back yet (a session restored at start)
    # The speculative drafter's n-gram index of token_ids (engine/spec/drafter.py), handed to the next turn's
    # sequence so that a long history is not indexed again each turn; None: that turn builds it.
    draft_index: Any = None


@dataclass(slots=True, kw_only=True)
class Session(Branch):
    session_id: str
    ttl: float | None  # idle seconds before expiry; None or inf: never
    # The history is a rendered conversation: each turn re-renders it (`TurnInput.replace`). The
    # messages themselves are the frontend's (server/chats.py); the engine knows only token ids.
    is_chat: bool = False
    branches: list[Branch] = field(default_factory=list)
    busy: Request | None = None  # the turn in flight
    turn_replaces: bool = False  # the turn in flight re-rendered the history (a chat turn)
    last_used: float = field(default_factory=time.monotonic)
    # Retention hints: how long the agent expects to be away after its last call (None: unknown), and
    # a retention class (RETENTION_LOW, _NORMAL, _HIGH: the order in which idle sessions leave the GPU).
    expected_idle: float | None = None
    retention: int = 0
    priority: int = 0  # its turns' scheduling class unless a turn says otherwise (sampling_params.PRIORITY_*)
    # Saving (sessions/checkpoints.py): changes so far (turns ended, candidates adopted), the number its file
    # holds, the frontend's note.
    num_turns: int = 0
    num_turns_saved: int = -1
    note: bytes = b""

    def branches_and_self(self) -> list[Branch]:
        return [self, *self.branches]

    def next_use(self, now: float) -> float:
        """When the session is expected back: last use + the hinted idle time; without a hint, as long
        from now as it has been idle already (so plain LRU among sessions without hints). Never before now."""
        if self.expected_idle is not None:
            return max(now, self.last_used + self.expected_idle)
        return now + (now - self.last_used)

    def hinted_back(self, now: float) -> float | None:
        """When its agent said it would be back (last use + expected_idle, possibly past), or None: no hint, or
        one past by more than the hinted idle time itself (at least a second): that agent is not coming on it."""
        if self.expected_idle is None:
            return None
        due = self.last_used + self.expected_idle
        return due if due >= now - max(1.0, self.expected_idle) else None

    def expected_back(self, now: float) -> float:
        """As `next_use`, not clamped to now, and a hint long past counts as none (`hinted_back`)."""
        due = self.hinted_back(now)
        return due if due is not None else now + (now - self.last_used)

    def idle_seconds(self, now: float | None = None) -> float:
        return (now if now is not None else time.monotonic()) - self.last_used

    def expires_in(self, now: float) -> float | None:
        """Seconds until an idle session's TTL runs out (negative: past it); None while a turn is in flight
        or without a finite TTL."""
        if self.busy is not None or self.ttl is None or not math.isfinite(self.ttl):
            return None
        return self.ttl - self.idle_seconds(now)


RETENTION_LOW, RETENTION_NORMAL, RETENTION_HIGH = -1, 0, 1


@dataclass(slots=True)
class SessionInfo:
    session_id: str
    num_tokens: int
    resident_blocks: int  # GPU blocks
    pending_candidates: int
    idle_seconds: float
    busy: bool
    ttl: float | None
    is_chat: bool
    host_blocks: int = 0
    # Where its KV is: "gpu" (some on the GPU), "host" (only on the host), "disk" (only in its session
    # file), "recompute" (none kept), "none" (no tokens).
    tier: str = "none"
    expected_idle: float | None = None
    retention: int = RETENTION_NORMAL
    priority: int = 0
    disk_blocks: int = 0


@dataclass(slots=True)
class TurnInput:
    """A turn's new tokens. `replace`: they are the whole re-rendered conversation (a chat turn; the
    longest common prefix with the history keeps its KV); otherwise they are appended to the history."""

    token_ids: list[int]
    replace: bool = False
    parent_candidate: int | None = None  # the pending candidate of the last turn that continues
    expected_idle: float | None = None  # hint: seconds the agent expects to be away after this turn
    retention: int | None = None  # hint: the session's new retention class (None: unchanged)
    # With `replace`: the history must be exactly a token prefix of token_ids (else HistoryMismatch), so the
    # turn's prompt is the conversation rendered whole and only the tokens after the history are new.
    extends: bool = False


@dataclass(slots=True)
class TurnStart:
    """What a turn's first sequence starts from."""

    prompt: list[int]
    block_table: list[int]  # shared references, already counted
    num_computed: int
    host: HostCopy | None = None  # or the KV is on the host: a copy of prompt[:host.num_tokens], held for it
    draft_index: Any = None  # the history's drafter index, if it is still valid for prompt (see Branch)


# A session id a client proposes: 1-128 characters of letters, digits and ._~- (not starting with '.').
# The part before the first '.' is its affinity key (a proxy routes every call of the session by it).
_SESSION_ID = re.compile(r"[A-Za-z0-9_~-][A-Za-z0-9._~-]{0,127}")
# The engine's key of a session: the client's id inside its tenant's namespace, `TENANT/ID` (the
# frontend's server/tenancy.py makes it; the single tenant of a daemon without auth has no prefix).
_SESSION_KEY = re.compile(r"(?:[A-Za-z0-9._~-]{1,128}/)?" + _SESSION_ID.pattern)


def check_session_id(session_id: str, pattern: re.Pattern[str] = _SESSION_KEY) -> None:
    """A session key the engine takes (the frontend checks a client's id with `check_client_session_id`)."""
    if not pattern.fullmatch(session_id):
        raise InvalidRequest(  # the id itself is not echoed: it may be anything a caller sent
            "session id must be 1-128 characters of letters, digits and . _ ~ - (not starting with '.'); "
            f"got {len(session_id)} characters"
        )


def check_client_session_id(session_id: str) -> None:
    """A session id as a client proposes it (no namespace)."""
    check_session_id(session_id, _SESSION_ID)


def check_hints(expected_idle: float | None, retention: int) -> None:
    if expected_idle is not None and not (expected_idle >= 0 and math.isfinite(expected_idle)):
        raise InvalidRequest(f"expected idle time must be a finite number of seconds >= 0, got {expected_idle}")
    if retention not in (RETENTION_LOW, RETENTION_NORMAL, RETENTION_HIGH):
        raise InvalidRequest(f"unknown retention class {retention}")


def check_ttl(ttl: float | None) -> None:
    """None: the default; a positive number of idle seconds; inf: never expires. NaN and <= 0 are refused."""
    if ttl is not None and (math.isnan(ttl) or ttl <= 0):
        raise InvalidRequest(f"ttl_seconds must be > 0 (inf: never expires), got {ttl}")
