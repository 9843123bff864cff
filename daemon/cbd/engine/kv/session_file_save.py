"""Saving a session to its file (the format: session_files.py).

Saving a session that changed since its file was written appends: the KV that the file does not hold
yet is written after the last extent and fsynced, then the new header goes to the other slot and is
fsynced. Until that slot is whole, the older one is the header, so a reader sees the session as it was
saved last or as it is now, never a mix; a torn slot fails its CRC. A branch's new header names the
extents it still shares with the file (its tokens there unchanged: whole blocks, or a whole branch
that did not change) and the ones just written (whole blocks, then its last partial block apart, so
the next save can keep the whole blocks). A file that has no room in its slots for the header, or
whose dead extents pass both DEAD_FLOOR and its live ones, or is of the older format, is written anew
instead (each kept extent once, though branches share it): a temporary file, fsynced and renamed over the
old one (then the directory is fsynced), the extents it keeps copied in the kernel.

A save that is not `durable` (a spill: the host tier's overflow, kept for capacity, not for a crash) skips the
fsyncs where no earlier save is at stake: an append (a crash keeps the older header slot, or a new one whose
new extents fail their checksums: recomputed), or a file that did not exist. An append after such a save writes
the slot that save wrote (`same_slot`), so the last fsynced header is never overwritten before a durable
save replaces it. The kernel writes it back when it will, and reads meanwhile come from the page cache; the
next durable save's fsync covers it all.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from cbd.engine.kv.session_files import (
    MAGIC,
    PREFIX,
    SLOT,
    XXH3,
    DamagedFile,
    Extent,
    KvBytes,
    Layout,
    SavedBranch,
    SavedSession,
    checksum,
    encoder,
    read_header,
    slot_crc,
    sync_directory,
)  # fmt: skip

MIN_SLOT = 4096  # a header slot's size, at least
DEAD_FLOOR = 64 * 2**20  # a file is written anew only once its dead extents pass this many bytes (and its live ones)


def save(
    path: Path, saved: SavedSession, kv: list[KvBytes | None], compact: bool = False, durable: bool = True,
    same_slot: bool = False,
) -> tuple[SavedSession, int]:  # fmt: skip
    """Save a session: `kv[i]` is branch i's KV (None: token ids only, its `kv_tokens` 0), appended to the
    file at `path` if it can be (see above), else written anew (`compact`: whenever the file has dead
    extents); `durable`: fsynced; `same_slot`: an append writes the header slot in use (the last save was not
    durable; see above). A branch whose kept extents the file does not hold as asked,
    or whose extents do not cover its `kv_tokens`, is saved with token ids only. Returns the header as
    written and the bytes written. Raises OSError (the file as it was, nothing left behind; but for a
    failed fsync of the new header)."""
    try:
        current, layout = read_header(path)
    except (OSError, DamagedFile):
        current, layout = None, None
    kept: list[list[Extent]] = []
    for branch, new in zip(saved.branches, kv, strict=True):
        extents = _kept(current, saved, branch, new)
        covered = new is None or new.keep + sum(t for _, t in new.extents) == branch.kv_tokens
        if extents is None or not covered:  # the file lacks what it was to keep: token ids only
            assert new is not None
            branch.kv_tokens, new.keep, new.extents, extents = 0, 0, [], []
        kept.append(extents)
    fresh = sum(memoryview(data).nbytes for new in kv if new is not None for data, _ in new.extents)
    if current is not None and layout is not None and layout.version == 2:
        size = path.stat().st_size
        _place(saved, kept, kv, size)
        header = encoder.encode(saved)
        live = sum(e.length for e in _unique(kept))
        dead = size - PREFIX.size - 2 * layout.slot_size - live  # extents no header will name again
        small = dead <= (0 if compact else DEAD_FLOOR) or (not compact and dead <= live + fresh)
        if len(header) + SLOT.size <= layout.slot_size and small:
            _append(path, header, kv, layout, size, durable, same_slot)
            return saved, fresh + SLOT.size + len(header)
    return _rewrite(path, saved, kept, kv, durable or path.exists())


def _unique(kept: list[list[Extent]]) -> list[Extent]:
    """The extents kept, each once (branches share their common prefix's), in file order."""
    return sorted({e.offset: e for extents in kept for e in extents}.values(), key=lambda e: e.offset)


def _kept(
    current: SavedSession | None, saved: SavedSession, branch: SavedBranch, new: KvBytes | None
) -> list[Extent] | None:  # fmt: skip
    """The extents of the file's branch `new.base` covering its first `new.keep` tokens, if the file holds
    them with the same tokens; None if not."""
    if new is None or not new.keep:
        return []
    if current is None or new.base is None or new.base >= len(current.branches):
        return None
    if current.fingerprint != saved.fingerprint:  # another model's or KV layout's: nothing to keep
        return None
    base = current.branches[new.base]
    if new.keep > base.kv_tokens or base.token_ids[: new.keep] != branch.token_ids[: new.keep]:
        return None
    extents, covered = [], 0
    for extent in base.extents:
        if covered >= new.keep:
            break
        extents.append(extent)
        covered += extent.num_tokens
    return extents if covered == new.keep else None


def _place(saved: SavedSession, kept: list[list[Extent]], kv: list[KvBytes | None], at: int) -> None:
    """Fill in every branch's extents: the kept ones, then the new ones laid out from offset `at` on."""
    for branch, extents, new in zip(saved.branches, kept, kv, strict=True):
        branch.extents = list(extents)
        for data, tokens in new.extents if new is not None else ():
            view = memoryview(data)
            branch.extents.append(Extent(at, view.nbytes, checksum(view), tokens, XXH3))
            at += view.nbytes


def _slot(generation: int, header: bytes) -> bytes:
    return SLOT.pack(generation, len(header), slot_crc(generation, header)) + header


def _append(
    path: Path, header: bytes, kv: list[KvBytes | None], layout: Layout, size: int, durable: bool, same_slot: bool
) -> None:  # fmt: skip
    """The new extents after the file's end (fsynced), then the header in the other slot (fsynced): the
    fsyncs only if `durable`; the slot in use if `same_slot`."""
    with open(path, "r+b", buffering=0) as f:
        try:
            f.seek(size)
            for new in kv:
                for data, _ in new.extents if new is not None else ():
                    _write_all(f, data)
            if durable:
                os.fsync(f.fileno())
        except BaseException:
            with contextlib.suppress(OSError):
                f.truncate(size)
            raise
        f.seek(PREFIX.size + (layout.slot if same_slot else 1 - layout.slot) * layout.slot_size)
        _write_all(f, _slot(layout.generation + 1, header))
        if durable:
            os.fsync(f.fileno())


def _write_all(f, data: bytes | memoryview) -> None:  # noqa: ANN001
    """All of `data` to an unbuffered file (one write may take less)."""
    view = memoryview(data).cast("B")
    while view:
        view = view[f.write(view) :]


def _rewrite(
    path: Path,
    saved: SavedSession,
    kept: list[list[Extent]],
    kv: list[KvBytes | None],
    durable: bool = True,
) -> tuple[SavedSession, int]:
    """Write the file anew (see above): slots twice the header's size, the kept extents copied from the old
    file, then the new ones; fsynced (the file, then its directory) if `durable`. Returns the header and the
    file's size."""
    slot_size = MIN_SLOT
    while True:
        at = PREFIX.size + 2 * slot_size
        new_place: dict[int, Extent] = {}  # old offset -> the kept extent, once, after the slots in file order
        for e in _unique(kept):
            new_place[e.offset] = Extent(at, e.length, e.checksum, e.num_tokens, e.kind)
            at += e.length
        _place(saved, [[new_place[e.offset] for e in extents] for extents in kept], kv, at)
        header = encoder.encode(saved)
        want = max(MIN_SLOT, -(-(2 * len(header) + SLOT.size) // 4096) * 4096)
        if slot_size >= want or (slot_size > MIN_SLOT and slot_size >= len(header) + SLOT.size):
            break
        slot_size = want
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(PREFIX.pack(MAGIC, slot_size, 0))
            f.write(_slot(1, header).ljust(2 * slot_size, b"\0"))
            if any(kept):
                with open(path, "rb") as old:
                    for e in _unique(kept):
                        _copy(old.fileno(), e.offset, e.length, f)
            for new in kv:
                for data, _ in new.extents if new is not None else ():
                    f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
            size = f.tell()
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if durable:
        sync_directory(path.parent)
    return saved, size


def _copy(source: int, offset: int, length: int, f) -> None:  # noqa: ANN001
    """Append `length` bytes of the file `source` from `offset` to `f`, in the kernel where it can."""
    f.flush()
    done = 0
    in_kernel = getattr(os, "copy_file_range", None)  # Linux
    with contextlib.suppress(OSError):
        while in_kernel is not None and done < length:
            n = in_kernel(source, f.fileno(), length - done, offset + done)
            if not n:
                break
            done += n
    f.seek(0, os.SEEK_END)
    while done < length:  # not supported here, or cut short: by hand
        chunk = os.pread(source, min(length - done, 64 * 2**20), offset + done)
        if not chunk:
            raise OSError(f"{length - done} bytes of an extent to keep are missing")
        f.write(chunk)
        done += len(chunk)
