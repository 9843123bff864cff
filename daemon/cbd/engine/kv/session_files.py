"""Session files: one file per saved session, grown by appending, read back only where whole.

    magic (8 bytes) | slot size (u32) | 0 (u32)
    slot 0: generation (u64) | header length (u32) | CRC-32 of generation + header (u32) | header
    slot 1: the same                                  (each slot `slot size` bytes)
    KV extents, from 16 + 2 x slot size on, in the order they were written

The header is a `SavedSession`: the session's key, settings, the frontend's note (its transcript), and
every branch's token ids with the extents that hold its KV, in order. An extent is a run of the
branch's blocks in the host-pool layout `[blocks, layers, block_size, *slot]` as raw bytes, with its
length, checksum and the tokens it covers. An extent's checksum is XXH3-64 (`kind` XXH3: ~10x zlib's
CRC-32, which held a tier's reads and writes to the rate of a disk even when the page cache served
them); extents written before it came are CRC-32 (`kind` CRC32) and are still read. The valid slot with
the higher generation is the file's header; the other is the one before.

Saving (session_file_save.py) appends the KV a file lacks, then writes the new header in the other slot.

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
from typing import Generic, TypeVar

import msgspec
import xxhash

MAGIC = b"CBDSESS2"
MAGIC_V1 = b"CBDSESS1"
PREFIX = struct.Struct("<8sII")  # magic, slot size, 0
SLOT = struct.Struct("<QII")  # generation, header length, CRC-32 of generation + header
_PREFIX_V1 = struct.Struct("<8sII")  # magic, header length, header CRC-32
SUFFIX = ".session"


class Fingerprint(msgspec.Struct, frozen=True, array_like=True):
    """`model`: what the token ids mean and what computed the KV (name, weights' identity, architecture);
    `kv`: the KV extents' layout (dtype, KV format, block size, tensor-parallel size, slot shape)."""

    model: str
    kv: str


CRC32, XXH3 = 0, 1  # an extent's checksum: zlib's CRC-32 (files of earlier versions), XXH3-64 (written now)


class Extent(msgspec.Struct, frozen=True, array_like=True):
    offset: int  # from the start of the file
    length: int
    checksum: int
    num_tokens: int  # the tokens whose KV it holds
    kind: int = CRC32  # of checksum (absent in files of earlier versions: CRC-32)


def checksum(data: bytes | memoryview) -> int:
    """A new extent's checksum (XXH3-64)."""
    return xxhash.xxh3_64_intdigest(data)


class _Check:
    """An extent's checksum over its bytes in pieces, of either kind."""

    def __init__(self, kind: int) -> None:
        self.crc = 0
        self.xxh = xxhash.xxh3_64() if kind == XXH3 else None

    def update(self, view: memoryview) -> None:
        if self.xxh is not None:
            self.xxh.update(view)
        else:
            self.crc = zlib.crc32(view, self.crc)

    def matches(self, extent: Extent) -> bool:
        if extent.kind not in (CRC32, XXH3):
            return False  # a kind this version does not know: treated as damaged (recomputed)
        return (self.xxh.intdigest() if self.xxh is not None else self.crc) == extent.checksum


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


encoder = msgspec.msgpack.Encoder()
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


Data = TypeVar("Data")


@dataclass(slots=True)
class NewKv(Generic[Data]):
    """A branch's KV to save: the first `keep` tokens' extents of the file's branch `base` (its tokens there
    the same), then `extents`, new data in order, each with the tokens it covers: bytes when saved; until the
    disk tier's writer gathers them, GPU blocks may stand in (kv/disk_tier.py `PoolBlocks`)."""

    base: int | None
    keep: int
    extents: list[tuple[Data, int]]


KvBytes = NewKv[bytes | memoryview]  # a branch's KV as it is saved (kv/session_file_save.py)


class DamagedFile(Exception):
    """A session file that cannot be used at all (its header is damaged, or it is not a session file)."""


def file_name(key: str) -> str:
    """A session key's file name (keys hold '/' and any character an id may have)."""
    return hashlib.sha256(key.encode()).hexdigest()[:40] + SUFFIX


def slot_crc(generation: int, header: bytes) -> int:
    """A header slot's checksum: CRC-32 over its generation (u64, little-endian), then the header."""
    return zlib.crc32(header, zlib.crc32(struct.pack("<Q", generation)))


def read_header(path: Path) -> tuple[SavedSession, Layout]:
    """A file's header (the newer whole slot) and where it is. Raises DamagedFile or OSError."""
    with open(path, "rb") as f:
        prefix = f.read(PREFIX.size)
        if len(prefix) < PREFIX.size:
            raise DamagedFile("shorter than its header")
        magic, slot_size, _ = PREFIX.unpack(prefix)
        if magic == MAGIC_V1:
            return _read_v1(f, prefix), Layout(1)
        if magic != MAGIC:
            raise DamagedFile("not a cbd session file")
        best: tuple[int, int, bytes] | None = None
        for slot in (0, 1):
            f.seek(PREFIX.size + slot * slot_size)
            head = f.read(SLOT.size)
            if len(head) < SLOT.size:
                continue
            generation, length, crc = SLOT.unpack(head)
            if not generation or length > slot_size - SLOT.size:
                continue
            header = f.read(length)
            if len(header) == length and slot_crc(generation, header) == crc:
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
        SavedBranch(
            b.token_ids, b.kv_tokens, [Extent(start + b.offset, b.length, b.crc, b.kv_tokens, CRC32)] if b.kv_tokens else []
        )
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
    when an extent is short or fails its checksum (the buffers then hold garbage). Each piece is checked
    as it is read, while it is in the CPU's caches."""
    views = [b.cast("B") for b in buffers]
    if sum(len(v) for v in views) != sum(e.length for e in branch.extents):
        return False
    at = 0  # into views[i]
    i = 0
    with open(path, "rb", buffering=0) as f:
        for extent in branch.extents:
            f.seek(extent.offset)
            left, check = extent.length, _Check(extent.kind)
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
                check.update(view)
                at += len(view)
                left -= len(view)
            if not check.matches(extent):
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
