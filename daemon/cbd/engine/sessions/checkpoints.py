"""SessionCheckpoints: sessions saved to their files (kv/disk_tier.py) and listed again at start.

When a session is saved, its file holds what a restarted daemon needs to go on as if it had never
stopped: the history's and pending candidates' token ids, their KV (from the GPU or the host tier),
the settings (TTL and idle time, retention, priority, chat or not; the tenant is part of the key),
and the frontend's note (a chat's transcript). A session is saved again only when it changed since
(a turn ended, or its note changed).

  drain (`save_all`)         every changed session, with its KV while the deadline allows; after it,
                             with its token ids and the KV its file held already (nothing gathered;
                             the rest is recomputed later, never lost). A save gathers only what the
                             file lacks (save_plan.py): the file keeps the rest (kv/session_file_save.py)
  background (`save_idle`)   changed sessions idle for at least `idle_for`, no turn in flight; the
                             write is queued to the disk tier's thread (a crash loses the turns since);
                             KV on the GPU is gathered there too, off the engine thread, its blocks
                             referenced until the write is done (at most HOLD_BYTES of them; beyond, a
                             save gathers on the engine thread as before)
  start (`restore`)          every file of this model becomes a session again at once, idle for as
                             long as it was plus the downtime (one whose TTL ran out meanwhile is
                             removed); its KV stays in the file (`Branch.disk`)
  read back                  into the host tier, for a turn or fork or ahead of them (read_back.py)
  spill (--disk-kv-spill)    when the host tier must release an idle session's KV (its pool is
                             full), the KV goes to the session's file instead of being lost: a file
                             written since its last change is reused as it is, else what the file
                             lacks of the host copy is gathered and appended (in flight at most
                             `spill_bytes`: half the host tier's size, at least SPILL_BYTES, or one
                             spill; beyond, it is recomputed); the session's next
                             turn waits for that write. KV the GPU pool lets go when the host tier
                             has no room is spilled from there only where that pool is in host
                             memory (`DiskTier.spills_from_gpu`)
  claim                      a session this daemon does not hold is taken over from the folder of a
                             daemon that stopped (kv/disk_tier.py), then treated as restored
  close, expiry              the file is removed

Engine-thread only (the writes themselves are the disk tier's thread's).
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections import deque
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from dataclasses import replace
from pathlib import Path

from cbd.engine.kv import session_files as files
from cbd.engine.kv.disk_tier import DiskTier, Planned, PoolBlocks, Written
from cbd.engine.kv.session_files import DiskCopy
from cbd.engine.outputs import SaveReport
from cbd.engine.sessions import save_plan
from cbd.engine.sessions.manager import SessionManager
from cbd.engine.sessions.read_back import ReadBack
from cbd.engine.sessions.records import Branch, Session

log = logging.getLogger(__name__)
# KV gathered for spills and not yet written (in host memory beside the host tier), at most half the host tier's
# size and at least this (one spill always may): writes that fall behind make room in the host tier meanwhile.
SPILL_BYTES = 4 * 2**30
# GPU KV that saves queued for the writer thread hold (`PoolBlocks`), at most (one save always may): beyond it a
# save gathers its GPU blocks on the engine thread, so that evictions meanwhile free GPU blocks (held ones free none).
HOLD_BYTES = 2 * 2**30


class SessionCheckpoints:
    def __init__(self, sessions: SessionManager, disk: DiskTier, spill: bool = False) -> None:
        """spill: the host tier's evictions go to disk (`--disk-kv-spill`)."""
        self.sessions = sessions
        self.disk = disk
        sessions.on_closed.append(self._closed)
        sessions.on_missing = self.claim
        # Writes queued, in order (one writer thread): (key, the session's turns then, the write); settled
        # into `_files` (the last file each session has with its KV, and its turns then) by `_settle`.
        self._writes: deque[tuple[str, int, Future[Written]]] = deque()
        self._files: dict[str, tuple[int, Written]] = {}
        # What each session's file holds (or will, once the writes queued are done): for each branch, the
        # tokens its extents end at, each with a hash of the token ids up to there (the writer compares the
        # ids themselves); the next save keeps what it can of it (`_plan`).
        self._files_kv: dict[str, save_plan.FileView] = {}
        self._spilling: dict[str, tuple[Future[Written], int]] = {}  # key -> its spill write, the bytes
        # GPU blocks the writer gathers for a queued save (kv/disk_tier.py `PoolBlocks`): referenced until it ends.
        self._held: deque[tuple[Future[Written], list[int]]] = deque()
        self._spill_on = spill
        host_bytes = disk.host_tier.pool.num_blocks * disk.bytes_per_block if disk.host_tier is not None else 0
        self.spill_bytes = max(SPILL_BYTES, host_bytes // 2)
        sessions.eviction.let_go = self.let_go
        if spill:
            sessions.eviction.spill = self.spill
        self.loads = ReadBack(sessions, disk, self._settle, self._spill_of, self.claim, self._forget_file)

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
            except Exception as exc:  # a disk error, or the gather of its GPU blocks failed
                _not_saved(key, exc)
                report.num_failed += 1
                return
            report.num_saved += 1
            report.num_with_kv += kept

        for session in sorted(self._changed(), key=lambda s: s.last_used, reverse=True):
            try:
                in_flight.append((session.session_id, self._save(session, time.monotonic() < deadline)))
            except Exception as exc:  # its KV could not be gathered: the others are saved all the same
                _not_saved(session.session_id, exc)
                report.num_failed += 1
            while len(in_flight) > 2:
                settle(*in_flight.popleft())
        while in_flight:
            settle(*in_flight.popleft())
        self._settle()  # the GPU blocks the writes gathered are let go
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
        # A session being spilled is saved after (its KV is in that write; `_save` would wait for it).
        self._settle()
        due = [
            s for s in self._changed()
            if s.busy is None and s.idle_seconds(now) >= idle_for and s.session_id not in self._spilling
        ]  # fmt: skip
        saved = 0
        for session in due:
            try:
                future = self._save(session, True)
            except Exception as exc:  # its KV could not be gathered: the others are saved all the same
                _not_saved(session.session_id, exc)
                continue
            future.add_done_callback(functools.partial(_log_failure, key=session.session_id))
            saved += 1
        return saved

    def _changed(self) -> list[Session]:
        return [s for s in self.sessions.sessions.values() if s.num_turns_saved != s.num_turns]

    def _save(
        self, session: Session, with_kv: bool, plan: list[save_plan.BranchKv] | None = None, durable: bool = True
    ) -> Future[Written]:
        """Queue the saving of a session: its KV (with_kv) as `plan` says (by default `_plan`'s). Not `durable`
        (a spill): written without fsyncs, and the session still counts as changed, so the next background or
        shutdown save writes its header again, fsynced (the KV its file holds by then is not written again). A
        durable save of a session whose spill is still being written waits for it: its KV is in that write."""
        spilling = self._spilling.get(session.session_id)
        if durable and spilling is not None:
            futures_wait([spilling[0]])
        self._settle()
        key = session.session_id
        if plan is None:  # without KV: what its file holds already is still kept (nothing gathered)
            plan = [p if with_kv else replace(p, kv_tokens=p.keep) for p in self._plan(session)]
        branches: list[files.SavedBranch] = []
        kv: list[Planned | None] = []
        view: save_plan.FileView = []  # what the file will hold (see `_files_kv`)
        held: list[int] = []
        bm = self.sessions.eviction.bm
        room = HOLD_BYTES - sum(len(ids) for _, ids in self._held) * self.disk.bytes_per_block
        try:
            for b, p in zip(session.branches_and_self(), plan, strict=True):
                new = save_plan.new_kv(self.disk, b, p, gather_gpu=not durable) if p.kv_tokens else None
                ids = [i for d, _ in new.extents if isinstance(d, PoolBlocks) for i in d.block_ids] if new else []
                if ids and len(ids) * self.disk.bytes_per_block > room and (self._held or held):
                    new = save_plan.new_kv(self.disk, b, p, gather_gpu=True)  # past HOLD_BYTES: gathered now
                elif ids:
                    held += bm.share(ids)
                    room -= len(ids) * self.disk.bytes_per_block
                saved = files.SavedBranch(list(b.token_ids), p.kv_tokens if new is not None else 0)
                branches.append(saved)
                kv.append(new)
                view.append(save_plan.view_after(p, saved, self.disk.block_size))
            saved_session = files.SavedSession(
                self.disk.fingerprint, key, session.ttl, session.idle_seconds(), time.time(), session.is_chat,
                session.expected_idle, session.retention, session.priority, session.note, branches,
            )  # fmt: skip
            if durable:
                session.num_turns_saved = session.num_turns
            future = self.disk.write(saved_session, kv, durable)
        except BaseException:
            bm.release(held)
            raise
        if held:
            self._held.append((future, held))
        self._files_kv[key] = view
        self._writes.append((key, session.num_turns if with_kv else -1, future))  # -1: not all its KV
        return future

    def _plan(self, session: Session) -> list[save_plan.BranchKv]:
        return save_plan.plan(self.disk, session, self._files_kv.get(session.session_id, []))

    def _settle(self) -> None:
        """Note the writes that have ended (in order): each session's last file with all its KV (for spills);
        a write that did not keep all it was given leaves `_files_kv` as the file holds it (a failed one:
        forgotten, the next save whole). The GPU blocks finished writes held are let go (`let_go`)."""
        self.let_go()
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
                        self._files_kv[key] = save_plan.held(written.saved)  # what the file holds as written
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
        if self.loads.reading(session.session_id):
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
    def spill(self, session: Session, going: list[Branch]) -> bool:
        """The host copies of these branches of an idle session are about to be released to recompute (the
        caller clears `host` after): keep the KV in the session's file instead (see the module docstring).
        False: it is not kept (files of token ids only, or too much in flight): the branches recompute."""
        self._settle()
        if not self.disk.keeps_kv:  # files hold token ids only: nothing to keep
            return False
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
                return True
        if not self.disk.spills_from_gpu and any(b.block_table for b in branches):
            return False  # KV in the GPU's pool would be gathered from it: recomputed, see DiskTier.spills_from_gpu
        plan = self._plan(session)
        per_block, size = self.disk.bytes_per_block, self.disk.block_size
        need = sum(-(-p.kv_tokens // size) - p.keep // size for p in plan) * per_block
        in_flight = sum(n for _, n in self._spilling.values())
        if key in self._spilling or (in_flight and in_flight + need > self.spill_bytes):
            return False  # recomputed
        self._spilling[key] = (self._save(session, True, plan, durable=False), need)
        self.disk.count_spill()
        return True

    def let_go(self) -> None:
        """Release the GPU blocks held by saves whose writes are done (in order: one writer thread)."""
        while self._held and self._held[0][0].done():
            self.sessions.eviction.bm.release(self._held.popleft()[1])

    def held_blocks(self) -> list[list[int]]:
        """GPU blocks referenced by queued saves (`PoolBlocks`), until `let_go` (integrity checks)."""
        return [ids for _, ids in self._held]

    def _spill_of(self, key: str) -> Future[Written] | None:
        entry = self._spilling.get(key)
        return entry[0] if entry is not None else None

    def _forget_file(self, key: str) -> None:
        """The session's file is damaged: the next save writes its KV whole."""
        self._files_kv.pop(key, None)

    # ---- restoring ------------------------------------------------------------------------------
    def restore(self) -> list[str]:
        """List every saved session of this model again (their KV stays on disk); returns their keys."""
        restored = [saved.key for path, saved in self.disk.saved_sessions() if self._list(path, saved)]
        self.disk.count_restored(len(restored), 0)
        self.loads.prefetching = sorted(restored, key=lambda k: self.sessions.sessions[k].last_used, reverse=True)
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
        self._files_kv[saved.key] = save_plan.held(saved)
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

    def _closed(self, session: Session) -> None:
        self._files.pop(session.session_id, None)
        self._files_kv.pop(session.session_id, None)
        self.disk.remove(session.session_id)


def _log_failure(future: Future[Written], key: str) -> None:
    exc = future.exception()
    if exc is not None:
        _not_saved(key, exc)


def _not_saved(key: str, exc: BaseException) -> None:
    log.warning("session %s could not be saved: %s", key, exc)


def _result(future: Future[Written]) -> Written | None:
    return future.result() if future.exception() is None else None
