"""Moves KV blocks between the GPU pool and the host pool, on a copy stream of its own.

The host pool is `[host_blocks, layers, block_size, 2, kv_heads, head_dim]` (pinned on CUDA): one
host block is one GPU block's KV for every layer, and a run of consecutive host blocks is one
contiguous range, so a batch of blocks moves in one gather (or scatter) on the device and one
host<->device copy per run of host blocks, in pieces of at most `chunk_bytes`.

Ordering (CUDA; on CPU every copy is done when the call returns and every ticket is complete):
  offload   the copy stream first waits for everything the compute stream has been given so far
            (the blocks' KV may still be being written by a step in flight), then reads the GPU
            blocks. The caller frees those GPU blocks at once but fences them with the ticket: a step
            that reuses one makes the compute stream wait for the ticket (`fence_compute`).
  restore   the copy stream waits for the compute stream as well (a freshly allocated block may
            still be read by a step in flight), then writes the GPU blocks. The sequence they belong
            to is not scheduled before its ticket is complete (`is_done`), so no step waits for it.
Offloads and restores are ordered among themselves by the one copy stream. The host itself reads host
blocks (a spill's gather) only after the offloads still writing them, and fills freed host blocks (a session
file's KV read back) only after the copies still reading or writing them (`wait_for`), not after every copy
in flight: each copy first waits for the step the GPU is computing.
"""

from __future__ import annotations

import itertools
import time

import torch

from cbd.engine.device.streams import DeviceStreams
from cbd.errors import SettingError


class KvCopier:
    def __init__(
        self, kv_caches: torch.Tensor, block_size: int, num_host_blocks: int, streams: DeviceStreams,
        chunk_bytes: int = 256 * 2**20,
    ) -> None:  # fmt: skip
        layers, slots, *slot_shape = kv_caches.shape  # a slot: [2, kv_heads, head_dim], or FP8 bytes
        self.block_size = block_size
        self.streams = streams
        # [layers, gpu_blocks, block_size, *slot]: a view of the GPU pool by block.
        self.gpu = kv_caches.view(layers, slots // block_size, block_size, *slot_shape)
        shape = (num_host_blocks, layers, block_size, *slot_shape)
        try:
            self.host = torch.empty(shape, dtype=kv_caches.dtype, pin_memory=streams.cuda)
        except (RuntimeError, MemoryError) as exc:  # memory the system will not give or lock
            gib = self.block_bytes(kv_caches, block_size) * num_host_blocks / 2**30
            raise SettingError(
                f"host_kv_gib: cannot allocate {gib:.1f} GiB of {'pinned ' if streams.cuda else ''}host memory for "
                f"the host KV tier ({(str(exc).splitlines() or [type(exc).__name__])[0]}); lower it, or 0 to go without"
            ) from None
        self.bytes_per_block = self.host[0].numel() * self.host.element_size() if num_host_blocks else 0
        self.blocks_per_chunk = max(1, chunk_bytes // max(1, self.bytes_per_block))
        self.stream = torch.cuda.Stream(kv_caches.device) if streams.cuda else None
        self._tickets = itertools.count(1)
        self._events: dict[int, tuple[torch.cuda.Event, float, bool]] = {}  # incomplete: (event, start, restore)
        self._restore_seconds: list[float] = []  # restores' start-to-completion times seen since the last drain
        # Host block -> the ticket of the last copy issued to it (an offload) / from it (a restore), while in flight.
        self._last_write: dict[int, int] = {}
        self._last_read: dict[int, int] = {}

    @staticmethod
    def block_bytes(kv_caches: torch.Tensor, block_size: int) -> int:
        return kv_caches[:, :block_size].numel() * kv_caches.element_size()

    # ---- copies -------------------------------------------------------------------------------
    @torch.inference_mode()
    def offload(self, gpu_ids: list[int], host_ids: list[int]) -> int:
        """Copy GPU blocks to host blocks (pairwise); returns the copy's ticket."""
        return self._copy(gpu_ids, host_ids, to_host=True)

    @torch.inference_mode()
    def restore(self, host_ids: list[int], gpu_ids: list[int]) -> int:
        """Copy host blocks to GPU blocks (pairwise); returns the copy's ticket."""
        return self._copy(gpu_ids, host_ids, to_host=False)

    def _copy(self, gpu_ids: list[int], host_ids: list[int], to_host: bool) -> int:
        assert len(gpu_ids) == len(host_ids)
        ticket = next(self._tickets)
        start = time.monotonic()
        s = self.streams
        after_compute = s.event()
        s.record(after_compute, s.compute)
        with s.on(self.stream):
            s.wait(self.stream, after_compute)
            try:
                for first, last in _runs(host_ids, self.blocks_per_chunk):
                    index = torch.tensor(gpu_ids[first:last], dtype=torch.int64).to(self.gpu.device, non_blocking=True)
                    host = self.host[host_ids[first] : host_ids[first] + last - first]
                    if to_host:  # gather [layers, k, ...] on the device, then one copy of the run
                        host.copy_(self.gpu.index_select(1, index).transpose(0, 1), non_blocking=True)
                    else:
                        staged = host.to(self.gpu.device, non_blocking=True)
                        self.gpu.index_copy_(1, index, staged.transpose(0, 1))
            finally:  # a copy that raised part way still has its first pieces queued: waited for like the rest
                if self.stream is not None:
                    self._forget_done()
                    done = torch.cuda.Event()
                    done.record(self.stream)
                    self._events[ticket] = (done, start, not to_host)
                    (self._last_write if to_host else self._last_read).update(dict.fromkeys(host_ids, ticket))
            if self.stream is not None:
                return ticket
        if not to_host:
            self._restore_seconds.append(time.monotonic() - start)
        return ticket

    # ---- completion -----------------------------------------------------------------------------
    def is_done(self, ticket: int, block: bool = False) -> bool:
        """Whether the copy has completed (with `block`, wait for it first)."""
        entry = self._events.get(ticket)
        if entry is None:
            return True
        event, start, restore = entry
        if block:
            event.synchronize()
        elif not event.query():
            return False
        del self._events[ticket]
        if restore:
            self._restore_seconds.append(time.monotonic() - start)
        return True

    def wait_for(self, host_ids: list[int], host_writes: bool) -> None:
        """Before the host itself reads these host blocks (or writes them, `host_writes`): wait for the copies
        issued so far that write them (or also those that read them). The copy stream runs its copies in
        order, so the last one of each kind for each block is enough."""
        last = [self._last_write, self._last_read] if host_writes else [self._last_write]
        tickets = {t for table in last for t in map(table.get, host_ids) if t is not None}
        for ticket in sorted(tickets):
            self.is_done(ticket, block=True)

    def _forget_done(self) -> None:
        """Drop the finished offloads' events (restores' go when `is_done` sees them finished), and the
        per-block tickets of copies no longer in flight; every 256 copies in flight."""
        if len(self._events) < 256 or len(self._events) % 256:
            return
        self._events = {t: e for t, e in self._events.items() if e[2] or not e[0].query()}
        for table in (self._last_write, self._last_read):
            for block in [b for b, t in table.items() if t not in self._events]:
                del table[block]

    def fence_compute(self, tickets: set[int]) -> None:
        """Make the compute stream wait for these copies (a step is about to overwrite their GPU blocks)."""
        for ticket in tickets:
            entry = self._events.get(ticket)
            if entry is not None and not entry[0].query():
                self.streams.wait(self.streams.compute, entry[0])

    def drain_latencies(self) -> list[float]:
        """Restore latencies completed since the last call."""
        out, self._restore_seconds = self._restore_seconds, []
        return out


def _runs(host_ids: list[int], limit: int) -> list[tuple[int, int]]:
    """[first, last) index ranges of host_ids whose ids are consecutive, each at most `limit` long."""
    runs = []
    first = 0
    for i in range(1, len(host_ids) + 1):
        if i == len(host_ids) or host_ids[i] != host_ids[i - 1] + 1 or i - first >= limit:
            runs.append((first, i))
            first = i
    return runs
