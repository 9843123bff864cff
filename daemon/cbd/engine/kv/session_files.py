"""Session files: one file per saved session, grown by appending, read back only where whole.

    magic (8 bytes) | slot size (u32) | 0 (u32)
    slot 0: generation (u64) | header length (u32) | CRC-32 of generation + header (u32) | header
    slot 1: the same                                  (each slot `slot size` bytes)
    KV extents, from 16 + 2 x slot size on, in the order they were written

The header is a `SavedSession`: the session's key, settings, the frontend's note (its transcript), and
every branch's token ids with the extents that hold its KV, in order. An extent is a run of the
branch's blocks in the host-pool layout `[blocks, layers, block_size, *slot]` as raw bytes, with its
length, CRC-32 and the tokens it covers. The valid slot with the higher generation is the file's
header; the other is the one before.

Saving a session that changed since its file was written appends: the KV that the file does not hold
yet is written after the last extent and fsynced, then the new header goes to the other slot and is
fsynced. Until that slot is whole, the older one is the header, so a reader sees the session as it was
saved last or as it is now, never a mix; a torn slot fails its CRC. A branch's new header names the
extents it still shares with the file (its tokens there unchanged: whole blocks, or a whole branch
that did not change) and the ones just written (whole blocks, then its last partial block apart, so
the next save can keep the whole blocks). A file that has no room in its slots for the header, or
whose dead extents pass both DEAD_FLOOR and its live ones, or is of the older format, is written anew
instead (each kept extent once, though branches share it): a
temporary file, fsynced and renamed over the old one (then the directory is fsynced), the extents it
keeps copied in the kernel.

The file's `Fingerprint` says which model the tokens belong to and which KV layout the extents have:
a file whose header is damaged (both slots) is not used at all; one whose model differs is not used at
all (its token ids would mean other tokens); one whose KV layout differs, or whose extent is short or
fails its checksum, gives its token ids only (the next turn recomputes them). The first format
(`CBDSESS1`: one header, then one segment per branch) is still read. No torch here: extents are bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import msgspec

MAGIC = b"CBDSESS2"
MAGIC_V1 = b"CBDSESS1"
_PREFIX = struct.Struct("<8sII")  # magic, slot size, 0
_SLOT = struct.Struct("<QII")  # generation, header length, CRC-32 of generation + header
_PREFIX_V1 = struct.Struct("<8sII")  # magic, header length, header CRC-32
SUFFIX = ".session"
MIN_SLOT = 4096
DEAD_FLOOR = 64 * 2**20  # a file is written anew only once its dead extents pass this many bytes (and its live ones)


class Fingerprint(msgspec.Struct, frozen=True, array_like=True):
    """`model`: what the token ids mean and what computed the KV (name, weights' identity, architecture);
    `kv`: the KV extents' layout (dtype, KV format, block size, tensor-parallel size, slot shape)."""

    model: str
    kv: str


class Extent(msgspec.Struct, frozen=True, array_like=True):
    offset: int  # from the start of the file
    length: int
    crc: int
    num_tokens: int  # the tokens whose KV it holds


class SavedBranch(msgspec.Struct, array_like=True):
    token_ids: list[int]
    kv_tokens: int  # its extents hold the KV of token_ids[:kv_tokens] (0: none)
    extents: list[Extent] = []


class SavedSession(msgspec.Struct, array_like=True):
    fingerprint: Fingerprint
    key: str  # the engine's session key (tenant/id)
    ttl: float | None
    idle_seconds: float  # idle at `saved_at`
    saved_at: float  # time.time()
    is_chat: bool
    expected_idle: float | None
    retention: int
    priority: int
    note: bytes  # the frontend's (a chat's transcript); empty: none
    branches: list[SavedBranch]  # [the history, *pending candidates]


class _BranchV1(msgspec.Struct, array_like=True):
    token_ids: list[int]
    kv_tokens: int
    offset: int = 0  # from the end of the header
    length: int = 0
    crc: int = 0


class _SessionV1(msgspec.Struct, array_like=True):
    fingerprint: Fingerprint
    key: str
    ttl: float | None
    idle_seconds: float
    saved_at: float
    is_chat: bool
    expected_idle: float | None
    retention: int
    priority: int
    note: bytes
    branches: list[_BranchV1]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(SavedSession)
_decoder_v1 = msgspec.msgpack.Decoder(_SessionV1)


@dataclass(slots=True)
class DiskCopy:
    """A branch's KV in a session file (`branch.extents` of the file at `path`)."""

    path: Path
    branch: SavedBranch

    @property
    def num_tokens(self) -> int:
        return self.branch.kv_tokens


@dataclass(slots=True)
class Layout:
    """Where a file's header is: its slot size, the slot holding it and its generation (version 1: none)."""

    version: int
    slot_size: int = 0
    slot: int = 0
    generation: int = 0


@dataclass(slots=True)
class NewKv:
    """A branch's KV to save: the first `keep` tokens' extents of the file's branch `base` (its tokens there
    the same), then `extents`, new bytes in order, each with the tokens it covers."""

    base: int | None
    keep: int
    extents: list[tuple[bytes | memoryview, int]]


class DamagedFile(Exception):
    """A session file that cannot be used at all (its header is damaged, or it is not a session file)."""


def file_name(key: str) -> str:
    """A session key's file name (keys hold '/' and any character an id may have)."""
    return hashlib.sha256(key.encode()).hexdigest()[:40] + SUFFIX


def save(path: Path, saved: SavedSession, kv: list[NewKv | None], compact: bool = False) -> tuple[SavedSession, int]:
    """Save a session: `kv[i]` is branch i's KV (None: token ids only, its `kv_tokens` 0), appended to the
    file at `path` if it can be (see above), else written anew (`compact`: whenever the file has dead
    extents). A branch whose kept extents the file does not hold as asked, or whose extents do not cover
    its `kv_tokens`, is saved with token ids only. Returns the header as written and the bytes written.
    Raises OSError (the file as it was, nothing left behind; but for a failed fsync of the new header)."""
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
        header = _encoder.encode(saved)
        live = sum(e.length for e in _unique(kept))
        dead = size - _PREFIX.size - 2 * layout.slot_size - live  # extents no header will name again
        small = dead <= (0 if compact else DEAD_FLOOR) or (not compact and dead <= live + fresh)
        if len(header) + _SLOT.size <= layout.slot_size and small:
            _append(path, header, kv, layout, size)
            return saved, fresh + _SLOT.size + len(header)
    return _rewrite(path, saved, kept, kv)


def _unique(kept: list[list[Extent]]) -> list[Extent]:
    """The extents kept, each once (branches share their common prefix's), in file order."""
    return sorted({e.offset: e for extents in kept for e in extents}.values(), key=lambda e: e.offset)


def _kept(
    current: SavedSession | None, saved: SavedSession, branch: SavedBranch, new: NewKv | None
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


def _place(saved: SavedSession, kept: list[list[Extent]], kv: list[NewKv | None], at: int) -> None:
    """Fill in every branch's extents: the kept ones, then the new ones laid out from offset `at` on."""
    for branch, extents, new in zip(saved.branches, kept, kv, strict=True):
        branch.extents = list(extents)
        for data, tokens in new.extents if new is not None else ():
            view = memoryview(data)
            branch.extents.append(Extent(at, view.nbytes, zlib.crc32(view), tokens))
            at += view.nbytes


def _slot(generation: int, header: bytes) -> bytes:
    crc = zlib.crc32(header, zlib.crc32(struct.pack("<Q", generation)))
    return _SLOT.pack(generation, len(header), crc) + header


def _append(path: Path, header: bytes, kv: list[NewKv | None], layout: Layout, size: int) -> None:
    """The new extents after the file's end (fsynced), then the header in the other slot (fsynced)."""
    with open(path, "r+b", buffering=0) as f:
        try:
            f.seek(size)
            for new in kv:
                for data, _ in new.extents if new is not None else ():
                    _write_all(f, data)
            os.fsync(f.fileno())
        except BaseException:
            with contextlib.suppress(OSError):
                f.truncate(size)
            raise
        f.seek(_PREFIX.size + (1 - layout.slot) * layout.slot_size)
        _write_all(f, _slot(layout.generation + 1, header))
        os.fsync(f.fileno())


def _write_all(f, data: bytes | memoryview) -> None:  # noqa: ANN001
    """All of `data` to an unbuffered file (one write may take less)."""
    view = memoryview(data).cast("B")
    while view:
        view = view[f.write(view) :]


def _rewrite(
    path: Path, saved: SavedSession, kept: list[list[Extent]], kv: list[NewKv | None]
) -> tuple[SavedSession, int]:
    """Write the file anew (see above): slots twice the header's size, the kept extents copied from the old
    file, then the new ones. Returns the header and the file's size."""
    slot_size = MIN_SLOT
    while True:
        at = _PREFIX.size + 2 * slot_size
        new_place: dict[int, Extent] = {}  # old offset -> the kept extent, once, after the slots in file order
        for e in _unique(kept):
            new_place[e.offset] = Extent(at, e.length, e.crc, e.num_tokens)
            at += e.length
        _place(saved, [[new_place[e.offset] for e in extents] for extents in kept], kv, at)
        header = _encoder.encode(saved)
        want = max(MIN_SLOT, -(-(2 * len(header) + _SLOT.size) // 4096) * 4096)
        if slot_size >= want or (slot_size > MIN_SLOT and slot_size >= len(header) + _SLOT.size):
            break
        slot_size = want
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(_PREFIX.pack(MAGIC, slot_size, 0))
            f.write(_slot(1, header).ljust(2 * slot_size, b"\0"))
            if any(kept):
                with open(path, "rb") as old:
                    for e in _unique(kept):
                        _copy(old.fileno(), e.offset, e.length, f)
            for new in kv:
                for data, _ in new.extents if new is not None else ():
                    f.write(data)
            f.flush()
            os.fsync(f.fileno())
            size = f.tell()
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
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


def read_header(path: Path) -> tuple[SavedSession, Layout]:
    """A file's header (the newer whole slot) and where it is. Raises DamagedFile or OSError."""
    with open(path, "rb") as f:
        prefix = f.read(_PREFIX.size)
        if len(prefix) < _PREFIX.size:
            raise DamagedFile("shorter than its header")
        magic, slot_size, _ = _PREFIX.unpack(prefix)
        if magic == MAGIC_V1:
            return _read_v1(f, prefix), Layout(1)
        if magic != MAGIC:
            raise DamagedFile("not a cbd session file")
        best: tuple[int, int, bytes] | None = None
        for slot in (0, 1):
            f.seek(_PREFIX.size + slot * slot_size)
            head = f.read(_SLOT.size)
            if len(head) < _SLOT.size:
                continue
            generation, length, crc = _SLOT.unpack(head)
            if not generation or length > slot_size - _SLOT.size:
                continue
            header = f.read(length)
            if len(header) == length and zlib.crc32(header, zlib.crc32(head[:8])) == crc:
                if best is None or generation > best[0]:
                    best = (generation, slot, header)
    if best is None:
        raise DamagedFile("its header is damaged (checksum)")
    try:
        return _decoder.decode(best[2]), Layout(2, slot_size, best[1], best[0])
    except msgspec.DecodeError as exc:
        raise DamagedFile(f"its header does not decode ({exc})") from None


def _read_v1(f, prefix: bytes) -> SavedSession:  # noqa: ANN001
    _, length, crc = _PREFIX_V1.unpack(prefix)
    header = f.read(length)
    if len(header) < length or zlib.crc32(header) != crc:
        raise DamagedFile("its header is damaged (checksum)")
    try:
        old = _decoder_v1.decode(header)
    except msgspec.DecodeError as exc:
        raise DamagedFile(f"its header does not decode ({exc})") from None
    start = _PREFIX_V1.size + length
    branches = [
        SavedBranch(b.token_ids, b.kv_tokens, [Extent(start + b.offset, b.length, b.crc, b.kv_tokens)] if b.kv_tokens else [])
        for b in old.branches
    ]  # fmt: skip
    fields = {f: getattr(old, f) for f in _SessionV1.__struct_fields__ if f != "branches"}
    return SavedSession(**fields, branches=branches)


def read_kv(path: Path, branch: SavedBranch) -> bytearray | None:
    """A branch's KV, or None when an extent is short or fails its checksum (the caller recomputes)."""
    data = bytearray(sum(e.length for e in branch.extents))
    return data if read_kv_into(path, branch, [memoryview(data)]) else None


def read_kv_into(path: Path, branch: SavedBranch, buffers: list[memoryview]) -> bool:
    """Read a branch's KV straight into `buffers` (in order, their sizes adding up to its extents'); False
    when an extent is short or fails its checksum (the buffers then hold garbage)."""
    views = [b.cast("B") for b in buffers]
    if sum(len(v) for v in views) != sum(e.length for e in branch.extents):
        return False
    at = 0  # into views[i]
    i = 0
    with open(path, "rb", buffering=0) as f:
        for extent in branch.extents:
            f.seek(extent.offset)
            left, crc = extent.length, 0
            while left:
                if at == len(views[i]):
                    i, at = i + 1, 0
                view = views[i][at : at + left]
                done = 0
                while done < len(view):
                    n = f.readinto(view[done:])
                    if not n:
                        return False
                    done += n
                crc = zlib.crc32(view, crc)
                at += len(view)
                left -= len(view)
            if crc != extent.crc:
                return False
    return True


def sync_directory(directory: Path) -> None:
    """Make a rename or unlink in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_temporaries(directory: Path) -> int:
    """Delete temporary files a killed writer left behind; returns how many."""
    count = 0
    for tmp in directory.glob(f".*{SUFFIX}.*.tmp"):
        with contextlib.suppress(OSError):
            tmp.unlink()
            count += 1
    return count
