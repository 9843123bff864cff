"""Session files: one file per saved session, written atomically and read back only when whole.

    magic (8 bytes) | header length (u32) | header CRC-32 (u32) | header (MessagePack) | KV segments

The header is a `SavedSession`: the session's key, settings, the frontend's note (its transcript),
every branch's token ids, and where each branch's KV segment lies in the file with its length and
CRC-32. A segment is the host-pool layout of the branch's blocks, `[blocks, layers, block_size,
*slot]`, as raw bytes. The file's `Fingerprint` says which model the tokens belong to and which KV
layout the segments have: a file whose header is damaged is not used at all; one whose model differs
is not used at all (its token ids would mean other tokens); one whose KV layout differs, or whose
segment is short or fails its checksum, gives its token ids only (the next turn recomputes them).

Writes go to a temporary file in the same directory, are fsynced and renamed over the old file (then
the directory is fsynced): a reader sees the old file or the new one, never a mix. A write that fails
(disk full) removes its temporary file. No torch here: segments are bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import msgspec

MAGIC = b"CBDSESS1"
_PREFIX = struct.Struct("<8sII")  # magic, header length, header CRC-32
SUFFIX = ".session"


class Fingerprint(msgspec.Struct, frozen=True, array_like=True):
    """`model`: what the token ids mean and what computed the KV (name, weights' identity, architecture);
    `kv`: the KV segments' layout (dtype, KV format, block size, tensor-parallel size, slot shape)."""

    model: str
    kv: str


class SavedBranch(msgspec.Struct, array_like=True):
    token_ids: list[int]
    kv_tokens: int  # the segment holds the KV of token_ids[:kv_tokens] (0: no segment)
    offset: int = 0  # from the end of the header
    length: int = 0
    crc: int = 0


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


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(SavedSession)


@dataclass(slots=True)
class DiskCopy:
    """A branch's KV in a session file (segment `branch` of the file at `path`, segments from `start`)."""

    path: Path
    start: int
    branch: SavedBranch

    @property
    def num_tokens(self) -> int:
        return self.branch.kv_tokens


class DamagedFile(Exception):
    """A session file that cannot be used at all (its header is damaged, or it is not a session file)."""


def file_name(key: str) -> str:
    """A session key's file name (keys hold '/' and any character an id may have)."""
    return hashlib.sha256(key.encode()).hexdigest()[:40] + SUFFIX


def write(path: Path, saved: SavedSession, segments: Iterable[bytes | memoryview]) -> tuple[int, int]:
    """Write a session file atomically (see above); `saved.branches` give the segments' lengths in order,
    offsets and CRCs are filled in here. Returns the bytes written and where the segments start. Raises
    OSError (nothing left behind)."""
    segments = list(segments)
    offset = 0
    with_kv = [b for b in saved.branches if b.kv_tokens]
    assert len(with_kv) == len(segments), "one segment per branch with KV"
    for branch, data in zip(with_kv, segments):
        size = memoryview(data).nbytes
        branch.offset, branch.length, branch.crc = offset, size, zlib.crc32(data)
        offset += size
    header = _encoder.encode(saved)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(_PREFIX.pack(MAGIC, len(header), zlib.crc32(header)))
            f.write(header)
            for data in segments:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    sync_directory(path.parent)
    return _PREFIX.size + len(header) + offset, _PREFIX.size + len(header)


def read_header(path: Path) -> tuple[SavedSession, int]:
    """A file's header and where its segments start. Raises DamagedFile or OSError."""
    with open(path, "rb") as f:
        prefix = f.read(_PREFIX.size)
        if len(prefix) < _PREFIX.size:
            raise DamagedFile("shorter than its header")
        magic, length, crc = _PREFIX.unpack(prefix)
        if magic != MAGIC:
            raise DamagedFile("not a cbd session file")
        header = f.read(length)
    if len(header) < length or zlib.crc32(header) != crc:
        raise DamagedFile("its header is damaged (checksum)")
    try:
        return _decoder.decode(header), _PREFIX.size + length
    except msgspec.DecodeError as exc:
        raise DamagedFile(f"its header does not decode ({exc})") from None


def read_segment(path: Path, start: int, branch: SavedBranch) -> bytearray | None:
    """A branch's KV segment, or None when it is short or fails its checksum (the caller recomputes)."""
    data = bytearray(branch.length)
    return data if read_segment_into(path, start, branch, [memoryview(data)]) else None


def read_segment_into(path: Path, start: int, branch: SavedBranch, buffers: list[memoryview]) -> bool:
    """Read a branch's KV segment straight into `buffers` (in order, their sizes adding up to its length);
    False when it is short or fails its checksum (the buffers then hold garbage)."""
    if sum(b.nbytes for b in buffers) != branch.length:
        return False
    crc = 0
    with open(path, "rb", buffering=0) as f:
        f.seek(start + branch.offset)
        for buffer in buffers:
            view = buffer.cast("B")
            done = 0
            while done < len(view):
                n = f.readinto(view[done:])
                if not n:
                    return False
                done += n
            crc = zlib.crc32(view, crc)
    return crc == branch.crc


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
