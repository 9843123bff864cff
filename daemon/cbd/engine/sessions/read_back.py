"""ReadBack: sessions' KV read from their files (kv/disk_tier.py) back into the host tier.

  on the reader thread  for a turn or fork (`needs_load`, `start_load`; `completed` hands the host copies to
                        the branches): the engine thread defers a session's commands meanwhile
                        (engine_loop.py), so the turn waits and the batch does not. A turn of a session whose
                        spill is still being written waits the same way, then its KV is read back
  ahead of turns        restored sessions, most recently used first, one at a time, while the host tier
                        keeps a quarter free (`prefetch`); and a session whose agent said when it would be
                        back (`expected_idle`) once it is due within READ_AHEAD_SECONDS plus the time its KV
                        takes to read, into host blocks that sessions due back after it make way for
                        (`_due`: the disk's latency hidden behind the agent's tool call)
  synchronously         for a caller without that loop (an EngineCore used directly), before the turn or
                        fork (`read_back`)

A full host tier makes way for a turn's or fork's KV: idle sessions of no higher retention go, spilled if
spilling is on (sessions/eviction.py `free_host`); a branch that still finds no room is recomputed, as is
one whose file is damaged (and its file's view forgotten: the next save writes its KV whole).

Engine-thread only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait

from cbd.engine.kv.disk_tier import DiskTier, Load, Written
from cbd.engine.kv.host_pool import HostCopy
from cbd.engine.kv.session_files import DiskCopy
from cbd.engine.sessions.manager import SessionManager
from cbd.engine.sessions.records import Branch, Session

READ_AHEAD_SECONDS = 1.0  # how long before a session is due back (beyond its read time) its KV is read back
READ_AHEAD_EVERY = 0.02  # seconds between two looks for sessions due (a look walks every session)


class ReadBack:
    def __init__(
        self, sessions: SessionManager, disk: DiskTier, settle: Callable[[], None],
        spill_of: Callable[[str], Future[Written] | None], claim: Callable[[str], bool],
        forget_file: Callable[[str], None],
    ) -> None:  # fmt: skip
        """settle: note the writes that ended (checkpoints.py); spill_of(key): the session's spill write under
        way, if any; claim(key): take a session over from a stopped daemon's folder; forget_file(key): the
        session's file is damaged."""
        self.sessions = sessions
        self.disk = disk
        self._settle, self._spill_of, self._claim, self._forget_file = settle, spill_of, claim, forget_file
        self.on_loaded: Callable[[], object] | None = None  # called on the reader thread (wakes the loop)
        self._loads: dict[str, list[tuple[Branch, Load]]] = {}  # session key -> its branches being read back
        self._after_spill: dict[str, Future[Written]] = {}  # session key -> its spill, to be read back after
        self.prefetching: list[str] = []  # restored sessions not yet read back, most recently used first
        self.num_read_ahead = 0  # sessions read back because they were due (`_due`)
        self._read_ahead: dict[str, float] = {}  # session key -> its last use when it was read ahead (once each)
        self._next_look = 0.0
        sessions.read_back = self.read_back

    def reading(self, key: str) -> bool:
        """The session's KV is being read back."""
        return key in self._loads

    def read_back(self, session: Session) -> bool:
        """Before a turn or a fork: read the session's saved KV into the host tier (or recompute it), after
        its spill if one is under way. True if some branch's KV was on disk."""
        spilling = self._spill_of(session.session_id)
        if spilling is not None:
            futures_wait([spilling])
        self._settle()
        on_disk = False
        for b in session.branches_and_self():
            if b.disk is not None:
                self._room_for(session, b.disk)
                load = self.disk.start_load(b.disk)
                if load is not None:  # else no host room: recomputed
                    load.future.result()
                    b.host = self.disk.finish_load(load)
                    if b.host is None:
                        self._forget_file(session.session_id)
                b.disk = None
                on_disk = True
        return on_disk

    def _room_for(self, session: Session, copy: DiskCopy) -> None:
        """Free host blocks for a branch's KV read back for a turn or fork now (idle sessions' host copies
        make way: sessions/eviction.py `free_host`)."""
        self.sessions.eviction.free_host(self._blocks([copy]), session)

    def needs_load(self, key: str) -> bool:
        """The session's KV (some branch's) is only in its file, or being read back, or its spill is still
        being written (its KV is read back after: `start_load`). A session not held is claimed first."""
        self._settle()
        if self._spill_of(key) is not None or key in self._after_spill:
            return True
        if key not in self._loads:
            self._claim(key)
        session = self.sessions.sessions.get(key)
        return key in self._loads or (session is not None and any(b.disk for b in session.branches_and_self()))

    def start_load(self, key: str) -> None:
        """Start reading the session's KV back (unless under way), into host blocks freed for it if need be
        (`_room_for`); branches that cannot be (no host room even then) are recomputed. `completed` names
        the session when it is done. Called for a turn or fork, and by `prefetch`, which calls it only
        when the host tier has room to spare."""
        self._settle()  # a file written anew since: the branches point at it
        session = self.sessions.sessions.get(key)
        if key in self._loads or key in self._after_spill or session is None:
            return
        spilling = self._spill_of(key)
        if spilling is not None:  # its spill first, off the engine thread: `completed` starts the load after
            self._after_spill[key] = spilling
            if self.on_loaded is not None:
                spilling.add_done_callback(lambda _: self.on_loaded() if self.on_loaded else None)
            return
        pending: list[tuple[Branch, Load]] = []
        self._loads[key] = pending  # before making room: spills meanwhile leave its branches alone
        for b in session.branches_and_self():
            if b.disk is not None:
                self._room_for(session, b.disk)
                load = self.disk.start_load(b.disk, self.on_loaded)
                if load is None:
                    b.disk = None  # recomputed
                else:
                    pending.append((b, load))

    def completed(self) -> list[str]:
        """Sessions whose reading back has ended: their branches hold the host copies now (or recompute)."""
        done = []
        for key, spilled in list(self._after_spill.items()):
            if spilled.done():
                del self._after_spill[key]
                self._settle()  # the spilled branches point at the file now
                self.start_load(key)
                if key not in self._loads:  # closed meanwhile: its commands go on (and fail as they do)
                    done.append(key)
        for key, pending in list(self._loads.items()):
            if not all(load.future.done() for _, load in pending):
                continue
            del self._loads[key]
            session = self.sessions.sessions.get(key)
            for branch, load in pending:
                host = self.disk.finish_load(load)
                if host is None:
                    self._forget_file(key)
                if session is None or branch.disk is not load.copy:  # closed or expired meanwhile
                    if host is not None:
                        assert self.disk.host_tier is not None
                        self.disk.host_tier.release(host)
                    continue
                branch.host, branch.disk = host, None
            done.append(key)
        return done

    def prefetch(self, busy: Callable[[str], bool]) -> None:
        """Read a session back ahead of its turn, one at a time: the next one due (`_due`), else the next
        restored one while the host tier keeps a quarter free after it; `busy(key)`: the session has commands
        waiting (they start its load)."""
        host = self.disk.host_tier
        if self._loads or host is None:
            return
        if self._due(busy):
            return
        while self.prefetching:
            key = self.prefetching[0]
            session = self.sessions.sessions.get(key)
            if session is None or busy(key) or not any(b.disk for b in session.branches_and_self()):
                self.prefetching.pop(0)
                continue
            need = self._blocks([b.disk for b in session.branches_and_self() if b.disk])
            if host.num_free_blocks - need < host.pool.num_blocks // 4:
                self.prefetching.clear()  # the rest are read back when their turns come
                return
            self.prefetching.pop(0)
            self.start_load(key)
            return

    def _due(self, busy: Callable[[str], bool]) -> bool:
        """Start reading back the idle session due back soonest (`Session.hinted_back`) among those whose KV is
        in their file and who are due within READ_AHEAD_SECONDS plus its read time (or are late, within the
        hint's grace), once per idle period, if the host tier has room for it or sessions expected back after
        it can make room (`free_host(ahead=True)`). True if one was started."""
        now = time.monotonic()
        if now < self._next_look:
            return False
        self._next_look = now + READ_AHEAD_EVERY
        self._settle()  # spills written since: their branches point at the files
        soonest: tuple[float, Session, int] | None = None
        for key, session in self.sessions.sessions.items():
            due = session.hinted_back(now)
            if due is None or session.busy is not None or busy(key) or self._read_ahead.get(key) == session.last_used:
                continue
            on_disk = [b.disk for b in session.branches_and_self() if b.disk is not None]
            if not on_disk or key in self._after_spill or self._spill_of(key) is not None:
                continue
            size = sum(e.length for copy in on_disk for e in copy.branch.extents)
            if due - now <= READ_AHEAD_SECONDS + self.disk.read_seconds(size) and (soonest is None or due < soonest[0]):
                soonest = (due, session, self._blocks(on_disk))
        if soonest is None:
            return False
        _, session, blocks = soonest
        if not self.sessions.eviction.free_host(blocks, session, ahead=True):
            return False
        key = session.session_id
        self._read_ahead = {k: t for k, t in self._read_ahead.items() if k in self.sessions.sessions}
        self._read_ahead[key] = session.last_used
        self.num_read_ahead += 1
        self.start_load(key)
        return True

    def _blocks(self, copies: list[DiskCopy]) -> int:
        """The host blocks these branches' KV takes once read back."""
        return sum(-(-copy.num_tokens // self.disk.block_size) for copy in copies)

    def load_copies(self) -> list[HostCopy]:
        """Host copies held by reads in flight (integrity checks)."""
        return [load.host for pending in self._loads.values() for _, load in pending]
