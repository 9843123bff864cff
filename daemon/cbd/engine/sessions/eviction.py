"""SessionEviction: which idle sessions' KV leaves the GPU under memory pressure, and where it goes.

Idle sessions yield to running requests: when the pool runs short, idle sessions' KV leaves the GPU
in eviction order (`order`: retention LOW, NORMAL, HIGH; within one, the session expected back last
goes first). With a host tier it is copied there (`HostTier.offload`); the next turn's sequence takes
references on the copy and the scheduler restores it before its prefill. Without one, or when the
host pool is full of sessions due back sooner, it is released: the tokens stay, and the next turn
recomputes, reviving whatever the prefix cache still holds (with `--disk-kv-spill` the host tier makes
room by spilling idle sessions' host copies to their files, those of no higher retention whose files keep
their KV; what still finds no room goes to the session's file straight from the GPU, `spill`, only where
the pool is in host memory: on a GPU it recomputes). Host copies are evicted in the same order, to recompute
(`HostTier.evict`), or to the session's file with spilling on; a turn whose KV is read back from its
file makes room in the host tier the same way (`free_host`). Before any idle session's host copy goes, the
copies of sessions whose turn is running go (`_drop_stale`): such a copy is kept only so that a turn that fails
leaves its session as it was (its KV is in the turn's sequences, restored from the copy), so under host
pressure it costs nothing but that fallback: a failed turn then recomputes. The tier does the copies and
counts them; this class only picks the sessions. Engine-thread only.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

from cbd.engine.kv.blocks import BlockManager
from cbd.engine.sessions.records import Branch, Session

if TYPE_CHECKING:
    from cbd.engine.kv.host_tier import HostTier


class SessionEviction:
    def __init__(self, sessions: dict[str, Session], block_manager: BlockManager, host_tier: HostTier | None) -> None:
        """sessions: the session manager's table (shared, not copied)."""
        self.sessions = sessions
        self.bm = block_manager
        self.host_tier = host_tier
        self.num_evictions = 0  # sessions whose KV left the GPU
        self.num_stale_dropped = 0  # running turns' sessions whose host copy was released for room (`_drop_stale`)
        # Called before an idle session's host copies are released to make room on the host: the disk tier
        # keeps them instead of letting them go to recompute (sessions/checkpoints.py; False: it could not,
        # they are recomputed); None: no disk tier.
        self.spill: Callable[[Session, list[Branch]], bool] | None = None
        # Called before GPU blocks are looked for: saves whose writes are done let go of the GPU blocks they
        # held (sessions/checkpoints.py `let_go`); None: no disk tier.
        self.let_go: Callable[[], None] | None = None

    def order(self, sessions: list[Session], now: float | None = None) -> list[Session]:
        """Which sessions leave a tier first: retention LOW, then NORMAL, then HIGH; within a class, the
        one expected back last (`Session.next_use`) first."""
        now = now if now is not None else time.monotonic()
        return sorted(sessions, key=lambda s: (s.retention, -s.next_use(now)))

    def evict(self, blocks_needed: int, include_busy: bool = False) -> int:
        """Move sessions' KV off the GPU in eviction order until blocks_needed are free: idle sessions
        only, or also those with a turn in flight (the turn's sequence keeps its own references, so
        this frees only what nothing running needs; the session recomputes later). An idle session's
        KV goes to the host tier when there is one and it has room (after evicting host-resident
        sessions that come before it in the same order); otherwise it is released. Returns the
        blocks freed."""
        if self.let_go is not None:
            self.let_go()
        freed = 0
        now = time.monotonic()
        order = self.order([s for s in self.sessions.values() if include_busy or s.busy is None], now)
        for rank, session in enumerate(order):
            if self.bm.num_free_blocks >= blocks_needed:
                break
            if not any(b.block_table for b in session.branches_and_self()):
                continue
            before = self.bm.num_free_blocks
            for b in session.branches_and_self():
                b.draft_index = None  # idle long enough to leave the GPU: its drafter index goes too
                later = [s for s in order[rank + 1 :] if s.retention <= session.retention]
                if b.block_table and not (session.busy is None and self._offload(b, order[:rank], later)):
                    if session.busy is None and self.spill is not None:  # no host room: to disk, not recompute
                        self.spill(session, [b])
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
        if self.let_go is not None:
            self.let_go()
        tier = self.host_tier
        if tier is None or self.bm.num_free_blocks >= free_target:
            return
        for session in self.order([s for s in self.sessions.values() if s.busy is None]):
            if self.bm.num_free_blocks >= free_target:
                break
            branches = [b for b in session.branches_and_self() if b.block_table]
            if not branches:
                continue
            if sum(tier.blocks_to_copy(b.block_table) for b in branches) > tier.num_free_blocks:
                break  # proactively, only into free host blocks
            for b in branches:
                b.draft_index = None
                self._offload(b, [])
            self.num_evictions += 1

    def free_host(self, count: int, coming: Session, ahead: bool = False) -> bool:
        """Make `count` host blocks free for the KV of `coming`, whose turn or fork is here (its KV read back
        from its file): evict the host copies of idle sessions in eviction order, those of a retention no
        higher than its own (it is wanted now: it comes last among its peers), spilled to disk first with
        `--disk-kv-spill`; none if all of them would not free enough. ahead: `coming` is read back ahead of
        its turn (sessions/read_back.py), a guess: only sessions expected back after it make way
        (`Session.expected_back`), and only those whose KV their files keep (none without spilling). The host
        copies of sessions whose turn is running go first (`_drop_stale`; with or without spilling). Returns
        whether `count` blocks are free."""
        tier = self.host_tier
        if tier is None or tier.num_free_blocks >= count:
            return tier is not None
        now = time.monotonic()
        idle = [s for s in self.sessions.values() if s.busy is None and s is not coming]
        going = [s for s in self.order(idle, now) if s.retention <= coming.retention]
        if ahead:  # a guess: only sessions due back after it, whose files keep their KV (none without spilling)
            going = [s for s in going if s.expected_back(now) > coming.expected_back(now)] if self.spill else []
        # Only if evicting them all would free enough (blocks may be shared with what stays): else none goes.
        stale = self._stale()
        if tier.num_free_blocks + self._freed_by(stale + going) < count:
            return False
        self._drop_stale(count, stale)
        self._evict_host(going, count, keep_kv=ahead)
        return tier.num_free_blocks >= count

    def _stale(self) -> list[Session]:
        """Sessions whose turn is running and whose host copy its sequences no longer hold or wait to be restored
        from (restored, and run or set aside again), among those that copy alone holds some blocks of."""
        tier = self.host_tier
        if tier is None:
            return []
        restoring = {id(r.seq) for r in tier.restoring if r.source is not None}
        return [
            s for s in self.sessions.values()
            if s.busy is not None
            and not any(
                q.host_prefix is not None or q.host_backup is not None or id(q) in restoring for q in s.busy.sequences
            )
            and self._freed_by([s])
        ]  # fmt: skip

    def _freed_by(self, sessions: list[Session]) -> int:
        """The host blocks that releasing these sessions' host copies would free (those no one else holds)."""
        tier = self.host_tier
        assert tier is not None
        held = Counter(
            i for s in sessions for b in s.branches_and_self() if b.host is not None for i in b.host.block_ids
        )
        return sum(1 for i, n in held.items() if tier.pool.ref_counts[i] == n)

    def _drop_stale(self, count: int, stale: list[Session] | None = None) -> None:
        """Release the host copies of sessions whose turn is running (`_stale`) until `count` host blocks are free:
        their KV is in the turn's sequences (or recomputed by them); only a turn that fails would have gone back
        to the copy (it recomputes then)."""
        tier = self.host_tier
        assert tier is not None
        for session in self._stale() if stale is None else stale:
            if tier.num_free_blocks >= count:
                return
            for b in session.branches_and_self():
                if b.host is not None:
                    tier.release(b.host)
                    b.host = None
            self.num_stale_dropped += 1

    def _evict_host(self, sessions: list[Session], count: int, keep_kv: bool = False) -> None:
        """Evict the host copies of these idle sessions, in order, until `count` host blocks are free; keep_kv:
        only those whose KV is kept in their files (a session the spill refuses keeps its host copy)."""
        tier = self.host_tier
        assert tier is not None
        for other in sessions:
            if tier.num_free_blocks >= count:
                break
            copies = [b.host for b in other.branches_and_self() if b.host is not None]
            if other.busy is None and copies:
                kept = self.spill is not None and self.spill(
                    other, [b for b in other.branches_and_self() if b.host is not None]
                )
                if keep_kv and not kept:
                    continue
                tier.evict(copies)
                for b in other.branches_and_self():
                    b.host = None

    def _offload(self, branch: Branch, before: list[Session], after: list[Session] | None = None) -> bool:
        """Copy a branch's GPU blocks to the host tier and free them (fenced until the copy is done);
        False if there is no tier or no room in it, even after evicting the host copies of sessions in
        `before` (those that come before this one in eviction order) and, with spilling on, those of the
        sessions in `after` (after it, of no higher retention) whose files keep their KV: a spill from the
        host tier gathers host memory (after the copies in flight), where one from the GPU pool would wait
        for the step in flight and copy to pageable memory, the batch stalled."""
        tier = self.host_tier
        if tier is None:
            return False

        def make_room(count: int) -> None:
            self._drop_stale(count)
            self._evict_host(before, count)
            if after and self.spill is not None and tier.num_free_blocks < count:
                self._evict_host(after, count, keep_kv=True)

        copy = tier.offload(branch.block_table, branch.num_computed, make_room)
        if copy is None:  # no room, or the copy failed: the caller releases the KV (the next turn recomputes)
            return False
        self.bm.release(branch.block_table)
        branch.host = copy
        branch.block_table, branch.num_computed = [], 0
        return True
