"""SessionCheckpoints: sessions saved to their files (kv/disk_tier.py) and listed again at start.

When a session is saved, its file holds what a restarted daemon needs to go on as if it had never
stopped: the history's and pending candidates' token ids, their KV (from the GPU or the host tier),
the settings (TTL and idle time, retention, priority, chat or not; the tenant is part of the key),
and the frontend's note (a chat's transcript). A session is saved again only when it changed since
(a turn ended, or its note changed).

  drain (`save_all`)         every changed session, with its KV while the deadline allows; after it,
                             with its token ids and the KV its file held already (nothing gathered;
                             the rest is recomputed later, never lost). A save gathers only what the
                             file lacks (`_plan`): the file keeps the rest (kv/session_files.py)
  background (`save_idle`)   changed sessions idle for at least `idle_for`, no turn in flight; the
                             write is queued to the disk tier's thread (a crash loses the turns since)
  start (`restore`)          every file of this model becomes a session again at once, idle for as
                             long as it was plus the downtime (one whose TTL ran out meanwhile is
                             removed); its KV stays in the file (`Branch.disk`)
  read back                  into the host tier, on the disk tier's reader thread (`start_load`, then
                             `completed` hands the host copies to the branches): the engine thread
                             defers a session's commands meanwhile (engine_loop.py), so the turn waits
                             and the batch does not. A full host tier makes way for a turn's or fork's
                             KV (idle sessions of no higher retention go, spilled if spilling is on:
                             `SessionEviction.free_host`). While the host tier has room, restored sessions
                             are read back ahead of their turns, most recently used first (`prefetch`).
                             A caller without that loop (an EngineCore used directly) reads back
                             synchronously before the turn or fork (`read_back`)
  spill (--disk-kv-spill)    when the host tier must release an idle session's KV (its pool is
                             full), the KV goes to the session's file instead of being lost: a file
                             written since its last change is reused as it is, else what the file
                             lacks of the host copy is gathered and appended (at most SPILL_BYTES in
                             flight, or one spill; beyond, it is recomputed); the session's next
                             turn waits for that write
  claim                      a session this daemon does not hold is taken over from the folder of a
                             daemon that stopped (kv/disk_tier.py), then treated as restored
  close, expiry              the file is removed

Engine-thread only (the writes themselves are the disk tier's thread's).
"""

from __future__ import annotations

import array
import bisect
import functools
import hashlib
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from cbd.engine.kv import session_files as files
from cbd.engine.kv.disk_tier import DiskTier, Load, Written
from cbd.engine.kv.host_pool import HostCopy
from cbd.engine.kv.session_files import DiskCopy
from cbd.engine.outputs import SaveReport
from cbd.engine.sessions.manager import SessionManager
from cbd.engine.sessions.records import Branch, Session

log = logging.getLogger(__name__)
SPILL_BYTES = 4 * 2**30  # KV gathered for spills and not yet written, at most (one spill always may)


class SessionCheckpoints:
    def __init__(self, sessions: SessionManager, disk: DiskTier, spill: bool = False) -> None:
        """spill: the host tier's evictions go to disk (`--disk-kv-spill`)."""
        self.sessions = sessions
        self.disk = disk
        sessions.on_closed.append(self._closed)
        sessions.read_back = self.read_back
        sessions.on_missing = self.claim
        self.on_loaded: Callable[[], object] | None = None  # called on the reader thread (wakes the loop)
        self._loads: dict[str, list[tuple[Branch, Load]]] = {}  # session key -> its branches being read back
        self._after_spill: dict[str, Future[Written]] = {}  # session key -> its spill, to be read back after
        self._prefetch: list[str] = []  # restored sessions not yet read back, most recently used first
        # Writes queued, in order (one writer thread): (key, the session's turns then, the write); settled
        # into `_files` (the last file each session has with its KV, and its turns then) by `_settle`.
        self._writes: deque[tuple[str, int, Future[Written]]] = deque()
        self._files: dict[str, tuple[int, Written]] = {}
        # What each session's file holds (or will, once the writes queued are done): for each branch, the
        # tokens its extents end at, each with a hash of the token ids up to there (the writer compares the
        # ids themselves); the next save keeps what it can of it (`_plan`).
        self._files_kv: dict[str, list[list[tuple[int, bytes]]]] = {}
        self._spilling: dict[str, tuple[Future[Written], int]] = {}  # key -> its spill write, the bytes
        self._spill_on = spill
        if spill:
            sessions.eviction.spill = self.spill

    # ---- saving ---------------------------------------------------------------------------------
    def take_notes(self, notes: dict[str, bytes]) -> None:
        """The frontend's notes (chat transcripts) of sessions whose note changed."""
        for key, note in notes.items():
            session = self.sessions.sessions.get(key)
            if session is not None and session.note != note:
                session.note = note
                session.num_turns_saved = -1

    def save_all(self, seconds: float) -> SaveReport:
        """Save every changed session, with its KV until `seconds` have passed, then without gathering."""
        start = time.monotonic()
        deadline = start + seconds
        report = SaveReport()
        in_flight: deque[tuple[str, Future[Written]]] = deque()  # the next snapshot is taken while one is written

        def settle(key: str, future: Future[Written]) -> None:
            try:
                kept = future.result().has_kv
            except OSError as exc:
                log.warning("session %s could not be saved: %s", key, exc)
                report.num_failed += 1
                return
            report.num_saved += 1
            report.num_with_kv += kept

        for session in sorted(self._changed(), key=lambda s: s.last_used, reverse=True):
            in_flight.append((session.session_id, self._save(session, time.monotonic() < deadline)))
            while len(in_flight) > 2:
                settle(*in_flight.popleft())
        while in_flight:
            settle(*in_flight.popleft())
        report.seconds = time.monotonic() - start
        self.disk.count_checkpoint(report.seconds)
        log.info(
            "saved %d sessions in %.2f s (%d with KV, %d token ids only, %d failed)", report.num_saved,
            report.seconds, report.num_with_kv, report.num_saved - report.num_with_kv, report.num_failed,
        )  # fmt: skip
        return report

    def save_idle(self, idle_for: float) -> int:
        """Queue the saving of changed sessions idle for at least `idle_for` seconds; returns how many."""
        now = time.monotonic()
        due = [s for s in self._changed() if s.busy is None and s.idle_seconds(now) >= idle_for]
        for session in due:
            self._save(session, True).add_done_callback(functools.partial(_log_failure, key=session.session_id))
        return len(due)

    def _changed(self) -> list[Session]:
        return [s for s in self.sessions.sessions.values() if s.num_turns_saved != s.num_turns]

    def _save(self, session: Session, with_kv: bool, plan: list[_BranchKv] | None = None) -> Future[Written]:
        """Queue the saving of a session: its KV (with_kv) as `plan` says (by default `_plan`'s)."""
        self._settle()
        key = session.session_id
        if plan is None:  # without KV: what its file holds already is still kept (nothing gathered)
            plan = [p if with_kv else replace(p, kv_tokens=p.keep) for p in self._plan(session)]
        branches: list[files.SavedBranch] = []
        kv: list[files.NewKv | None] = []
        view: list[list[tuple[int, bytes]]] = []  # what the file will hold (see `_files_kv`)
        size = self.disk.block_size
        for b, p in zip(session.branches_and_self(), plan, strict=True):
            new = self._new_kv(b, p) if p.kv_tokens else None
            tokens = p.kv_tokens if new is not None else 0
            saved = files.SavedBranch(list(b.token_ids), tokens)
            branches.append(saved)
            kv.append(new)
            bounds = list(p.bounds) if new is not None else []
            last = bounds[-1][0] if bounds else 0
            # The new extents' ends: their whole blocks', then a partial block's.
            ends = sorted({e for e in (tokens // size * size, tokens) if e > last})
            bounds += zip(ends, _prefix_hashes(saved.token_ids, ends), strict=True)
            view.append(bounds)
        saved_session = files.SavedSession(
            self.disk.fingerprint, key, session.ttl, session.idle_seconds(), time.time(), session.is_chat,
            session.expected_idle, session.retention, session.priority, session.note, branches,
        )  # fmt: skip
        session.num_turns_saved = session.num_turns
        future = self.disk.write(saved_session, kv)
        self._files_kv[key] = view
        self._writes.append((key, session.num_turns if with_kv else -1, future))  # -1: not all its KV
        return future

    def _plan(self, session: Session) -> list[_BranchKv]:
        """What saving each branch's KV takes: the tokens it covers, and the extents of the session's file it
        can keep (a run of whole blocks, or the whole branch unchanged, under the same tokens)."""
        if not self.disk.keeps_kv:
            return [_BranchKv(0) for _ in session.branches_and_self()]
        size = self.disk.block_size
        on_file = self._files_kv.get(session.session_id, [])
        plan = []
        for b in session.branches_and_self():
            tokens = self._kv_tokens(b)
            best = _BranchKv(tokens)
            for base, bounds in enumerate(on_file):
                # The extents' ends it may keep (a whole block's, or all of an unchanged branch's)...
                usable = [
                    i for i, (end, _) in enumerate(bounds) if end <= tokens and (end % size == 0 or end == tokens)
                ]
                # ... and of those the last under the same tokens (a prefix that matches, matches shorter).
                i = bisect.bisect_right(
                    usable, 0, key=lambda j: 0 if _prefix_hashes(b.token_ids, [bounds[j][0]])[0] == bounds[j][1] else 1
                )
                if i and bounds[usable[i - 1]][0] > best.keep:
                    best = _BranchKv(tokens, base, bounds[usable[i - 1]][0], bounds[: usable[i - 1] + 1])
            plan.append(best)
        return plan

    def _kv_tokens(self, b: Branch) -> int:
        """The tokens whose KV a branch holds (on the GPU, the host or in its file)."""
        if b.block_table and b.num_computed:
            return min(b.num_computed, len(b.token_ids))
        if b.host is not None:
            return b.host.num_tokens
        return b.disk.num_tokens if b.disk is not None else 0

    def _new_kv(self, b: Branch, p: _BranchKv) -> files.NewKv | None:
        """The KV a branch's file lacks (blocks from `p.keep`'s on), gathered to host bytes: its whole blocks,
        then its last partial block apart (so that the next save keeps the whole ones)."""
        size, per_block = self.disk.block_size, self.disk.bytes_per_block
        if p.keep >= p.kv_tokens:  # the branch's KV is in the file as it is
            return files.NewKv(p.base, p.keep, [])
        first, count = p.keep // size, -(-p.kv_tokens // size)
        data = self._blocks(b, first, count)
        if data is None:  # the file it was only in is damaged: saved without (recomputed later)
            return None
        whole = p.kv_tokens // size - first
        extents: list[tuple[bytes | memoryview, int]] = []
        if whole:
            extents.append((data[: whole * per_block], whole * size))  # keep is a whole block's end here
        if p.kv_tokens % size:
            extents.append((data[whole * per_block :], p.kv_tokens % size))
        return files.NewKv(p.base, p.keep, extents)

    def _blocks(self, b: Branch, first: int, count: int) -> memoryview | None:
        """A branch's KV blocks [first, count) as host bytes (`[blocks, layers, block_size, *slot]`)."""
        if b.block_table and b.num_computed:
            tensor = self.disk.gather_gpu(b.block_table[first:count])
        elif b.host is not None:
            tensor = self.disk.gather_host(HostCopy(b.host.block_ids[first:count], 0))
        else:  # only in a file it is not kept in (written anew or damaged since): read it back first
            assert b.disk is not None
            data = files.read_kv(b.disk.path, b.disk.branch)
            per_block = self.disk.bytes_per_block
            if data is None or len(data) != -(-b.disk.num_tokens // self.disk.block_size) * per_block:
                return None
            return memoryview(data)[first * per_block : count * per_block]
        return tensor.view(torch.uint8).reshape(-1).numpy().data  # raw bytes, no copy

    def _settle(self) -> None:
        """Note the writes that have ended (in order): each session's last file with all its KV (for spills);
        a write that did not keep all it was given leaves `_files_kv` as the file holds it (a failed one:
        forgotten, the next save whole)."""
        while self._writes and self._writes[0][2].done():
            key, turns, future = self._writes.popleft()
            written = _result(future)
            session = self.sessions.sessions.get(key)
            if written is None or not written.kept_kv:
                self._files.pop(key, None)
                if not any(k == key for k, _, _ in self._writes):  # else the later write's view stands
                    if written is None or session is None:
                        self._files_kv.pop(key, None)  # failed: the file as it was, not known here
                    else:
                        self._files_kv[key] = _held(written.saved)  # what the file holds as written
            if written is not None and session is not None:
                if written.kept_kv and self._spill_on:  # what a spill may reuse
                    self._files[key] = (turns, written)
                self._point_at(session, written)
        for key, (future, _) in list(self._spilling.items()):
            if not future.done():
                continue
            del self._spilling[key]
            session = self.sessions.sessions.get(key)
            entry = self._files.get(key)
            if session is None or entry is None or entry[1] is not _result(future):
                continue  # closed, or the write failed or kept no KV: the session recomputes
            for copy, b in zip(entry[1].copies(), session.branches_and_self()):
                if copy is not None and not b.block_table and b.host is None and b.disk is None:
                    b.disk = copy

    def _point_at(self, session: Session, written: Written) -> None:
        """Branches whose KV is only in the session's file point at it as written now (a file written anew
        has its extents elsewhere); one being read back keeps the copy it reads."""
        if session.session_id in self._loads:
            return
        for b in session.branches_and_self():
            if b.disk is None:
                continue
            n = b.disk.num_tokens
            same = [c for c in written.copies() if c is not None and c.num_tokens == n and c.branch.token_ids[:n] == b.token_ids[:n]]  # fmt: skip
            if not same:
                b.disk = None  # recomputed
            elif same[0].branch.extents != b.disk.branch.extents:
                b.disk = same[0]

    # ---- spilling: the host tier's evictions go to disk -----------------------------------------------
    def spill(self, session: Session, going: list[Branch]) -> None:
        """The host copies of these branches of an idle session are about to be released to recompute (the
        caller clears `host` after): keep the KV in the session's file instead (see the module docstring)."""
        self._settle()
        if not self.disk.keeps_kv:  # files hold token ids only: nothing to keep
            return
        key = session.session_id
        branches = session.branches_and_self()
        entry = self._files.get(key)
        if entry is not None and entry[0] == session.num_turns:
            copies = entry[1].copies()
            by_branch = dict(zip(map(id, branches), copies)) if len(copies) == len(branches) else {}
            if all(by_branch.get(id(b)) is not None for b in going):
                for b in going:
                    b.disk = by_branch[id(b)]
                self.disk.count_spill()
                return
        plan = self._plan(session)
        per_block, size = self.disk.bytes_per_block, self.disk.block_size
        need = sum(-(-p.kv_tokens // size) - p.keep // size for p in plan) * per_block
        in_flight = sum(n for _, n in self._spilling.values())
        if key in self._spilling or (in_flight and in_flight + need > SPILL_BYTES):
            return  # recomputed
        self._spilling[key] = (self._save(session, True, plan), need)
        self.disk.count_spill()

    def _finish_spill(self, key: str) -> None:
        """Wait for the session's spill write, if one is under way (its next turn reads the file)."""
        entry = self._spilling.get(key)
        if entry is not None:
            futures_wait([entry[0]])
        self._settle()

    # ---- restoring ------------------------------------------------------------------------------
    def restore(self) -> list[str]:
        """List every saved session of this model again (their KV stays on disk); returns their keys."""
        restored = [saved.key for path, saved in self.disk.saved_sessions() if self._list(path, saved)]
        self.disk.count_restored(len(restored), 0)
        self._prefetch = sorted(restored, key=lambda k: self.sessions.sessions[k].last_used, reverse=True)
        if restored:
            log.info("restored %d saved sessions from %s", len(restored), self.disk.directory)
        return restored

    def claim(self, key: str) -> bool:
        """A session this daemon does not hold: take it over from a stopped daemon's folder of the shared
        directory (kv/disk_tier.py), if one left it there. True if it is held now."""
        if key in self.sessions.sessions:
            return True
        found = self.disk.claim(key)
        if found is None or not self._list(*found):
            return False
        self.disk.count_restored(1, 0)
        return True

    def _list(self, path: Path, saved: files.SavedSession) -> bool:
        """Make a saved session open again (its KV on disk); False if its TTL ran out while it was saved, or
        max_sessions are open."""
        idle = saved.idle_seconds + max(0.0, time.time() - saved.saved_at)
        if saved.ttl is not None and math.isfinite(saved.ttl) and idle > saved.ttl:
            log.info("session %s expired while the daemon was down", saved.key)
            self.disk.remove(saved.key)
            return False
        if len(self.sessions.sessions) >= self.sessions.max_sessions:
            log.warning("session %s is not restored: max_sessions (%d) are open", saved.key, self.sessions.max_sessions)
            self.disk.count_restored(0, 1)
            return False
        first, *rest = [self._branch(path, b) for b in saved.branches]
        self._files_kv[saved.key] = _held(saved)
        self.sessions.sessions[saved.key] = Session(
            first.token_ids, disk=first.disk, session_id=saved.key, ttl=saved.ttl, is_chat=saved.is_chat,
            branches=rest, last_used=time.monotonic() - idle, expected_idle=saved.expected_idle,
            retention=saved.retention, priority=saved.priority, num_turns=0, num_turns_saved=0, note=saved.note,
        )  # fmt: skip
        return True

    @staticmethod
    def _branch(path: Path, saved: files.SavedBranch) -> Branch:
        return Branch(saved.token_ids, disk=DiskCopy(path, saved) if saved.kv_tokens else None)

    def notes(self, key: str | None = None) -> dict[str, bytes]:
        """The notes of the sessions that have one (the frontend's transcripts, at its start), or of the one
        session `key` (claimed first if not held: a chat turn needs its transcript before it is rendered)."""
        if key is None:
            return {k: s.note for k, s in self.sessions.sessions.items() if s.note}
        session = self.sessions.sessions[key] if self.claim(key) else None
        return {key: session.note} if session is not None and session.note else {}

    def read_back(self, session: Session) -> bool:
        """Before a turn or a fork: read the session's saved KV into the host tier (or recompute it), after
        its spill if one is under way. True if some branch's KV was on disk."""
        self._finish_spill(session.session_id)
        on_disk = False
        for b in session.branches_and_self():
            if b.disk is not None:
                self._room_for(session, b.disk)
                load = self.disk.start_load(b.disk)
                if load is not None:  # else no host room: recomputed
                    load.future.result()
                    b.host = self.disk.finish_load(load)
                    if b.host is None:  # damaged: the next save writes the session's KV whole
                        self._files_kv.pop(session.session_id, None)
                b.disk = None
                on_disk = True
        return on_disk

    def _room_for(self, session: Session, copy: DiskCopy) -> None:
        """Free host blocks for a branch's KV read back for a turn or fork now (idle sessions' host copies
        make way: sessions/eviction.py `free_host`)."""
        self.sessions.eviction.free_host(-(-copy.num_tokens // self.disk.block_size), session)

    # ---- reading back on the reader thread ------------------------------------------------------------
    def needs_load(self, key: str) -> bool:
        """The session's KV (some branch's) is only in its file, or being read back, or its spill is still
        being written (its KV is read back after: `start_load`). A session not held is claimed first (see
        `claim`)."""
        self._settle()
        if key in self._spilling or key in self._after_spill:
            return True
        if key not in self._loads:
            self.claim(key)
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
        spilling = self._spilling.get(key)
        if spilling is not None:  # its spill first, off the engine thread: `completed` starts the load after
            self._after_spill[key] = spilling[0]
            if self.on_loaded is not None:
                spilling[0].add_done_callback(lambda _: self.on_loaded() if self.on_loaded else None)
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
                if host is None:  # damaged: the next save writes the session's KV whole
                    self._files_kv.pop(key, None)
                if session is None or branch.disk is not load.copy:  # closed or expired meanwhile
                    if host is not None:
                        assert self.disk.host_tier is not None
                        self.disk.host_tier.release(host)
                    continue
                branch.host, branch.disk = host, None
            done.append(key)
        return done

    def prefetch(self, busy: Callable[[str], bool]) -> None:
        """Read the next restored session back ahead of its turn, one at a time, while the host tier keeps a
        quarter free after it; `busy(key)`: the session has commands waiting (they start its load)."""
        host = self.disk.host_tier
        if self._loads or host is None:
            return
        while self._prefetch:
            key = self._prefetch[0]
            session = self.sessions.sessions.get(key)
            if session is None or busy(key) or not any(b.disk for b in session.branches_and_self()):
                self._prefetch.pop(0)
                continue
            need = sum(-(-b.disk.num_tokens // self.disk.block_size) for b in session.branches_and_self() if b.disk)
            if host.num_free_blocks - need < host.pool.num_blocks // 4:
                self._prefetch.clear()  # the rest are read back when their turns come
                return
            self._prefetch.pop(0)
            self.start_load(key)
            return

    def load_copies(self) -> list[HostCopy]:
        """Host copies held by reads in flight (integrity checks)."""
        return [load.host for pending in self._loads.values() for _, load in pending]

    def _closed(self, session: Session) -> None:
        self._files.pop(session.session_id, None)
        self._files_kv.pop(session.session_id, None)
        self.disk.remove(session.session_id)


@dataclass(slots=True)
class _BranchKv:
    """How a branch's KV is saved: the tokens it covers; the file's branch `base` whose extents up to `keep`
    tokens are kept (their ends: `bounds`); the rest is gathered and appended."""

    kv_tokens: int
    base: int | None = None
    keep: int = 0
    bounds: list[tuple[int, bytes]] = field(default_factory=list)


def _prefix_hashes(token_ids: list[int], ends: Iterable[int]) -> list[bytes]:
    """A digest of the token ids up to each end (ascending), in one pass."""
    digest, at, out = hashlib.blake2b(digest_size=16), 0, []
    for end in ends:
        digest.update(array.array("q", token_ids[at:end]).tobytes())
        at = end
        out.append(digest.copy().digest())
    return out


def _held(saved: files.SavedSession) -> list[list[tuple[int, bytes]]]:
    """What a file holds, as `_files_kv` keeps it: each branch's extents' ends with their digests."""
    held = []
    for b in saved.branches:
        ends = list(itertools.accumulate(e.num_tokens for e in b.extents))
        held.append(list(zip(ends, _prefix_hashes(b.token_ids, ends), strict=True)))
    return held


def _log_failure(future: Future[bool], key: str) -> None:
    exc = future.exception()
    if exc is not None:
        log.warning("session %s could not be saved: %s", key, exc)


def _result(future: Future[Written]) -> Written | None:
    return future.result() if future.exception() is None else None
