"""SessionManager: the table of open sessions, their lifecycle and their turns.

A turn builds its prompt from the session's history (append the new tokens, or replace the history
by a re-rendered conversation that shares its longest common prefix); the turn's sequence starts
from the session's KV (resident blocks, or a host copy the scheduler restores first), so only the
new tokens are prefilled. When the turn ends, the session adopts the finished sequence's tokens and
blocks (n = 1), or keeps every candidate as a branch until the next turn names the one that continues
(`parent_candidate`). Sessions expire after their idle TTL; their number is capped. Under memory
pressure idle sessions' KV leaves the GPU (`eviction`, session_eviction.py). The records and their
invariants are in sessions.py. Engine-thread only, like the block manager it shares.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from cbd.engine.kv.blocks import BlockManager
from cbd.engine.kv.host_pool import HostCopy
from cbd.engine.sampling_params import PRIORITY_BATCH, PRIORITY_INTERACTIVE
from cbd.engine.sequence import Request, Sequence
from cbd.engine.sessions.eviction import SessionEviction
from cbd.engine.sessions.records import (
    RETENTION_NORMAL,
    Branch,
    Session,
    SessionInfo,
    TurnInput,
    TurnStart,
    check_hints,
    check_session_id,
    check_ttl,
)
from cbd.errors import CapacityExceeded, HistoryMismatch, InvalidRequest, SessionBusy, SessionExists, UnknownSession

if TYPE_CHECKING:
    from cbd.engine.kv.host_tier import HostTier


class SessionManager:
    def __init__(
        self, block_manager: BlockManager, max_sessions: int, default_ttl: float | None,
        host_tier: HostTier | None = None,
    ) -> None:  # fmt: skip
        """host_tier: where idle sessions' KV goes under GPU memory pressure (None: released, to recompute)."""
        self.bm = block_manager
        self.host_tier = host_tier
        self.max_sessions = max_sessions
        self.default_ttl = default_ttl
        self.sessions: dict[str, Session] = {}
        self.eviction = SessionEviction(self.sessions, block_manager, host_tier)
        self._ids = itertools.count()
        self.hits = {"gpu": 0, "host": 0, "disk": 0, "recompute": 0}  # turns by where their history's KV was
        # Called with each session closed or expired: SessionCheckpoints' (sessions/checkpoints.py, when
        # sessions are saved: its file goes), the speculator's (its drafts donor goes: spec/agent_index.py).
        self.on_closed: list[Callable[[Session], object]] = []
        # Set by ReadBack (sessions/read_back.py): a session's saved KV is read back before a turn or fork uses it.
        self.read_back: Callable[[Session], bool] | None = None
        self.on_missing: Callable[[str], bool] | None = None  # a session not held: taken over if saved elsewhere

    # ---- lifecycle ----------------------------------------------------------------------------
    def open(
        self, ttl: float | None = None, token_ids: list[int] | None = None, is_chat: bool = False,
        session_id: str | None = None, expected_idle: float | None = None, retention: int = RETENTION_NORMAL,
        priority: int = 0,
    ) -> Session:  # fmt: skip
        """A new session whose history is `token_ids` (no KV yet). ttl None: the default; inf: never expires."""
        check_ttl(ttl)
        check_hints(expected_idle, retention)
        if priority not in (PRIORITY_INTERACTIVE, PRIORITY_BATCH):
            raise InvalidRequest(f"unknown priority {priority}")
        if session_id:
            check_session_id(session_id)
            # A session saved by a daemon that stopped is still open: it is taken over, not opened anew.
            if session_id in self.sessions or (self.on_missing is not None and self.on_missing(session_id)):
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
        if session is None and self.on_missing is not None and self.on_missing(session_id):
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
        for closed in self.on_closed:
            closed(session)

    def fork(
        self, session_id: str, candidate: int | None = None, ttl: float | None = None, new_session_id: str | None = None
    ) -> Session:
        """A new session continuing from this one (or from one of its pending candidates); copy-on-write.
        new_session_id: the id the fork gets (checked as open's); None: one is made."""
        check_ttl(ttl)
        if new_session_id:
            check_session_id(new_session_id)
            if new_session_id in self.sessions:
                raise SessionExists(f"a session with id {new_session_id!r} is open already")
        source = self.get(session_id)
        if source.busy is not None:
            raise SessionBusy(f"session {session_id!r} has a turn in flight; fork it when the turn ends")
        base = self.pending_base(source, candidate, "candidate")
        self._read_back(source)
        child = self.open(
            ttl if ttl is not None else source.ttl, base.token_ids, source.is_chat, new_session_id,
            retention=source.retention, priority=source.priority,
        )  # fmt: skip
        child.block_table = self.bm.share(base.block_table)
        child.num_computed = base.num_computed
        if base.host is not None:
            assert self.host_tier is not None  # only a tier sets it
            child.host = self.host_tier.share(base.host)
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
        disk = 0
        for b in session.branches_and_self():
            resident.update(b.block_table)
            host.update(b.host.block_ids if b.host is not None else ())
            disk += -(-b.disk.num_tokens // self.bm.block_size) if b.disk is not None else 0
        tier = (
            "gpu" if resident else "host" if host else "disk" if disk else "recompute" if session.token_ids else "none"
        )
        return SessionInfo(
            session.session_id, len(session.token_ids), len(resident), len(session.branches),
            session.idle_seconds(), session.busy is not None, session.ttl, session.is_chat, len(host), tier,
            session.expected_idle, session.retention, session.priority, disk,
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
        check_hints(turn.expected_idle, turn.retention if turn.retention is not None else RETENTION_NORMAL)
        base = self.pending_base(session, turn.parent_candidate, "parent_candidate")
        prompt = list(turn.token_ids) if turn.replace else base.token_ids + list(turn.token_ids)
        if turn.extends and (len(base.token_ids) >= len(prompt) or prompt[: len(base.token_ids)] != base.token_ids):
            raise HistoryMismatch(
                f"the conversation does not extend the {len(base.token_ids)} tokens of session {session.session_id!r}"
            )
        validate(prompt)
        from_disk = self._read_back(session)
        if session.branches:
            assert turn.parent_candidate is not None  # pending_base refused it otherwise
            self._adopt(session, session.branches.pop(turn.parent_candidate))
            self._release_branches(session)
            session.num_turns += 1  # changed even if this turn fails (the candidate stays adopted)
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
        if session.host is not None:  # the KV is on the host: the turn restores the common prefix's blocks
            assert self.host_tier is not None  # only a tier sets it
            self.hits["disk" if from_disk else "host"] += 1
            computed = min(session.host.num_tokens, common, len(prompt) - 1)
            host = self.host_tier.share(session.host, computed) if computed else None
            return TurnStart(prompt, [], 0, host, index)
        if session.token_ids:
            self.hits["gpu" if session.num_computed else "recompute"] += 1
        # Reuse the resident KV of the common prefix; at least one token is computed (for logits).
        computed = min(session.num_computed, common, len(prompt) - 1)
        table = self.bm.share(session.block_table[: -(-computed // self.bm.block_size)])
        return TurnStart(prompt, table, computed, draft_index=index)

    def turn_started(self, session: Session, request: Request) -> None:
        session.busy = request
        session.last_used = time.monotonic()
        request.session = session

    def holds(self, session: Session) -> bool:
        """Whether session is open here (not closed or expired, even if its id was opened again)."""
        return self.sessions.get(session.session_id) is session

    def candidate_finished(self, session: Session, seq: Sequence) -> None:
        """Called before a finished candidate's blocks are freed: keep them as a branch."""
        if not self.holds(session) or session.busy is not seq.request:
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
        session.num_turns += 1
        if len(session.branches) == 1:
            self._adopt(session, session.branches.pop())

    # ---- expiry -------------------------------------------------------------------------------
    def expire(self, now: float | None = None) -> list[str]:
        now = now if now is not None else time.monotonic()
        gone = [s.session_id for s in self.sessions.values() if (s.expires_in(now) or 0.0) < 0]
        for session_id in gone:
            self.close(session_id)
        return gone

    def _next_expiry(self, now: float | None = None) -> float:
        """Seconds until the first idle session's TTL runs out (a seat frees then unless it is used again);
        1 s when none can expire (every one busy or without a TTL: only a close frees a seat)."""
        now = now if now is not None else time.monotonic()
        left = [t for s in self.sessions.values() if (t := s.expires_in(now)) is not None]
        return max(0.1, min(left)) if left else 1.0

    # ---- internals ------------------------------------------------------------------------------
    def host_copies(self) -> list[HostCopy]:
        """Every host copy sessions hold (integrity checks)."""
        return [b.host for s in self.sessions.values() for b in s.branches_and_self() if b.host is not None]

    def _read_back(self, session: Session) -> bool:
        """Read a restored session's saved KV back (into the host tier) before it is used; True if it had some."""
        return self.read_back is not None and self.read_back(session)

    def _adopt(self, session: Session, branch: Branch) -> None:
        self.bm.release(session.block_table)
        self._drop_host(session)
        session.token_ids, session.block_table, session.num_computed = (
            branch.token_ids,
            branch.block_table,
            branch.num_computed,
        )
        session.host, session.disk = branch.host, branch.disk
        session.draft_index = branch.draft_index

    def _release_branches(self, session: Session) -> None:
        for b in session.branches:
            self.bm.release(b.block_table)
            self._drop_host(b)
        session.branches = []

    def _release(self, session: Session) -> None:
        self.bm.release(session.block_table)
        session.block_table, session.num_computed, session.disk = [], 0, None
        self._drop_host(session)
        self._release_branches(session)

    def _drop_host(self, branch: Branch) -> None:
        if branch.host is not None:
            assert self.host_tier is not None  # only a tier sets it
            self.host_tier.release(branch.host)
            branch.host = None


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
