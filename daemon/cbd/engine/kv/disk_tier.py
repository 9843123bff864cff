"""DiskTier: session files in a directory daemons share, each file owned by one daemon, written off the
engine thread.

The engine thread takes a snapshot of what a session holds (its token ids, settings, and the KV its
file lacks: gathered from the host pool into host tensors, or named as GPU pool blocks, `PoolBlocks`,
which the caller keeps referenced until the write is done) and hands it to the tier's writer thread,
which gathers the GPU blocks (on a stream of its own, after the compute stream's work so far, a chunk
at a time: the engine thread and the steps go on meanwhile), saves the session to its file
(kv/session_file_save.py: appended) and keeps the
directory under its cap (`--disk-kv-gib`: a save that would go over it adds no KV). Removals go through
the same thread, so a session closed after a save never comes back from a late write. Reading back
goes through the tier's reader thread: the engine thread takes fresh host blocks (`start_load`), the
reader thread reads the branch's KV extents straight into them and checks it, and the engine thread
hands them on (`finish_load`), from where the scheduler restores them like any host copy
(kv/host_tier.py); a damaged extent, no host tier or no room in it: the branch is recomputed.

Ownership. A daemon keeps its files in a folder of its own, named by its owner name (`--disk-kv-owner`,
by default from its listen addresses, so the same daemon restarted finds its folder again), and holds
an exclusive lock on `<owner>.lock` beside it for its life (the lock goes with the process, however it
ends). At start it lists its own folder. A daemon asked about a session it does not hold looks for
the session's file in the other owners' folders (`claim`): only where that owner's lock is free (the
daemon stopped or died) does it take the lock for the moment of the move, rename the file into its own
folder (atomic: two claimers cannot both get it) and let the lock go. So a session is held by one
daemon at a time, and a session of a drained replica moves to whichever replica its next call reaches.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cbd.config import EngineConfig
from cbd.engine.kv import session_file_save
from cbd.engine.kv import session_files as files
from cbd.engine.kv.host_pool import HostCopy
from cbd.engine.kv.host_tier import HostTier
from cbd.engine.kv.owner_lock import LOCK_WAIT, hold
from cbd.engine.kv.session_files import DiskCopy
from cbd.engine.outputs import DiskTierStats
from cbd.errors import SettingError
from cbd.model.loader import LoadedModel

log = logging.getLogger(__name__)
READ_RATE_GUESS = 1 << 30  # bytes per second, before reads have measured the folder's disk
READ_RATE_AFTER = 64 << 20
GATHER_CHUNK_BYTES = 256 << 20  # GPU memory the writer thread's gather of a save's blocks takes at a time


@dataclass(slots=True)
class PoolBlocks:
    """KV blocks of the GPU pool a save names for the writer thread to gather (the caller holds a reference on
    each until the write is done, so no step writes them meanwhile)."""

    block_ids: list[int]


Planned = files.NewKv[bytes | memoryview | PoolBlocks]  # a branch's KV as the engine thread hands it over


@dataclass(slots=True)
class Load:
    """A branch's KV being read into host blocks: `host` is held by the load until it is finished."""

    copy: DiskCopy
    host: HostCopy
    future: Future[bool]


@dataclass(slots=True)
class Written:
    """A session file written: whether it holds all the KV it was given (not: over the cap, or a branch's
    kept extents were not in the file), and its header as written."""

    kept_kv: bool
    path: Path
    saved: files.SavedSession

    @property
    def has_kv(self) -> bool:
        return any(b.kv_tokens for b in self.saved.branches)

    def copies(self) -> list[DiskCopy | None]:
        """Each branch's KV in the file (None: a branch without)."""
        return [DiskCopy(self.path, b) if b.kv_tokens else None for b in self.saved.branches]


LAST_SAVE_FILE = "last-save-seconds"  # in the owner's folder: how long the last shutdown's saving took


class DiskTier:
    def __init__(
        self, root: Path, owner: str, cap_bytes: int, fingerprint: files.Fingerprint, kv_caches: torch.Tensor,
        block_size: int, host_tier: HostTier | None,
    ) -> None:  # fmt: skip
        self.root, self.owner = root, owner
        self.directory = root / owner  # this daemon's files
        self.cap_bytes = cap_bytes
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.host_tier = host_tier
        # KV is saved and read back through the host tier; without one (tensor parallelism: each rank holds
        # a shard) files hold token ids only.
        self.keeps_kv = host_tier is not None
        lock = hold(root, owner, LOCK_WAIT)
        if lock is None:
            raise SettingError(
                f"disk_kv_dir {str(root)!r}: another cbd daemon holds the owner name {owner!r}; give each daemon "
                "its own (--disk-kv-owner)"
            )
        self._lock = lock
        layers, slots, *slot_shape = kv_caches.shape
        self._gpu = kv_caches.view(layers, slots // block_size, block_size, *slot_shape)  # [layers, blocks, bs, *slot]
        streams = host_tier.copier.streams if host_tier is not None else None
        self._compute = streams.compute if streams is not None and streams.cuda else None
        self._gather_stream = torch.cuda.Stream(kv_caches.device) if self._compute is not None else None
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="cbd-disk")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="cbd-disk-read")
        self._count = threading.Lock()  # the stats, written by the writer thread
        self._stats = DiskTierStats(cap_bytes=cap_bytes)
        self._stats.last_checkpoint_seconds = self._read_last_save()  # the last shutdown's, if this folder's
        self._sizes: dict[str, int] = {}  # file name -> bytes, the writer thread's view of the directory
        self._new_entries: set[str] = set()  # files a save without fsyncs made (the writer thread's)
        self._unsynced: set[str] = set()  # files whose header in use a save without fsyncs wrote (likewise)
        left = files.remove_temporaries(self.directory)
        if left:
            log.info("removed %d unfinished session files from %s", left, self.directory)
        for path in self.directory.glob(f"*{files.SUFFIX}"):
            self._sizes[path.name] = path.stat().st_size

    @classmethod
    def from_config(
        cls, config: EngineConfig, loaded: LoadedModel, kv_caches: torch.Tensor, host_tier: HostTier | None
    ) -> DiskTier | None:
        directory = config.session_dir()
        if directory is None:
            return None
        return cls(
            Path(directory).expanduser(), config.disk_kv_owner or "engine", int(config.disk_kv_gib * 2**30), fingerprint(loaded, config, kv_caches),
            kv_caches, config.block_size, host_tier,
        )  # fmt: skip

    # ---- writing (the engine thread snapshots, the writer thread writes) ---------------------------
    @property
    def spills_from_gpu(self) -> bool:
        """Whether a spill may gather KV from the GPU pool: only where that pool is in host memory. On a GPU
        the gather waits for the step in flight and copies on the engine thread (measured ~0.5 s a GiB at the
        8B shape, the batch stalled meanwhile), where a recompute costs the GPU less."""
        return not self._gpu.is_cuda

    def gather_gpu(self, block_ids: list[int]) -> torch.Tensor:
        """The KV of GPU blocks as a host tensor `[blocks, layers, block_size, *slot]` (the writer thread's, for
        `PoolBlocks`). Blocks a session holds are not written by any step (its KV is complete and shared
        blocks are immutable); on a GPU the gather's stream waits for the compute stream's work so far all the
        same, and it blocks this thread only."""
        layers, _, *block_shape = self._gpu.shape
        out = torch.empty((len(block_ids), layers, *block_shape), dtype=self._gpu.dtype)
        per_chunk = max(1, GATHER_CHUNK_BYTES // max(1, self.bytes_per_block))
        index = torch.tensor(block_ids, dtype=torch.int64, device=self._gpu.device)
        if self._gather_stream is not None and self._compute is not None:
            self._gather_stream.wait_stream(self._compute)
        with torch.cuda.stream(self._gather_stream) if self._gather_stream is not None else contextlib.nullcontext():
            for at in range(0, len(block_ids), per_chunk):
                part = self._gpu.index_select(1, index[at : at + per_chunk]).to("cpu")  # waits for its stream
                out[at : at + per_chunk] = part.transpose(0, 1)
        return out

    def gather_host(self, copy: HostCopy) -> torch.Tensor:
        assert self.host_tier is not None  # only a host tier makes host copies
        return self.host_tier.read_blocks(copy.block_ids)

    def write(self, saved: files.SavedSession, kv: list[Planned | None], durable: bool = True) -> Future[Written]:
        """Save a session to its file on the writer thread (kv/session_file_save.py `save`: what the file holds
        already is kept, the rest appended; fsynced if `durable`); the future says whether all its KV was kept
        (not: token ids only, for the cap). A write that fails (disk full) leaves the file as it was and
        raises."""
        return self._writer.submit(self._write, saved, kv, durable)

    def remove(self, key: str) -> Future[None]:
        """Delete a session's file (after any write queued before)."""
        return self._writer.submit(self._remove, files.file_name(key))

    def flush(self, timeout: float | None) -> bool:
        """Wait for every write queued so far; False if `timeout` passed first."""
        try:
            self._writer.submit(lambda: None).result(timeout)
            return True
        except TimeoutError:
            return False

    def close(self) -> None:
        self._reader.shutdown(wait=True)
        self._writer.shutdown(wait=True)
        self._lock.close()

    def _gathered(self, planned: Planned) -> files.KvBytes:
        """A branch's KV with the GPU blocks it names gathered (the writer thread's)."""
        extents = [
            (raw_bytes(self.gather_gpu(d.block_ids)) if isinstance(d, PoolBlocks) else d, n) for d, n in planned.extents
        ]
        return files.KvBytes(planned.base, planned.keep, extents)

    def _write(self, saved: files.SavedSession, planned: list[Planned | None], durable: bool) -> Written:
        kv = [None if p is None else self._gathered(p) for p in planned]
        name = files.file_name(saved.key)
        asked = [b.kv_tokens for b in saved.branches]
        need = sum(memoryview(data).nbytes for new in kv if new is not None for data, _ in new.extents)
        over = bool(need) and sum(self._sizes.values()) + need > self.cap_bytes
        if over:  # nothing new: what the file holds already stays, its dead extents go
            for b, new in zip(saved.branches, kv, strict=True):
                if new is not None:
                    b.kv_tokens, new.extents = new.keep, []
        start = time.monotonic()
        path = self.directory / name
        created = not path.exists()
        try:
            same_slot = not durable and name in self._unsynced  # keep the last fsynced header's slot
            saved, size = session_file_save.save(path, saved, kv, compact=over, durable=durable, same_slot=same_slot)
            if durable and name in self._new_entries:  # made by a save without fsyncs: its name too, now
                files.sync_directory(self.directory)
        except OSError:
            with self._count:
                self._stats.num_write_errors += 1
            raise
        if durable:
            self._new_entries.discard(name)
            self._unsynced.discard(name)
        else:
            self._unsynced.add(name)
            if created:
                self._new_entries.add(name)
        self._sizes[name] = path.stat().st_size
        with self._count:
            s = self._stats
            s.num_files_written += 1
            s.num_kv_files_written += any(b.kv_tokens for b in saved.branches)
            s.bytes_written += size
            s.write_seconds_sum += time.monotonic() - start
        return Written([b.kv_tokens for b in saved.branches] == asked, path, saved)

    def _remove(self, name: str) -> None:
        self._sizes.pop(name, None)
        self._new_entries.discard(name)
        self._unsynced.discard(name)
        with contextlib.suppress(FileNotFoundError):
            (self.directory / name).unlink()

    # ---- reading (the engine thread) ---------------------------------------------------------------
    def saved_sessions(self) -> list[tuple[Path, files.SavedSession]]:
        """Every session file of the same model: (path, header). Files that cannot be used at all are
        logged in one line each and removed."""
        found = []
        for path in sorted(self.directory.glob(f"*{files.SUFFIX}")):
            usable = self._usable(path)
            if usable is not None:
                found.append((path, usable))
        return found

    def claim(self, key: str) -> tuple[Path, files.SavedSession] | None:
        """Take over the file of a session this daemon does not hold from an owner that has stopped (see
        above); None if no stopped owner has it (or it cannot be used)."""
        name = files.file_name(key)
        for folder in sorted(p for p in self.root.iterdir() if p.is_dir() and p.name != self.owner):
            if not (folder / name).exists():
                continue
            lock = hold(self.root, folder.name, 0.0)
            if lock is None:  # its owner serves it: not ours to take
                continue
            try:
                (folder / name).rename(self.directory / name)
            except FileNotFoundError:  # another daemon took it first
                continue
            finally:
                lock.close()
            files.sync_directory(folder)
            files.sync_directory(self.directory)
            path = self.directory / name
            log.info("session %s taken over from owner %s", key, folder.name)
            self._writer.submit(self._sizes.__setitem__, name, path.stat().st_size).result()
            usable = self._usable(path)
            return (path, usable) if usable is not None and usable.key == key else None
        return None

    def _usable(self, path: Path) -> files.SavedSession | None:
        """A file's header if this model can use it; else it is logged, removed, counted. A branch whose
        extents do not hold its KV tokens' whole blocks is given token ids only."""
        try:
            saved, _ = files.read_header(path)
        except (files.DamagedFile, OSError) as exc:
            log.warning("session file %s is not used: %s", path.name, exc)
            self._writer.submit(self._remove, path.name)
            self._count_lost()
            return None
        if saved.fingerprint.model != self.fingerprint.model:
            log.warning("session file %s is not used: it was saved by another model", path.name)
            self._writer.submit(self._remove, path.name)
            self._count_lost()
            return None
        if saved.fingerprint.kv != self.fingerprint.kv:
            log.warning("session %s: its saved KV has another layout; its tokens are recomputed", saved.key)
            for b in saved.branches:
                b.kv_tokens, b.extents = 0, []
        for b in saved.branches:
            if not self._lines_up(b):
                log.warning("session %s: its saved KV does not line up with its tokens; they are recomputed", saved.key)
                b.kv_tokens, b.extents = 0, []
        return saved

    def _lines_up(self, b: files.SavedBranch) -> bool:
        """A branch's extents hold its first kv_tokens tokens' blocks: whole ones but for the last, each the
        bytes of the blocks it covers."""
        size, covered = self.block_size, 0
        for i, e in enumerate(b.extents):
            last = i == len(b.extents) - 1
            if e.num_tokens <= 0 or (not last and (covered + e.num_tokens) % size) or covered % size:
                return False
            if e.length != (-(-(covered + e.num_tokens) // size) - covered // size) * self.bytes_per_block:
                return False
            covered += e.num_tokens
        return covered == b.kv_tokens <= len(b.token_ids)

    def start_load(self, copy: DiskCopy, on_done: Callable[[], object] | None = None) -> Load | None:
        """Start reading a branch's KV into fresh host blocks on the reader thread (`on_done` is called
        there when it ends); None without a host tier or room in it (the branch is recomputed)."""
        if self.host_tier is None:
            return None
        host = self.host_tier.take_blocks(-(-copy.num_tokens // self.block_size), copy.num_tokens)
        if host is None:
            return None
        future = self._reader.submit(self._read, copy, self.host_tier.block_buffers(host))
        if on_done is not None:
            future.add_done_callback(lambda _: on_done())
        return Load(copy, host, future)

    def finish_load(self, load: Load) -> HostCopy | None:
        """A finished load's host copy (the caller holds it now), or None (damaged: its blocks released)."""
        assert self.host_tier is not None and load.future.done()
        if load.future.result():
            return load.host
        self.host_tier.release(load.host)
        return None

    def _read(self, copy: DiskCopy, buffers: list[memoryview]) -> bool:
        start = time.monotonic()
        try:  # straight into the host blocks, extent by extent, each checked
            ok = files.read_kv_into(copy.path, copy.branch, buffers)
        except OSError as exc:
            log.warning("session file %s: its KV cannot be read (%s); it is recomputed", copy.path.name, exc)
            ok = False
        else:
            if not ok:
                log.warning(
                    "session file %s: its KV is damaged (cut short, or its checksum fails); it is recomputed",
                    copy.path.name,
                )
        self._count_load(sum(e.length for e in copy.branch.extents) if ok else 0, start, failed=not ok)
        return ok

    def stats(self) -> DiskTierStats:
        with self._count:
            s = self._stats
            s.num_files, s.bytes_on_disk = len(self._sizes), sum(self._sizes.values())
            return DiskTierStats(**{f: getattr(s, f) for f in DiskTierStats.__dataclass_fields__})

    def count_restored(self, num_sessions: int, num_lost: int) -> None:
        with self._count:
            self._stats.num_sessions_restored += num_sessions
            self._stats.num_sessions_lost += num_lost

    @property
    def bytes_per_block(self) -> int:
        return self._gpu[:, 0].numel() * self._gpu.element_size()

    def count_spill(self) -> None:
        with self._count:
            self._stats.num_spilled += 1

    def count_checkpoint(self, seconds: float) -> None:
        """A shutdown's saving took `seconds`: counted, and kept in the folder, so that the daemon started next
        on it reports the last shutdown's saving too."""
        with self._count:
            self._stats.num_checkpoints += 1
            self._stats.last_checkpoint_seconds = seconds
        try:
            temporary = self.directory / f"{LAST_SAVE_FILE}.tmp"
            temporary.write_text(f"{seconds:.6f}\n")
            temporary.replace(self.directory / LAST_SAVE_FILE)
        except OSError as exc:
            log.warning("the saving time could not be kept in %s: %s", self.directory, exc.strerror or exc)

    def _read_last_save(self) -> float:
        try:
            return max(0.0, float((self.directory / LAST_SAVE_FILE).read_text()))
        except (OSError, ValueError):
            return 0.0

    def _count_lost(self) -> None:
        with self._count:
            self._stats.num_sessions_lost += 1

    def read_seconds(self, size: int) -> float:
        """How long reading `size` bytes of KV is expected to take: at the rate reads have had so far (at
        READ_RATE_GUESS until READ_RATE_AFTER bytes were read)."""
        with self._count:
            s = self._stats
            rate = s.bytes_read / s.load_seconds_sum if s.bytes_read >= READ_RATE_AFTER and s.load_seconds_sum else 0.0
        return size / (rate or READ_RATE_GUESS)

    def _count_load(self, size: int, start: float, failed: bool) -> None:
        with self._count:
            s = self._stats
            s.num_kv_loads += not failed
            s.num_kv_load_failures += failed
            s.bytes_read += size
            s.load_seconds_sum += time.monotonic() - start


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    """A host tensor's raw bytes, no copy."""
    return tensor.view(torch.uint8).reshape(-1).numpy().data


def fingerprint(loaded: LoadedModel, config: EngineConfig, kv_caches: torch.Tensor) -> files.Fingerprint:
    """What a saved session's tokens and KV depend on (see session_files.Fingerprint)."""
    weights = sorted(
        (p.name, p.stat().st_size, p.stat().st_mtime_ns)
        for p in loaded.checkpoint_dir.iterdir()
        if p.suffix in (".safetensors", ".bin", ".gguf")
    )  # fmt: skip
    spec: dict[str, Any] = {f: getattr(loaded.spec, f) for f in loaded.spec.__dataclass_fields__}
    model = {"name": loaded.name, "dir": str(loaded.checkpoint_dir.resolve()), "weights": weights, "spec": spec}
    kv = {"dtype": str(kv_caches.dtype), "format": config.kv_cache_dtype, "block_size": config.block_size,
          "tp": config.tensor_parallel_size, "shape": list(kv_caches.shape[2:]), "layers": kv_caches.shape[0]}  # fmt: skip
    return files.Fingerprint(_digest(model), _digest(kv))


def _digest(value: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()
