"""What saving a session to its file takes (kv/session_file_save.py): for each branch, the extents its file holds
already under the same tokens (kept), and the blocks to append after them: gathered to host bytes from the host
tier or a file, or named (`PoolBlocks`) where they are on the GPU, for the disk tier's writer to gather.

A file's contents are known to the engine thread as a view (`FileView`): per branch of the file, the token
counts its extents end at, each with a digest of the token ids up to there. A branch keeps the file's
extents up to the last end that is a whole block's (or its whole KV, unchanged) under the same tokens,
whichever branch of the file they belong to (a candidate of a fan-out keeps the history's); the writer
compares the token ids themselves before it keeps them.
"""

from __future__ import annotations

import array
import bisect
import hashlib
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

from cbd.engine.kv import session_files as files
from cbd.engine.kv.disk_tier import DiskTier, Planned, PoolBlocks, raw_bytes
from cbd.engine.kv.host_pool import HostCopy
from cbd.engine.sessions.records import Branch, Session

FileView = list[list[tuple[int, bytes]]]  # per branch of a file: (tokens its extent ends at, digest up to it)


@dataclass(slots=True)
class BranchKv:
    """How a branch's KV is saved: the tokens it covers; the file's branch `base` whose extents up to `keep`
    tokens are kept (their ends: `bounds`); the rest is gathered and appended."""

    kv_tokens: int
    base: int | None = None
    keep: int = 0
    bounds: list[tuple[int, bytes]] = field(default_factory=list)


def plan(disk: DiskTier, session: Session, on_file: FileView) -> list[BranchKv]:
    """Each branch's `BranchKv` against the file's view (none kept without one; none at all if the disk
    tier keeps no KV)."""
    if not disk.keeps_kv:
        return [BranchKv(0) for _ in session.branches_and_self()]
    size = disk.block_size
    out = []
    for b in session.branches_and_self():
        tokens = kv_tokens(b)
        best = BranchKv(tokens)
        for base, bounds in enumerate(on_file):
            # The extents' ends it may keep (a whole block's, or all of an unchanged branch's)...
            usable = [i for i, (end, _) in enumerate(bounds) if end <= tokens and (end % size == 0 or end == tokens)]
            # ... and of those the last under the same tokens (a prefix that matches, matches shorter).
            i = bisect.bisect_right(
                usable, 0, key=lambda j: 0 if prefix_hashes(b.token_ids, [bounds[j][0]])[0] == bounds[j][1] else 1
            )
            if i and bounds[usable[i - 1]][0] > best.keep:
                best = BranchKv(tokens, base, bounds[usable[i - 1]][0], bounds[: usable[i - 1] + 1])
        out.append(best)
    return out


def kv_tokens(b: Branch) -> int:
    """The tokens whose KV a branch holds (on the GPU, the host or in its file)."""
    if b.block_table and b.num_computed:
        return min(b.num_computed, len(b.token_ids))
    if b.host is not None:
        return b.host.num_tokens
    return b.disk.num_tokens if b.disk is not None else 0


def new_kv(disk: DiskTier, b: Branch, p: BranchKv, gather_gpu: bool = False) -> Planned | None:
    """The KV a branch's file lacks (blocks from `p.keep`'s on): its whole blocks, then its last partial block
    apart (so that the next save keeps the whole ones); from the host tier or a file as host bytes, from the
    GPU as `PoolBlocks` for the writer thread to gather (the caller references them until the write is done),
    or gathered now with `gather_gpu` (a spill: its blocks are freed as soon as it returns)."""
    size, per_block = disk.block_size, disk.bytes_per_block
    if p.keep >= p.kv_tokens:  # the branch's KV is in the file as it is
        return Planned(p.base, p.keep, [])
    first, count = p.keep // size, -(-p.kv_tokens // size)
    whole = p.kv_tokens // size - first
    parts = [(0, whole, whole * size)] if whole else []  # keep is a whole block's end here
    if p.kv_tokens % size:
        parts.append((whole, count - first, p.kv_tokens % size))
    if b.block_table and b.num_computed and not gather_gpu:  # named here, gathered by the disk tier's writer thread
        table = b.block_table[first:count]
        return Planned(p.base, p.keep, [(PoolBlocks(table[lo:hi]), n) for lo, hi, n in parts])
    data = _blocks(disk, b, first, count)
    if data is None:  # the file it was only in is damaged: saved without (recomputed later)
        return None
    return Planned(p.base, p.keep, [(data[lo * per_block : hi * per_block], n) for lo, hi, n in parts])


def view_after(p: BranchKv, saved: files.SavedBranch, block_size: int) -> list[tuple[int, bytes]]:
    """A branch's part of the file's view once it is saved with `saved.kv_tokens` as `p` planned: the kept
    extents' ends, then the new ones' (their whole blocks', then a partial block's)."""
    if not saved.kv_tokens:
        return []
    bounds = list(p.bounds)
    last = bounds[-1][0] if bounds else 0
    tokens = saved.kv_tokens
    ends = sorted({e for e in (tokens // block_size * block_size, tokens) if e > last})
    return bounds + list(zip(ends, prefix_hashes(saved.token_ids, ends), strict=True))


def held(saved: files.SavedSession) -> FileView:
    """The view of a file as written or listed: each branch's extents' ends with their digests."""
    out = []
    for b in saved.branches:
        ends = list(itertools.accumulate(e.num_tokens for e in b.extents))
        out.append(list(zip(ends, prefix_hashes(b.token_ids, ends), strict=True)))
    return out


def prefix_hashes(token_ids: list[int], ends: Iterable[int]) -> list[bytes]:
    """A digest of the token ids up to each end (ascending), in one pass."""
    digest, at, out = hashlib.blake2b(digest_size=16), 0, []
    for end in ends:
        digest.update(array.array("q", token_ids[at:end]).tobytes())
        at = end
        out.append(digest.copy().digest())
    return out


def _blocks(disk: DiskTier, b: Branch, first: int, count: int) -> memoryview | None:
    """A branch's KV blocks [first, count) as host bytes (`[blocks, layers, block_size, *slot]`), gathered now from
    the GPU pool, the host tier or its file."""
    if b.block_table and b.num_computed:
        tensor = disk.gather_gpu(b.block_table[first:count])
    elif b.host is not None:
        tensor = disk.gather_host(HostCopy(b.host.block_ids[first:count], 0))
    else:  # only in a file it is not kept in (written anew or damaged since): read it back first
        assert b.disk is not None
        data = files.read_kv(b.disk.path, b.disk.branch)
        per_block = disk.bytes_per_block
        if data is None or len(data) != -(-b.disk.num_tokens // disk.block_size) * per_block:
            return None
        return memoryview(data)[first * per_block : count * per_block]
    return raw_bytes(tensor)
