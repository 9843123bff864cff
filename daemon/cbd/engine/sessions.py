"""Sessions: multi-turn conversations whose KV stays resident between turns.

A session holds its history's token ids and references to the KV blocks that cover the first
`num_computed` of them. A turn builds its prompt from the history (append the new tokens, or replace
the history by a re-rendered conversation that shares its longest common prefix); the turn's sequence
starts from the session's blocks, so only the new tokens are prefilled. When the turn ends, the
session adopts the finished sequence's tokens and blocks (n = 1), or keeps every candidate as a
branch until the next turn names the one that continues (`parent_candidate`).

Idle sessions yield to running requests: when the pool runs short, idle sessions' KV leaves the
GPU in eviction order (`eviction_order`: retention LOW, NORMAL, HIGH; within one, the session
expected back last goes first). With a host tier it is copied to host blocks (`offload`); the next
turn's sequence takes references on them and the scheduler restores them before its prefill.
Without one, or when the host pool is full of sessions due back sooner, it is released: the tokens
stay, and the next turn recomputes, reviving whatever the prefix cache still holds. Host blocks are
evicted the same way, to recompute. A branch (the history or a pending candidate) is in one tier at
a time: GPU (`block_table`), host (`host_table`), or none.
Sessions expire after their idle TTL; their number is capped. Engine-thread only, like the block
manager it shares.
"""

from __future__ import annotations

import itertools
import logging
import math
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cbd.engine.block_manager import BlockManager
from cbd.engine.host_pool import HostPool
from cbd.engine.sampling_params import PRIORITY_BATCH, PRIORITY_INTERACTIVE
from cbd.engine.sequence import Request, Sequence
from cbd.errors import CapacityExceeded, HistoryMismatch, InvalidRequest, SessionBusy, SessionExists, UnknownSession

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Branch:
    """A token history and the resident KV of its first `num_computed` tokens (shared references).

    A session's own history is one; so is each candidate of a fan-out turn, kept until the next
    turn picks it."""

    token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)  # resident KV for token_ids[:num_computed]
    num_computed: int = 0
    host_table: list[int] = field(default_factory=list)  # host-tier KV for token_ids[:num_host]
    num_host: int = 0
    # The speculative drafter's n-gram index of token_ids (engine/drafter.py), handed to the next turn's
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

    def branches_and_self(self) -> list[Branch]:
        return [self, *self.branches]

    def next_use(self, now: float) -> float:
        """When the session is expected back: last use + the hinted idle time; without a hint, as long
        from now as it has been idle already (so plain LRU among sessions without hints). Never before now."""
        if self.expected_idle is not None:
            return max(now, self.last_used + self.expected_idle)
        return now + (now - self.last_used)

    def idle_seconds(self, now: float | None = None) -> float:
        return (now if now is not None else time.monotonic()) - self.last_used


RETENTION_LOW, RETENTION_NORMAL, RETENTION_HIGH = -1, 0, 1


def _expires_in(session: Session, now: float) -> float | None:
    """Seconds until an idle session's TTL runs out (negative: past it); None while a turn is in flight or
    without a finite TTL."""
    if session.busy is not None or session.ttl is None or not math.isfinite(session.ttl):
        return None
    return session.ttl - session.idle_seconds(now)


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
    # Where its KV is: "gpu" (some on the GPU), "host" (only on the host), "recompute" (none kept), "none" (no tokens).
    tier: str = "none"
    expected_idle: float | None = None
    retention: int = RETENTION_NORMAL
    priority: int = 0


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
    # Or the KV is on the host: references on the host blocks covering prompt[:host_tokens].
    host_table: list[int] = field(default_factory=list)
    host_tokens: int = 0
    draft_index: Any = None  # the history's drafter index, if it is still valid for prompt (see Branch)


class SessionManager:
    def __init__(
        self, block_manager: BlockManager, max_sessions: int, default_ttl: float | None,
        host: HostPool | None = None,
        offload: Callable[[list[int]], tuple[list[int], int | None] | None] | None = None,
        content_keys: Callable[[list[int]], list] | None = None,
    ) -> None:  # fmt: skip
        """host, offload, content_keys: the host tier (None: none); offload(gpu blocks) places them in
        the host pool and copies what it lacks ((host ids, the copy's ticket, which fences the GPU blocks
        until it completes), or None: no room); content_keys(gpu blocks): what HostPool.place matches."""
        self.content_keys = content_keys
        self.bm = block_manager
        self.host = host
        self.offload_copy = offload
        self.max_sessions = max_sessions
        self.default_ttl = default_ttl
        self.sessions: dict[str, Session] = {}
        self._ids = itertools.count()
        self.num_evictions = 0
        self.num_expired = 0
        self.num_offloaded_blocks = 0  # GPU blocks copied to the host tier
        self.num_host_evictions = 0  # sessions whose host blocks were released (to recompute)
        self.hits = {"gpu": 0, "host": 0, "recompute": 0}  # turns by where their history's KV was

    # ---- lifecycle ----------------------------------------------------------------------------
    def open(
        self, ttl: float | None = None, token_ids: list[int] | None = None, is_chat: bool = False,
        session_id: str | None = None, expected_idle: float | None = None, retention: int = RETENTION_NORMAL,
        priority: int = 0,
    ) -> Session:  # fmt: skip
        """A new session whose history is `token_ids` (no KV yet). ttl None: the default; inf: never expires."""
        _check_ttl(ttl)
        _check_hints(expected_idle, retention)
        if priority not in (PRIORITY_INTERACTIVE, PRIORITY_BATCH):
            raise InvalidRequest(f"unknown priority {priority}")
        if session_id:
            check_session_id(session_id)
            if session_id in self.sessions:
                raise SessionExists(f"a session with id {session_id!r} is open already")
        if len(self.sessions) >= self.max_sessions:
            wait = self._next_expiry()
            raise CapacityExceeded(
                f"{len(self.sessions)} sessions are open, the limit is {self.max_sessions}; retry in {wait:.2f} s",
                retry_after=wait,
            )
        session_id = session_id or f"s-{next(self._ids)}-{secrets.token_hex(6)}"
        session = Session(
            list(token_ids or []), session_id=session_id, ttl=ttl if ttl is not None else self.default_ttl,
            is_chat=is_chat, expected_idle=expected_idle, retention=retention, priority=priority,
        )  # fmt: skip
        self.sessions[session_id] = session
        return session

    def get(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise UnknownSession(
                f"no open session {session_id!r} (closed, expired, or never opened; behind a proxy, the daemon "
                "that held it may be gone)"
            )
        return session

    def close(self, session_id: str) -> None:
        """Close a session; a turn in flight keeps running, its result is not kept."""
        session = self.get(session_id)
        del self.sessions[session_id]
        self._release(session)

    def fork(
        self, session_id: str, candidate: int | None = None, ttl: float | None = None, new_session_id: str | None = None
    ) -> Session:
        """A new session continuing from this one (or from one of its pending candidates); copy-on-write.
        new_session_id: the id the fork gets (checked as open's); None: one is made."""
        _check_ttl(ttl)
        if new_session_id:
            check_session_id(new_session_id)
            if new_session_id in self.sessions:
                raise SessionExists(f"a session with id {new_session_id!r} is open already")
        source = self.get(session_id)
        if source.busy is not None:
            raise SessionBusy(f"session {session_id!r} has a turn in flight; fork it when the turn ends")
        base = self.pending_base(source, candidate, "candidate")
        child = self.open(
            ttl if ttl is not None else source.ttl, base.token_ids, source.is_chat, new_session_id,
            retention=source.retention, priority=source.priority,
        )  # fmt: skip
        child.block_table = self.bm.share(base.block_table)
        child.num_computed = base.num_computed
        if base.host_table:
            assert self.host is not None
            child.host_table, child.num_host = self.host.share(base.host_table), base.num_host
        return child

    @staticmethod
    def pending_base(session: Session, candidate: int | None, name: str) -> Branch:
        """What a turn or fork continues: the named pending candidate of the last turn, or the history.
        Candidates pending and none named is SessionBusy (FAILED_PRECONDITION), for turns and forks alike."""
        if session.branches:
            if candidate is None:
                raise SessionBusy(
                    f"session {session.session_id!r} has {len(session.branches)} candidates from its last turn; "
                    f"set {name} to the one that continues"
                )
            if not 0 <= candidate < len(session.branches):
                raise InvalidRequest(f"{name} {candidate} does not exist: {len(session.branches)} candidates pending")
            return session.branches[candidate]
        if candidate not in (None, 0):
            raise InvalidRequest(f"{name} names a candidate of the last turn, and it had only one")
        return session

    def touch(self, session_id: str) -> None:
        """Its client is still there (e.g. retrying a refused turn): the idle TTL starts over."""
        session = self.sessions.get(session_id)
        if session is not None:
            session.last_used = time.monotonic()

    def info(self, session: Session) -> SessionInfo:
        resident: set[int] = set()
        host: set[int] = set()
        for b in session.branches_and_self():
            resident.update(b.block_table)
            host.update(b.host_table)
        tier = "gpu" if resident else "host" if host else "recompute" if session.token_ids else "none"
        return SessionInfo(
            session.session_id, len(session.token_ids), len(resident), len(session.branches),
            session.idle_seconds(), session.busy is not None, session.ttl, session.is_chat, len(host), tier,
            session.expected_idle, session.retention, session.priority,
        )  # fmt: skip

    # ---- turns --------------------------------------------------------------------------------
    def begin_turn(self, session: Session, turn: TurnInput, validate: Callable[[list[int]], None]) -> TurnStart:
        """Resolve a turn's prompt and the KV it starts from; `validate(prompt)` runs before any change."""
        if session.busy is not None:
            raise SessionBusy(f"session {session.session_id!r} already has a turn in flight")
        if turn.replace and session.token_ids and not session.is_chat:
            raise InvalidRequest("this session holds a text / token history; send text or token ids, not chat")
        if not turn.replace and session.is_chat:
            raise InvalidRequest("this session holds a chat; send chat messages")
        if not turn.token_ids:
            raise InvalidRequest("a turn must add at least one token")
        _check_hints(turn.expected_idle, turn.retention if turn.retention is not None else RETENTION_NORMAL)
        base = self.pending_base(session, turn.parent_candidate, "parent_candidate")
        prompt = list(turn.token_ids) if turn.replace else base.token_ids + list(turn.token_ids)
        if turn.extends and (len(base.token_ids) >= len(prompt) or prompt[: len(base.token_ids)] != base.token_ids):
            raise HistoryMismatch(
                f"the conversation does not extend the {len(base.token_ids)} tokens of session {session.session_id!r}"
            )
        validate(prompt)
        if session.branches:
            assert turn.parent_candidate is not None  # pending_base refused it otherwise
            self._adopt(session, session.branches.pop(turn.parent_candidate))
            self._release_branches(session)
        session.expected_idle = turn.expected_idle
        if turn.retention is not None:
            session.retention = turn.retention
        common = _common_prefix(session.token_ids, prompt) if turn.replace else len(session.token_ids)
        session.turn_replaces = turn.replace
        # The index moves to the turn (it grows there, and comes back with the turn's branch); valid only
        # if the prompt keeps every token it indexed.
        index, session.draft_index = session.draft_index, None
        if index is not None and index.indexed >= common:
            index = None
        bs = self.bm.block_size
        if session.host_table:  # the KV is on the host: the turn restores the common prefix's blocks
            assert self.host is not None
            self.hits["host"] += 1
            computed = min(session.num_host, common, len(prompt) - 1)
            host_table = self.host.share(session.host_table[: -(-computed // bs)])
            return TurnStart(prompt, [], 0, host_table, computed, index)
        if session.token_ids:
            self.hits["gpu" if session.num_computed else "recompute"] += 1
        # Reuse the resident KV of the common prefix; at least one token is computed (for logits).
        computed = min(session.num_computed, common, len(prompt) - 1)
        table = self.bm.share(session.block_table[: -(-computed // bs)])
        return TurnStart(prompt, table, computed, draft_index=index)

    def turn_started(self, session: Session, request: Request) -> None:
        session.busy = request
        session.last_used = time.monotonic()
        request.session = session

    def candidate_finished(self, session: Session, seq: Sequence) -> None:
        """Called before a finished candidate's blocks are freed: keep them as a branch."""
        if session.session_id not in self.sessions or session.busy is not seq.request:
            return  # the session was closed meanwhile
        computed = min(seq.num_computed_tokens, seq.num_known_tokens)
        table = self.bm.share(seq.block_table[: -(-computed // self.bm.block_size)])
        branch = Branch(seq.token_ids[: seq.num_known_tokens], table, computed, draft_index=seq.draft_index)
        while len(session.branches) <= seq.candidate_index:
            session.branches.append(Branch())
        session.branches[seq.candidate_index] = branch

    def end_turn(self, session: Session, request: Request, ok: bool) -> None:
        """The turn's request is finished: adopt its single candidate, or keep the fan-out's branches."""
        if session.busy is not request:
            return
        session.busy = None
        session.last_used = time.monotonic()
        if session.session_id not in self.sessions:
            return
        if not ok:  # aborted or failed: the session stays as it was before the turn
            self._release_branches(session)
            return
        session.is_chat = session.is_chat or session.turn_replaces  # a chat's first turn makes it a chat
        if len(session.branches) == 1:
            self._adopt(session, session.branches.pop())

    # ---- memory pressure and expiry -------------------------------------------------------------
    def eviction_order(self, sessions: list[Session], now: float | None = None) -> list[Session]:
        """Which sessions leave a tier first: retention LOW, then NORMAL, then HIGH; within a class, the
        one expected back last (`Session.next_use`) first."""
        now = now if now is not None else time.monotonic()
        return sorted(sessions, key=lambda s: (s.retention, -s.next_use(now)))

    def evict(self, blocks_needed: int, include_busy: bool = False) -> int:
        """Move sessions' KV off the GPU in eviction order until blocks_needed are free: idle sessions
        only, or also those with a turn in flight (the turn's sequence keeps its own references, so
        this frees only what nothing running needs; the session recomputes later). An idle session's
        KV goes to the host tier when there is one and it has room (after evicting host-resident
        sessions that come before it in the same order); otherwise it is released."""
        freed = 0
        now = time.monotonic()
        order = self.eviction_order([s for s in self.sessions.values() if include_busy or s.busy is None], now)
        for rank, session in enumerate(order):
            if self.bm.num_free_blocks >= blocks_needed:
                break
            if not any(b.block_table for b in session.branches_and_self()):
                continue
            before = self.bm.num_free_blocks
            for b in session.branches_and_self():
                b.draft_index = None  # idle long enough to leave the GPU: its drafter index goes too
                if b.block_table and not (session.busy is None and self._offload(b, order[:rank])):
                    self.bm.release(b.block_table)
                    b.block_table, b.num_computed = [], 0
            freed += self.bm.num_free_blocks - before
            self.num_evictions += 1
        return freed

    def offload_ahead(self, free_target: int) -> None:
        """With a host tier: copy idle sessions' KV to it, in eviction order, until free_target GPU blocks
        are free (or no idle session is left on the GPU, or the host pool has no room). Called after a
        step is launched, so that the copies run while the GPU computes and the blocks they free are
        ready (their fences passed) by the time a later step needs them; never releases KV to recompute."""
        if self.host is None or self.bm.num_free_blocks >= free_target:
            return
        for session in self.eviction_order([s for s in self.sessions.values() if s.busy is None]):
            if self.bm.num_free_blocks >= free_target:
                break
            branches = [b for b in session.branches_and_self() if b.block_table]
            if not branches:
                continue
            needed = sum(
                self.host.missing(self.content_keys(b.block_table)) if self.content_keys else len(b.block_table)
                for b in branches
            )
            if needed > self.host.num_free_blocks:
                break  # proactively, only into free host blocks
            for b in branches:
                b.draft_index = None
                self._offload(b, [])
            self.num_evictions += 1

    def _offload(self, branch: Branch, before: list[Session]) -> bool:
        """Copy a branch's GPU blocks to new host blocks and free the GPU ones (fenced until the copy is
        done); False if there is no host tier or no room in it, even after releasing the host blocks of
        sessions in `before` (those that come before this one in eviction order)."""
        if self.host is None or self.offload_copy is None:
            return False
        count = len(branch.block_table)
        if self.content_keys is not None:
            count = self.host.missing(self.content_keys(branch.block_table))
        if self.host.num_free_blocks < count:
            for other in before:
                if self.host.num_free_blocks >= count:
                    break
                if other.busy is None and any(b.host_table for b in other.branches_and_self()):
                    for b in other.branches_and_self():
                        self._drop_host(b)
                    self.num_host_evictions += 1
        moved = self.offload_copy(branch.block_table)
        if moved is None:  # no room, or the copy failed: the caller releases the KV (the next turn recomputes)
            return False
        host_ids, ticket = moved
        if ticket is not None:
            self.bm.fence(branch.block_table, ticket)
        self.bm.release(branch.block_table)
        branch.host_table, branch.num_host = host_ids, branch.num_computed
        branch.block_table, branch.num_computed = [], 0
        self.num_offloaded_blocks += count
        return True

    def _drop_host(self, branch: Branch) -> None:
        if branch.host_table:
            assert self.host is not None
            self.host.release(branch.host_table)
        branch.host_table, branch.num_host = [], 0

    def host_holders(self) -> list[list[int]]:
        """Every host table sessions hold (integrity checks)."""
        return [b.host_table for s in self.sessions.values() for b in s.branches_and_self() if b.host_table]

    def expire(self, now: float | None = None) -> list[str]:
        now = now if now is not None else time.monotonic()
        gone = [s.session_id for s in self.sessions.values() if (_expires_in(s, now) or 0.0) < 0]
        for session_id in gone:
            self.close(session_id)
        self.num_expired += len(gone)
        return gone

    def _next_expiry(self, now: float | None = None) -> float:
        """Seconds until the first idle session's TTL runs out (a seat frees then unless it is used again);
        1 s when none can expire (every one busy or without a TTL: only a close frees a seat)."""
        now = now if now is not None else time.monotonic()
        left = [t for s in self.sessions.values() if (t := _expires_in(s, now)) is not None]
        return max(0.1, min(left)) if left else 1.0

    # ---- internals ------------------------------------------------------------------------------
    def _adopt(self, session: Session, branch: Branch) -> None:
        self.bm.release(session.block_table)
        self._drop_host(session)
        session.token_ids, session.block_table, session.num_computed = (
            branch.token_ids,
            branch.block_table,
            branch.num_computed,
        )
        session.host_table, session.num_host = branch.host_table, branch.num_host
        session.draft_index = branch.draft_index

    def _release_branches(self, session: Session) -> None:
        for b in session.branches:
            self.bm.release(b.block_table)
            self._drop_host(b)
        session.branches = []

    def _release(self, session: Session) -> None:
        self.bm.release(session.block_table)
        session.block_table, session.num_computed = [], 0
        self._drop_host(session)
        self._release_branches(session)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


# A session id a client proposes: 1-128 characters of letters, digits and ._~- (not starting with '.').
# The part before the first '.' is its affinity key (a proxy routes every call of the session by it).
_SESSION_ID = re.compile(r"[A-Za-z0-9_~-][A-Za-z0-9._~-]{0,127}")
# The engine's key of a session: the client's id inside its tenant's namespace, `TENANT/ID` (the
# frontend's server/tenancy.py makes it; the single tenant of a daemon without auth has no prefix).
_SESSION_KEY = re.compile(r"(?:[A-Za-z0-9._~-]{1,128}/)?" + _SESSION_ID.pattern)


def check_session_id(session_id: str, pattern: re.Pattern[str] = _SESSION_KEY) -> None:
    """A session key the engine takes (the frontend checks a client's id with `check_client_session_id`)."""
    if not pattern.fullmatch(session_id):
        raise InvalidRequest(
            f"session id {session_id[:140]!r} is not 1-128 characters of letters, digits and . _ ~ - "
            "(not starting with '.')"
        )


def check_client_session_id(session_id: str) -> None:
    """A session id as a client proposes it (no namespace)."""
    check_session_id(session_id, _SESSION_ID)


def _check_hints(expected_idle: float | None, retention: int) -> None:
    if expected_idle is not None and not (expected_idle >= 0 and math.isfinite(expected_idle)):
        raise InvalidRequest(f"expected idle time must be a finite number of seconds >= 0, got {expected_idle}")
    if retention not in (RETENTION_LOW, RETENTION_NORMAL, RETENTION_HIGH):
        raise InvalidRequest(f"unknown retention class {retention}")


def _check_ttl(ttl: float | None) -> None:
    """None: the default; a positive number of idle seconds; inf: never expires. NaN and <= 0 are refused."""
    if ttl is not None and (math.isnan(ttl) or ttl <= 0):
        raise InvalidRequest(f"ttl_seconds must be > 0 (inf: never expires), got {ttl}")
