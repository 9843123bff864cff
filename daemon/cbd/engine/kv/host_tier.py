"""HostTier: the one owner of the host KV tier: its pool, its copier, restores, set-asides, offloads,
evictions, and their counts.

Who holds what (every holder has one reference on each host block of its `HostCopy`):
  a session's branch     offloaded idle KV (`offload`; dropped by `release`, or by `evict` to recompute);
  seq.host_prefix        a turn's history on the host, or a sequence set aside (`set_aside`): restored
                         when the scheduler admits it (`start_restore`, then `issue_restores`);
  a Restore's source     until its copy is issued; then it becomes seq.host_backup;
  seq.host_backup        after a restore, until the sequence runs (`admitted`), so that setting it
                         aside again frees its GPU blocks without copying anything back.
GPU blocks being copied to the host are fenced with the copy's ticket when they are freed (the block
manager hands the fence to the plan that reuses them; `fence_compute` makes that step wait). A
sequence being restored is in `restoring`, not in the scheduler's queues, until its copy completes
(`completed_restores`), so no step waits for a restore. `check_integrity` checks every reference
against its holders. Engine-thread only.

A second tier (disk) would implement the same interface beside this one: `offload` / `share` /
`release` / `evict` for sessions' copies, `set_aside` / `start_restore` / `issue_restores` /
`completed_restores` / `admitted` / `drop` for sequences, `stats` and `check_integrity`; the scheduler
and the sessions know no more of a tier than that.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import torch

from cbd.config import EngineConfig
from cbd.engine.device.streams import DeviceStreams
from cbd.engine.kv.blocks import BlockManager
from cbd.engine.kv.copier import KvCopier
from cbd.engine.kv.host_pool import HostCopy, HostPool
from cbd.engine.outputs import HostTierStats
from cbd.engine.sequence import Sequence
from cbd.errors import SettingError

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Restore:
    """A sequence whose KV comes back from the host: blocks [hits, len(source.block_ids)) of its table are
    copied from the source's; the source's references are held until the copy is issued (then None)."""

    seq: Sequence
    source: HostCopy | None
    hits: int
    num_tokens: int
    ticket: int | None = None  # set when the copy is issued


class HostTier:
    def __init__(self, pool: HostPool, copier: KvCopier, block_manager: BlockManager) -> None:
        self.pool, self.copier, self.bm = pool, copier, block_manager
        self.restoring: list[Restore] = []  # admitted, waiting for their copy
        self.num_offloaded_blocks = 0  # idle sessions' blocks copied, and set-aside sequences' blocks placed
        self.num_restored_blocks = 0
        self.num_restored_tokens = 0  # prompt tokens whose KV came from the host instead of being computed
        self.num_host_evictions = 0  # holders (sessions) whose host blocks were released to recompute
        self._stats = HostTierStats()  # the restore latency histogram (cumulative)

    @classmethod
    def from_config(
        cls, config: EngineConfig, kv_caches: torch.Tensor, streams: DeviceStreams, block_manager: BlockManager,
        block_bytes: int,
    ) -> HostTier | None:  # fmt: skip
        """The tier the config sizes (None: none). The host memory first: a size the host cannot give fails
        here, naming the setting, if the setting was given; by default the daemon goes on without a tier."""
        num_host = config.num_host_kv_blocks or 0
        if config.num_host_kv_blocks is None:
            num_host = config.host_kv_bytes(block_manager.num_blocks * block_bytes) // block_bytes
        if not num_host:
            return None
        try:
            copier = KvCopier(kv_caches, block_manager.block_size, num_host, streams)
        except SettingError as exc:
            if config.host_kv_gib is not None or config.num_host_kv_blocks is not None:
                raise
            log.warning("no host KV tier: %s", exc)
            return None
        return cls(HostPool(num_host), copier, block_manager)

    # ---- sessions' copies ---------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_to_copy(self, gpu_ids: list[int]) -> int:
        """How many new host blocks offloading these GPU blocks takes (the host shares what it holds)."""
        return self.pool.missing(self._keys(gpu_ids))

    def offload(self, gpu_ids: list[int], num_tokens: int, make_room: Callable[[int], None]) -> HostCopy | None:
        """Copy GPU blocks (the KV of the first num_tokens tokens) to the host, after `make_room(count)`
        if fewer than the count it needs are free, and fence them with the copy (the caller frees them).
        None if there is no room or the copy failed: nothing taken."""
        keys = self._keys(gpu_ids)
        count = self.pool.missing(keys)
        if self.pool.num_free_blocks < count:
            make_room(count)
        copy = self._place(gpu_ids, keys, num_tokens)
        if copy is not None:
            self.num_offloaded_blocks += count
        return copy

    def share(self, copy: HostCopy, num_tokens: int | None = None) -> HostCopy:
        """A new holder of (the blocks covering the first num_tokens of) a copy; None: all of it."""
        if num_tokens is None:
            return HostCopy(self.pool.share(copy.block_ids), copy.num_tokens)
        return HostCopy(self.pool.share(copy.block_ids[: -(-num_tokens // self.bm.block_size)]), num_tokens)

    def release(self, copy: HostCopy | None) -> None:
        if copy is not None:
            self.pool.release(copy.block_ids)

    def evict(self, copies: list[HostCopy]) -> None:
        """Release one holder's copies (all of a session's) to make room: it recomputes later."""
        for copy in copies:
            self.pool.release(copy.block_ids)
        self.num_host_evictions += 1

    def read_blocks(self, host_ids: list[int]) -> torch.Tensor:
        """A copy of host blocks' KV `[blocks, layers, block_size, *slot]` (a session file's segment)."""
        self.copier.wait_for(host_ids, host_writes=False)  # an offload to these blocks may still be in flight
        return self.copier.host[torch.tensor(host_ids, dtype=torch.int64)]

    def take_blocks(self, count: int, num_tokens: int) -> HostCopy | None:
        """`count` fresh host blocks for the caller to fill (a session file's KV, see `block_buffers`);
        None if the pool lacks room."""
        placed = self.pool.place([None] * count)
        if placed is None:
            return None
        self.copier.wait_for(placed[0], host_writes=True)  # a restore issued from a block just freed may still read it
        return HostCopy(placed[0], num_tokens)

    def block_buffers(self, copy: HostCopy) -> list[memoryview]:
        """Writable views of a copy's host blocks, one per run of consecutive ids, in order."""
        ids = copy.block_ids
        runs: list[memoryview] = []
        first = 0
        for i in range(1, len(ids) + 1):
            if i == len(ids) or ids[i] != ids[i - 1] + 1:
                run = self.copier.host[ids[first] : ids[i - 1] + 1]
                runs.append(run.view(torch.uint8).reshape(-1).numpy().data)
                first = i
        return runs

    # ---- sequences (the scheduler) ------------------------------------------------------------
    def set_aside(self, seq: Sequence) -> None:
        """Before seq's GPU blocks are freed (preempted, or making room): keep their KV on the host when
        there is room, to restore when seq is admitted again (else it is recomputed then)."""
        computed = min(seq.num_computed_tokens, seq.num_tokens - 1)
        backup = seq.host_backup
        if backup is not None and seq.host_prefix is None and computed == backup.num_tokens:
            seq.host_prefix, seq.host_backup = backup, None  # restored and not run: still on the host
        elif seq.host_prefix is None and computed > 0 and seq.block_table:
            table = seq.block_table[: -(-computed // self.bm.block_size)]
            copy = self._place(table, self._keys(table), computed)
            if copy is not None:
                seq.host_prefix = copy
                self.num_offloaded_blocks += len(table)

    def start_restore(self, seq: Sequence, budget: int, make_room: Callable[[Sequence, int], bool]) -> bool | None:
        """Give seq (its prefix-cache hits already attached) fresh blocks for the rest of its host prefix;
        their copy is issued once this step is launched (`issue_restores`: the step's own block copies may
        still read a block just freed and handed out here). True: seq is now in `restoring`; False: nothing
        to restore (the prefix cache had it all), admit it; None: no room now (nothing changed)."""
        source = seq.host_prefix
        assert source is not None
        hits = len(seq.block_table)
        if hits >= len(source.block_ids) or seq.num_computed_tokens >= source.num_tokens:
            self.pool.release(source.block_ids)
            seq.host_prefix = None
            return False
        # Room for the restored blocks and the first chunk after them, or the restore would be undone.
        tokens = source.num_tokens
        if not make_room(seq, tokens - seq.num_computed_tokens + min(seq.num_tokens - tokens, budget)):
            return None
        seq.host_prefix = None
        seq.block_table += self.bm.allocate_blocks(len(source.block_ids) - hits)
        seq.num_computed_tokens = tokens
        self.restoring.append(Restore(seq, source, hits, tokens))
        return True

    def issue_restores(self) -> list[Sequence]:
        """Start the copies that `start_restore` set up (call after launching the step). Returns the
        sequences whose copy failed, in order: they recompute what they lack (the caller requeues them)."""
        failed: list[Sequence] = []
        bs = self.bm.block_size
        for r in [r for r in self.restoring if r.ticket is None]:
            assert r.source is not None
            fresh = r.seq.block_table[r.hits : len(r.source.block_ids)]
            try:
                r.ticket = self.copier.restore(r.source.block_ids[r.hits :], fresh)
            except Exception:
                log.exception("restoring %d KV blocks from the host tier failed; they are recomputed", len(fresh))
                self.restoring.remove(r)
                self.bm.release(fresh)
                del r.seq.block_table[r.hits :]
                r.seq.num_committed_blocks = min(r.seq.num_committed_blocks, r.hits)
                r.seq.num_computed_tokens = r.hits * bs
                failed.append(r.seq)
            else:
                self.num_restored_blocks += len(fresh)
                self.num_restored_tokens += r.num_tokens - r.hits * bs
                if r.seq.host_backup is None:  # kept until it runs (see set_aside)
                    r.seq.host_backup, r.source = r.source, None
            self.release(r.source)
            r.source = None
        return failed

    def completed_restores(self, wait_oldest: bool) -> list[Sequence]:
        """Sequences whose restore is complete, in admission order (they leave `restoring`); with
        wait_oldest (nothing else to run), wait for the oldest restore rather than spin."""
        done: list[Restore] = []
        pending: list[Restore] = []
        for i, r in enumerate(self.restoring):
            complete = r.ticket is not None and self.copier.is_done(r.ticket, wait_oldest and i == 0)
            (done if complete else pending).append(r)
        self.restoring = pending
        return [r.seq for r in done]

    def admitted(self, seq: Sequence) -> None:
        """seq runs: the host copy it was restored from is no longer needed."""
        self.release(seq.host_backup)
        seq.host_backup = None

    def drop(self, seq: Sequence) -> None:
        """seq finished or was aborted: give back everything it holds on the host, and its restore."""
        for i, r in enumerate(self.restoring):
            if r.seq is seq:
                del self.restoring[i]
                if r.ticket is not None:  # its blocks are being written: whoever gets them next waits
                    self.bm.fence(seq.block_table, r.ticket)
                else:  # never issued: the host references are still held
                    self.release(r.source)
                break
        self.release(seq.host_prefix)
        self.release(seq.host_backup)
        seq.host_prefix = seq.host_backup = None

    # ---- the step, stats, integrity -----------------------------------------------------------
    def fence_compute(self, tickets: set[int]) -> None:
        """A step reuses GPU blocks that copies to the host still read: its device work waits for them."""
        self.copier.fence_compute(tickets)

    def stats(self, session_hits: dict[str, int]) -> HostTierStats:
        """A snapshot: the pool, what moved, the restore latencies seen so far; `session_hits` (session
        turns by where their KV was) is the session manager's count, reported here."""
        stats = self._stats
        for seconds in self.copier.drain_latencies():
            stats.observe_restore(seconds)
        stats.num_blocks, stats.num_blocks_used = self.pool.num_blocks, self.pool.num_used_blocks
        stats.bytes_per_block = self.copier.bytes_per_block
        stats.num_offloaded_blocks = self.num_offloaded_blocks
        stats.num_restored_blocks = self.num_restored_blocks
        stats.num_restored_tokens = self.num_restored_tokens
        stats.num_host_evictions = self.num_host_evictions
        stats.session_hits = dict(session_hits)
        return replace(stats, restore_buckets=list(stats.restore_buckets), session_hits=dict(stats.session_hits))

    def check_integrity(self, holders: Iterable[HostCopy]) -> None:
        """Every host block's ref count equals its holders: `holders` (sessions' branches, sequences'
        prefixes and backups) and the restores not yet issued."""
        tables = [c.block_ids for c in holders]
        tables += [r.source.block_ids for r in self.restoring if r.source is not None]
        self.pool.check_integrity(tables)

    # ---- internals ----------------------------------------------------------------------------
    def _keys(self, gpu_ids: list[int]) -> list[tuple[int, tuple[int, ...]] | None]:
        """Content keys of GPU blocks: (prefix-cache hash, tokens) of a full committed block, else None."""
        keys: list[tuple[int, tuple[int, ...]] | None] = []
        for b in gpu_ids:
            block = self.bm.blocks[b]
            keys.append((block.hash, block.token_ids) if block.hash is not None else None)
        return keys

    def _place(
        self, gpu_ids: list[int], keys: list[tuple[int, tuple[int, ...]] | None], num_tokens: int
    ) -> HostCopy | None:
        """Host blocks holding these GPU blocks' KV (a full block the host holds already is shared, not
        copied again); the GPU blocks are fenced by the copy. None if no room or the copy failed."""
        placed = self.pool.place(keys)
        if placed is None:
            return None
        host_ids, copy = placed
        if copy:
            try:
                ticket = self.copier.offload([gpu_ids[i] for i in copy], [host_ids[i] for i in copy])
            except Exception:
                log.exception("offloading %d KV blocks to the host tier failed; they will be recomputed", len(copy))
                self.pool.release(host_ids)
                return None
            self.bm.fence(gpu_ids, ticket)
        return HostCopy(host_ids, num_tokens)
