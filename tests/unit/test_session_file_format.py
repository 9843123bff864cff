"""The session file format (kv/session_files.py): a save appends only the KV the file lacks, a reader sees
the last whole save (a torn header slot or a failed append leave the one before), files full of dead
extents are written anew, and files of the first format are still read and carried over. KV here is
synthetic: 4 tokens per block, each block 8 bytes that depend on the tokens it holds (so a partial block
differs from the same block filled later)."""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path

import pytest

from cbd.engine.kv import session_file_save
from cbd.engine.kv import session_files as files

SIZE = 4  # tokens per block


def _block(tokens: list[int]) -> bytes:
    return struct.pack("<4H", *(tokens + [0] * (SIZE - len(tokens))))


def _kv(tokens: list[int], kv_tokens: int, first_block: int = 0) -> bytes:
    """The KV of tokens[:kv_tokens] from block `first_block` on."""
    count = -(-kv_tokens // SIZE)
    return b"".join(_block(tokens[j * SIZE : min((j + 1) * SIZE, kv_tokens)]) for j in range(first_block, count))


def _new(tokens: list[int], kv_tokens: int, base: int | None = None, keep: int = 0) -> files.NewKv:
    """What the engine hands over: the blocks after `keep`, whole ones, then the last partial one apart."""
    whole = kv_tokens // SIZE
    extents: list[tuple[bytes | memoryview, int]] = []
    if whole * SIZE > keep:
        extents.append((_kv(tokens, whole * SIZE, keep // SIZE), whole * SIZE - keep))
    if kv_tokens % SIZE and kv_tokens > keep:
        extents.append((_block(tokens[whole * SIZE : kv_tokens]), kv_tokens % SIZE))
    return files.NewKv(base, keep, extents)


def _session(*branches: tuple[list[int], int]) -> files.SavedSession:
    return files.SavedSession(
        files.Fingerprint("m", "kv"), "tenant/s", 60.0, 0.0, 0.0, False, None, 0, 0, b"",
        [files.SavedBranch(list(t), k) for t, k in branches],
    )  # fmt: skip


def _read(path: Path) -> tuple[files.SavedSession, list[bytes | None]]:
    saved, _ = files.read_header(path)
    return saved, [bytes(d) if (d := files.read_kv(path, b)) is not None else None for b in saved.branches]


TOKENS = list(range(1, 200))


def test_a_save_appends_only_what_the_file_lacks_and_reads_back_whole(tmp_path) -> None:
    path = tmp_path / "s.session"
    session_file_save.save(path, _session((TOKENS[:50], 49)), [_new(TOKENS, 49)])
    first = path.stat().st_size
    # The next turn: 30 more tokens. The file keeps its 12 whole blocks; the partial 13th is written again.
    saved, written = session_file_save.save(path, _session((TOKENS[:80], 79)), [_new(TOKENS, 79, base=0, keep=48)])
    assert saved.branches[0].kv_tokens == 79
    assert path.stat().st_size == first + len(_kv(TOKENS, 79, 12))  # appended, header in the other slot
    assert written < len(_kv(TOKENS, 79)) + 4096
    back, data = _read(path)
    assert back.branches[0].token_ids == TOKENS[:80] and data == [_kv(TOKENS, 79)]
    # A fork's candidate keeps the history's extents of whole blocks too (up to the end of one: the first 48
    # tokens' here); an unchanged branch keeps everything.
    candidate = TOKENS[:60] + [500, 501, 502]
    session_file_save.save(
        path, _session((TOKENS[:80], 79), (candidate, 62)),
        [files.NewKv(0, 79, []), _new(candidate, 62, base=0, keep=48)],
    )  # fmt: skip
    back, data = _read(path)
    assert data == [_kv(TOKENS, 79), _kv(candidate, 62)]


def test_a_torn_header_slot_or_a_failed_append_leaves_the_save_before(tmp_path, monkeypatch) -> None:
    path = tmp_path / "s.session"
    session_file_save.save(path, _session((TOKENS[:50], 49)), [_new(TOKENS, 49)])
    session_file_save.save(path, _session((TOKENS[:80], 79)), [_new(TOKENS, 79, base=0, keep=48)])
    _, layout = files.read_header(path)
    assert layout.generation == 2 and layout.slot == 1
    raw = bytearray(path.read_bytes())
    raw[16 + layout.slot_size + 20] ^= 0xFF  # a byte of the newer header: as if the machine died writing it
    path.write_bytes(bytes(raw))
    back, data = _read(path)
    assert back.branches[0].token_ids == TOKENS[:50] and data == [_kv(TOKENS, 49)]

    size = path.stat().st_size
    real = os.fsync

    def full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError):
        session_file_save.save(path, _session((TOKENS[:120], 119)), [_new(TOKENS, 119, base=0, keep=48)])
    monkeypatch.setattr(os, "fsync", real)
    assert path.stat().st_size == size  # the extents appended were cut off again
    back, data = _read(path)
    assert back.branches[0].token_ids == TOKENS[:50] and data == [_kv(TOKENS, 49)]
    assert not [p for p in tmp_path.iterdir() if p != path]


def test_kept_extents_the_file_lacks_save_token_ids_only(tmp_path) -> None:
    path = tmp_path / "s.session"
    session_file_save.save(path, _session((TOKENS[:50], 49)), [_new(TOKENS, 49)])
    other = [7] + TOKENS[1:80]  # not the tokens the file holds
    saved, _ = session_file_save.save(path, _session((other, 79)), [_new(other, 79, base=0, keep=48)])
    assert saved.branches[0].kv_tokens == 0
    back, data = _read(path)
    assert back.branches[0].token_ids == other and back.branches[0].kv_tokens == 0 and data == [b""]


def test_a_file_mostly_dead_is_written_anew(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(session_file_save, "DEAD_FLOOR", 0)
    path = tmp_path / "s.session"
    session_file_save.save(path, _session((TOKENS[:8], 8)), [_new(TOKENS, 8)])
    session_file_save.save(path, _session((TOKENS[:100], 99)), [_new(TOKENS, 99, base=0, keep=8)])
    session_file_save.save(path, _session((TOKENS[:100], 99)), [files.NewKv(0, 99, [])])  # unchanged: header only
    assert path.stat().st_size == 16 + 2 * files.read_header(path)[1].slot_size + len(_kv(TOKENS, 99))
    assert files.read_header(path)[1].generation == 3
    # A session that branched away early keeps 2 of the file's 25 blocks: the rest is dead, so a new file.
    other = TOKENS[:8] + [900] * 40
    session_file_save.save(path, _session((other, 47)), [_new(other, 47, base=0, keep=8)])
    _, layout = files.read_header(path)
    assert layout.generation == 1
    assert path.stat().st_size == 16 + 2 * layout.slot_size + len(_kv(other, 47))
    assert _read(path)[1] == [_kv(other, 47)]


def test_files_of_the_first_format_are_read_and_carried_over(tmp_path) -> None:
    path = tmp_path / "s.session"
    old = files._SessionV1(
        files.Fingerprint("m", "kv"), "tenant/s", 60.0, 1.0, 2.0, True, None, 1, 0, b"note",
        [files._BranchV1(TOKENS[:50], 49, 0, len(_kv(TOKENS, 49)), zlib.crc32(_kv(TOKENS, 49)))],
    )  # fmt: skip
    header = files.encoder.encode(old)
    path.write_bytes(struct.pack("<8sII", b"CBDSESS1", len(header), zlib.crc32(header)) + header + _kv(TOKENS, 49))
    saved, data = _read(path)
    assert (saved.key, saved.note, saved.retention, saved.is_chat) == ("tenant/s", b"note", 1, True)
    assert saved.branches[0].token_ids == TOKENS[:50] and data == [_kv(TOKENS, 49)]
    # Saved again unchanged (its note changed): written anew in the current format, its extent copied over.
    changed = _session((TOKENS[:50], 49))
    changed.note = b"new note"
    session_file_save.save(path, changed, [files.NewKv(0, 49, [])])
    assert path.read_bytes()[:8] == files.MAGIC
    saved, data = _read(path)
    assert saved.note == b"new note" and data == [_kv(TOKENS, 49)]


def test_a_file_written_anew_holds_an_extent_its_branches_share_once(tmp_path) -> None:
    path = tmp_path / "s.session"
    session_file_save.save(path, _session((TOKENS[:48], 48)), [_new(TOKENS, 48)])
    candidates = [TOKENS[:48] + [600 + i] * 5 for i in range(3)]
    session_file_save.save(
        path, _session((TOKENS[:48], 48), *((c, 53) for c in candidates)),
        [files.NewKv(0, 48, []), *(_new(c, 53, base=0, keep=48) for c in candidates)],
    )  # fmt: skip
    longer = _session((TOKENS[:48], 48), *((c, 53) for c in candidates))
    longer.note = bytes(3 * files.read_header(path)[1].slot_size)  # a header its slots cannot hold
    session_file_save.save(path, longer, [files.NewKv(0, 48, []), *(files.NewKv(i + 1, 53, []) for i in range(3))])
    _, layout = files.read_header(path)
    assert layout.generation == 1  # written anew, with larger slots
    unique = len(_kv(TOKENS, 48)) + sum(len(_kv(c, 53, 12)) for c in candidates)
    assert path.stat().st_size == 16 + 2 * layout.slot_size + unique
    assert _read(path)[1] == [_kv(TOKENS, 48), *(_kv(c, 53) for c in candidates)]


def test_a_save_that_is_not_durable_skips_the_fsyncs_only_where_no_earlier_save_is_at_stake(
    tmp_path, monkeypatch
) -> None:  # fmt: skip
    """A spill's save (durable=False) of a new file and its appends run no fsync; written anew over a file that
    exists, it does (the older file is at stake); a durable save always does. The file reads back the same,
    and an append's new extents that never reached the disk fail their CRC (recomputed, the tokens kept)."""
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real(fd))
    path = tmp_path / "s.session"
    session_file_save.save(path, _session((TOKENS[:50], 49)), [_new(TOKENS, 49)], durable=False)
    session_file_save.save(path, _session((TOKENS[:80], 79)), [_new(TOKENS, 79, base=0, keep=48)], durable=False)
    assert synced == []
    back, data = _read(path)
    assert back.branches[0].token_ids == TOKENS[:80] and data == [_kv(TOKENS, 79)]
    session_file_save.save(path, _session((TOKENS[:80], 79)), [files.NewKv(0, 79, [])], compact=True, durable=False)
    assert len(synced) >= 2  # the file and its directory: the older file was at stake
    synced.clear()
    session_file_save.save(path, _session((TOKENS[:90], 89)), [_new(TOKENS, 89, base=0, keep=76)])
    assert len(synced) == 2  # a durable append: the extents, then the header
    # A crash after a save without fsyncs whose extents never reached the disk: zeros where they were.
    session_file_save.save(path, _session((TOKENS[:120], 119)), [_new(TOKENS, 119, base=0, keep=88)], durable=False)
    back, _ = files.read_header(path)
    raw = bytearray(path.read_bytes())
    last = back.branches[0].extents[-1]
    raw[last.offset : last.offset + last.length] = bytes(last.length)
    path.write_bytes(bytes(raw))
    back, data = _read(path)
    assert back.branches[0].token_ids == TOKENS[:120] and data == [None]


def test_saves_without_fsyncs_in_a_row_never_overwrite_the_last_fsynced_header(tmp_path) -> None:
    """After a save without fsyncs, the next one writes the same header slot (same_slot): if a crash tears it,
    the other slot still holds the last durable save, not an older one."""
    path = tmp_path / "s.session"
    session_file_save.save(path, _session((TOKENS[:50], 49)), [_new(TOKENS, 49)])
    session_file_save.save(path, _session((TOKENS[:80], 79)), [_new(TOKENS, 79, base=0, keep=48)])  # durable
    session_file_save.save(path, _session((TOKENS[:90], 89)), [_new(TOKENS, 89, base=0, keep=76)], durable=False)
    _, first = files.read_header(path)
    session_file_save.save(path, _session((TOKENS[:100], 99)), [_new(TOKENS, 99, base=0, keep=88)], durable=False,
                           same_slot=True)  # fmt: skip
    back, layout = files.read_header(path)
    assert layout.slot == first.slot and layout.generation == first.generation + 1
    assert back.branches[0].token_ids == TOKENS[:100]
    raw = bytearray(path.read_bytes())
    raw[16 + layout.slot * layout.slot_size + 20] ^= 0xFF  # the crash tore the slot being written
    path.write_bytes(bytes(raw))
    back, data = _read(path)
    assert back.branches[0].token_ids == TOKENS[:80] and data == [_kv(TOKENS, 79)]  # the last durable save


def test_extents_are_checked_by_xxh3_and_files_with_crc32_extents_are_still_read(tmp_path, monkeypatch) -> None:
    """New extents carry XXH3-64 (a flipped byte fails it); a file whose extents carry CRC-32 (as written before
    XXH3 came, the kind absent from their records) is read, its damage found the same way; a kind this version does
    not know is treated as damaged."""
    path = tmp_path / "s.session"
    session_file_save.save(path, _session((TOKENS[:50], 49)), [_new(TOKENS, 49)])
    saved, kv = _read(path)
    assert kv == [_kv(TOKENS, 49)] and {e.kind for e in saved.branches[0].extents} == {files.XXH3}
    extent = saved.branches[0].extents[0]
    raw = bytearray(path.read_bytes())
    raw[extent.offset + 3] ^= 0x40
    path.write_bytes(raw)
    assert _read(path)[1] == [None]
    # The same session as an earlier version wrote it: CRC-32 extents, the record without its kind.
    monkeypatch.setattr(session_file_save, "checksum", zlib.crc32)
    monkeypatch.setattr(session_file_save, "XXH3", files.CRC32)
    old = tmp_path / "old.session"
    session_file_save.save(old, _session((TOKENS[:50], 49)), [_new(TOKENS, 49)])
    saved, kv = _read(old)
    assert kv == [_kv(TOKENS, 49)] and {e.kind for e in saved.branches[0].extents} == {files.CRC32}
    header, layout = files.read_header(old)
    encoded = files.encoder.encode(header)
    stripped = files.encoder.encode(  # each extent record as [offset, length, checksum, num_tokens], no kind
        [*[getattr(header, f) for f in header.__struct_fields__[:-1]],
         [[b.token_ids, b.kv_tokens, [[e.offset, e.length, e.checksum, e.num_tokens] for e in b.extents]]
          for b in header.branches]]
    )  # fmt: skip
    assert len(stripped) < len(encoded) and files._decoder.decode(stripped) == header
    raw = bytearray(old.read_bytes())
    at = files.PREFIX.size + layout.slot * layout.slot_size
    raw[at : at + files.SLOT.size + len(stripped)] = (
        files.SLOT.pack(layout.generation, len(stripped), files.slot_crc(layout.generation, stripped)) + stripped
    )
    old.write_bytes(raw)
    monkeypatch.undo()
    assert _read(old)[1] == [_kv(TOKENS, 49)]
    raw[extent.offset + 3] ^= 0x40
    old.write_bytes(raw)
    assert _read(old)[1] == [None]
    unknown = files.Extent(extent.offset, extent.length, extent.checksum, extent.num_tokens, 7)
    assert not files._Check(7).matches(unknown)
