"""kvps.raft.journal: the record format, torn tails and corruption, crash-safe compaction rewrites
(done off the tick thread, with appends, truncations and clears meanwhile), records a snapshot
covers dropped at open, the meta file, the fsync policies (fsync calls counted), the list model
(hypothesis, with pending rewrites and crashes), the injection into pysyncobj, and groups
restarted from their journals (also from one a crash left in the middle of a rewrite)."""
from __future__ import annotations

import logging
import os
import shutil
import struct
import tempfile
import threading
import zlib
from pathlib import Path

import numpy as np
import pysyncobj.syncobj
import pytest
import xxhash
from conftest import wait_for
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from pysyncobj.journal import FileJournal

from kvps.config import (
    ClusterConfig,
    NodeConfig,
    RaftConfig,
    dump_cluster,
    load_cluster,
)
from kvps.delta import frame
from kvps.errors import CodecError, ConfigError
from kvps.raft import disk, journal_file, segments
from kvps.raft.group import _ENTRY_PREFIX
from kvps.raft.journal import MAGIC, SEG_MAGIC, RaftJournal, using_journal
from kvps.raft.log_memory import RELEASE_MIN_BYTES
from kvps.raft.released import Released
from kvps.raft.meta_file import META_MAGIC, SLOT
from kvps.raft.segments import DATA, SEG_HEADER

RECORD = 24  # '<IIQQ'
SEGMENT = 16 * 1024  # small segments: a few records each, so tests cross their ends


class IOErrorSeen(Exception):
    pass


def raise_instead_of_exit(exc: OSError, what: str) -> None:
    raise IOErrorSeen(what) from exc


def open_journal(path: Path, fsync: str = "never", **kwargs) -> RaftJournal:
    kwargs.setdefault("on_io_error", raise_instead_of_exit)
    kwargs.setdefault("segment_bytes", SEGMENT)
    return RaftJournal(path, fsync=fsync, **kwargs)


def entries(j: RaftJournal) -> list[tuple[bytes, int, int]]:
    return [(bytes(c), i, t) for c, i, t in j[:]]


def fill(j: RaftJournal, n: int, first: int = 1, term: int = 1, size: int = 100) -> list:
    added = []
    for k in range(n):
        entry = (bytes([k % 251]) * (size + k), first + k, term)
        j.add(*entry)
        added.append(entry)
    return added


# ---- format ---------------------------------------------------------------------------------------

def write_legacy(path: Path, version: int, added: list) -> None:
    """A single-file journal as kvps wrote it before segments (kvps.raft.journal_file)."""
    out = bytearray(struct.pack("<8sHHI", MAGIC, version, 0, 0))
    for command, index, term in added:
        checked = struct.pack("<IQQ", len(command), index, term)
        out += struct.pack("<I", journal_file.record_sum(version, checked, command)) + checked + command
    path.write_bytes(bytes(out))


def segment_files(folder: Path) -> list[Path]:
    """The journal's segment files; not a spare the worker thread is still allocating (it is
    renamed from ``.new`` once allocated: a listing may race with that rename)."""
    return sorted(p for p in folder.glob("raft.journal.seg-*") if not p.name.endswith(".new"))


def record_at(j: RaftJournal, i: int) -> tuple[Path, int]:
    """The segment file and offset of entry ``i``'s record."""
    seg, offset = j._locs[i]
    return seg.path, offset


@pytest.mark.parametrize("version", [1, 2])
def test_a_single_file_journal_is_moved_into_segments(tmp_path, version):
    """A journal written before segments (CRC-32 records in version 1, XXH3 in 2) opens: its
    records move into segments, and the file is removed once they are durable."""
    path = tmp_path / "raft.journal"
    added = [(b"a" * 10, 1, 1), (b"b" * 20, 2, 1), (b"c" * 30, 3, 2)]
    write_legacy(path, version, added)
    with open(path, "ab") as f:
        f.write(b"torn")  # a torn tail is dropped, as that journal did
    j = open_journal(path, first_index=2)  # and records the snapshot covers too
    assert entries(j) == added[1:]
    assert not path.exists() and segment_files(tmp_path)
    j.add(b"d", 4, 2)
    j._destroy()
    assert entries(open_journal(path)) == added[1:] + [(b"d", 4, 2)]


def test_round_trip_entries_and_layout(tmp_path):
    path = tmp_path / "raft.journal"
    j = open_journal(path)
    added = fill(j, 5, first=7, term=2)
    j.add(b"", 12, 3)  # empty commands are legal
    added.append((b"", 12, 3))
    assert entries(j) == added and len(j) == 6
    assert j[-1] == (b"", 12, 3) and j[1:3] == added[1:3]  # pysyncobj indexes and slices
    seg, offset = record_at(j, 0)
    j._destroy()
    assert not path.exists() and offset == DATA
    data = seg.read_bytes()
    assert len(data) == SEGMENT  # preallocated: appends never grow a file
    magic, version, state, epoch, _ = SEG_HEADER.unpack_from(data, 0)
    assert (magic, version, state) == (SEG_MAGIC, 2, 1) and epoch >= 1
    crc, length, index, term = struct.unpack_from("<IIQQ", data, DATA)
    assert (length, index, term) == (100, 7, 2)
    command = data[DATA + RECORD:DATA + RECORD + 100]  # summed as the epoch-seeded XXH3 of the
    digest = struct.pack("<Q", xxhash.xxh3_64_intdigest(command))  # fields and the command's
    assert crc == xxhash.xxh3_64_intdigest(data[DATA + 4:DATA + RECORD] + digest, seed=epoch) & 0xFFFFFFFF
    j = open_journal(path)
    assert entries(j) == added
    j.add(b"after", 13, 3)  # appends go on, in a fresh segment
    assert record_at(j, 6) == (segment_files(tmp_path)[-1], DATA)
    j._destroy()
    assert entries(open_journal(path))[-1] == (b"after", 13, 3)
    assert all(p.stat().st_size == SEGMENT for p in segment_files(tmp_path))


def frame_command(k: int, n: int = 64) -> bytes:
    """A proposed entry as a kvps shard's group journals it: the entry prefix, then a frame."""
    arrays = [np.arange(n, dtype=np.float32) + k, np.full(n // 2, k, dtype=np.int64)]
    return bytes(_ENTRY_PREFIX) + frame.encode(frame.KIND_COMMAND, {"k": k}, arrays)


def frame_digest_journal(path: Path, **kwargs) -> RaftJournal:
    return open_journal(path, digest=segments.prefixed_digest(_ENTRY_PREFIX, frame.verified_digest), **kwargs)


def test_a_frame_journal_checks_each_command_once_and_its_records_cover_every_byte(tmp_path):
    """With a shard's digest the record checksum covers the frame's head, which carries every
    array's checksum: a byte flipped in an array on disk still ends the log there, and a command
    failing its own checksums is refused before it is written (one pass, no second hash)."""
    path = tmp_path / "raft.journal"
    j = frame_digest_journal(path)
    added = [(frame_command(k), k + 1, 1) for k in range(6)]
    for entry in added:
        j.add(*entry)
    j.add(b"\x01no-op", 7, 1)  # pysyncobj's own entries: hashed whole, as before
    added.append((b"\x01no-op", 7, 1))
    bad = bytearray(frame_command(99))
    bad[-3] ^= 0x40  # an array byte: the frame's head still parses
    with pytest.raises(IOErrorSeen, match="checking an entry"):
        j.add(bytes(bad), 8, 1)
    assert entries(j) == added
    seg, offset = record_at(j, 3)
    j._destroy()
    assert entries(frame_digest_journal(path)) == added
    data = bytearray(seg.read_bytes())
    data[offset + RECORD + len(added[3][0]) - 5] ^= 0x01  # in entry 4's last array
    seg.write_bytes(bytes(data))
    assert entries(frame_digest_journal(path)) == added[:3]


def test_a_leaders_own_frames_are_journaled_with_the_digest_they_were_built_with(tmp_path):
    """``KnownDigests``: a proposal's digest from its ``FrameParts`` is taken instead of a pass
    over its bytes, and is the very digest that pass gives (the records validate when the journal
    is read back with the full check); one never noted, forgotten, or pushed out is hashed."""
    passes: list[int] = []

    def counted(view):
        passes.append(len(view))
        return frame.verified_digest(view)

    known = segments.KnownDigests(size=2)
    path = tmp_path / "raft.journal"
    j = open_journal(path, digest=segments.prefixed_digest(_ENTRY_PREFIX, counted, known))
    rng = np.random.default_rng(2026)
    built = []
    for k in range(6):
        arrays = [rng.standard_normal(1000 + 100 * k).astype(np.float32), np.arange(k + 3, dtype=np.int64)]
        codec = ["lz4", "none"] if k % 2 else "none"
        parts = frame.encode_parts(frame.KIND_COMMAND, {"k": k}, arrays, codec=codec, at=len(_ENTRY_PREFIX))
        built.append((b"".join((_ENTRY_PREFIX, *parts)), parts.digest))
    (c0, d0), (c1, d1), (c2, d2), (c3, d3), (c4, d4), (c5, d5) = built
    key0 = known.note(c0, d0)
    known.note(c1, d1)
    j.add(c1, 1, 1)  # noted: no pass
    j.add(c0, 2, 1)  # noted: no pass
    assert passes == [] and len(known) == 0
    known.forget(key0)  # settled after the journal took it: nothing to forget, nothing breaks
    known.forget(known.note(c2, d2))  # settled before the journal saw it (leadership moved)
    j.add(c2, 3, 1)
    assert passes == [len(c2) - len(_ENTRY_PREFIX)]
    for command, digest in built[3:]:
        known.note(command, digest)  # three for two places: the first is pushed out
    for i, (command, _) in enumerate(built[3:]):
        j.add(command, 4 + i, 1)
    assert len(passes) == 2 and passes[1] == len(c3) - len(_ENTRY_PREFIX) and len(known) == 0
    j._destroy()
    added = [(c1, 1, 1), (c0, 2, 1), (c2, 3, 1), (c3, 4, 1), (c4, 5, 1), (c5, 6, 1)]
    assert entries(frame_digest_journal(path)) == added  # every record checks with the full pass


def test_segments_of_the_first_format_are_read_and_then_left_for_new_ones(tmp_path, monkeypatch):
    """Version 1 records (the epoch-seeded hash of the command itself) keep reading after an
    upgrade; appends go to a fresh segment of the current version."""
    path = tmp_path / "raft.journal"
    monkeypatch.setattr(segments, "SEG_VERSION", 1)
    j = open_journal(path)
    added = fill(j, 4)
    old_seg, _ = record_at(j, 0)
    j._destroy()
    monkeypatch.undo()
    assert SEG_HEADER.unpack_from(old_seg.read_bytes(), 0)[1] == 1
    j = open_journal(path)
    assert entries(j) == added
    j.add(b"new", 5, 1)
    new_seg, _ = record_at(j, 4)
    j._destroy()
    assert new_seg != old_seg and SEG_HEADER.unpack_from(new_seg.read_bytes(), 0)[1] == 2
    assert entries(open_journal(path)) == added + [(b"new", 5, 1)]


def crashed_copy(folder: Path, name: str) -> Path:
    """The journal's files in ``folder`` copied into a new folder in it: the journal path there."""
    out = folder / name
    out.mkdir()
    for p in folder.glob("raft.journal*"):
        for name in (p.name, p.name.removesuffix(".new")):  # a new segment renamed meanwhile
            try:
                shutil.copy(p.with_name(name), out / name)
                break
            except FileNotFoundError:  # (or a spare beyond the pool's size unlinked)
                continue
    return out / "raft.journal"


def test_torn_tail_at_every_byte_of_the_last_record(tmp_path):
    """A crash mid-append leaves the last record's bytes from some point on as they were before:
    zeros in a new segment, an earlier use's bytes in a recycled one. Either ends the log there."""
    src = tmp_path / "src"
    src.mkdir()
    j = open_journal(src / "raft.journal")
    added = fill(j, 3, size=40)
    seg, last = record_at(j, 2)
    j._destroy()
    whole = seg.read_bytes()
    end = last + RECORD + len(added[-1][0])
    for cut in range(last, end):
        for filler in (0, 0xA5):
            torn = crashed_copy(src, f"cut-{cut}-{filler}")
            data = bytearray(whole)
            data[cut:end + RECORD] = bytes([filler]) * (end + RECORD - cut)  # the marker too
            (torn.parent / seg.name).write_bytes(bytes(data))
            damage: list[str] = []
            j = open_journal(torn, on_damage=damage.append)
            assert entries(j) == added[:2], cut
            assert damage == [], cut  # a crash's footprint: the replica goes on voting
            assert not list(torn.parent.glob("*.damaged-*"))
            j.add(*added[2])  # the log goes on where the good records end
            j._destroy()
            assert entries(open_journal(torn)) == added


def test_damage_in_the_middle_keeps_the_records_before_it_and_is_reported(tmp_path, caplog):
    """A complete record failing its checksum with records after it is damage, not a torn tail:
    the entries after it may have been acknowledged, so the group must learn it (it then
    recovers before it votes) before anything is dropped, and the dropped bytes are kept."""
    src = tmp_path / "src"
    src.mkdir()
    j = open_journal(src / "raft.journal")
    added = fill(j, 5)
    seg, offset = record_at(j, 2)
    j._destroy()
    whole = seg.read_bytes()
    for where in (offset + RECORD + 10,  # a command byte
                  offset + 8,  # the index (covered by the checksum)
                  offset):  # the checksum itself
        data = bytearray(whole)
        data[where] ^= 0x40
        bad = crashed_copy(src, f"bad-{where}")
        (bad.parent / seg.name).write_bytes(bytes(data))
        damage: list[str] = []

        def on_damage(what: str) -> None:  # called before anything is dropped
            assert (bad.parent / seg.name).read_bytes() == bytes(data)
            damage.append(what)
        with caplog.at_level(logging.WARNING, logger="kvps.raft"):
            j = open_journal(bad, on_damage=on_damage)
        assert entries(j) == added[:2]
        assert len(damage) == 1 and f"offset {offset}" in damage[0]
        kept, = bad.parent.glob("raft.journal.damaged-*")
        assert kept.read_bytes() == bytes(data[offset:])
        j._destroy()
        assert entries(open_journal(bad)) == added[:2]  # cut for good: not damage again
    assert "checksum mismatch" in caplog.text


def test_a_damaged_last_record_is_a_torn_tail(tmp_path):
    """The last record failing its checksum is what a crash mid-append leaves (its pages
    written out of order): the log ends before it, not reported as damage."""
    path = tmp_path / "raft.journal"
    j = open_journal(path)
    added = fill(j, 3)
    seg, last = record_at(j, 2)
    j._destroy()
    data = bytearray(seg.read_bytes())
    data[last + RECORD + 5] ^= 0x01
    seg.write_bytes(bytes(data))
    damage: list[str] = []
    assert entries(open_journal(path, on_damage=damage.append)) == added[:2]
    assert damage == []


def test_a_record_that_does_not_continue_the_log_ends_it(tmp_path):
    path = tmp_path / "raft.journal"
    j = open_journal(path)
    added = fill(j, 2)
    j.add(b"gap", 10, 1)  # pysyncobj never does this: what was read must be a log
    j._destroy()
    damage: list[str] = []
    assert entries(open_journal(path, on_damage=damage.append)) == added
    assert len(damage) == 1 and "does not follow" in damage[0]  # no crash writes a whole record wrong


def test_wrong_magic_and_version_are_refused(tmp_path):
    stock = tmp_path / "stock" / "raft.journal"
    stock.parent.mkdir()
    old = FileJournal(str(stock))  # what kvps journals were before
    old.add(b"x", 1, 1)
    old._destroy()
    with pytest.raises(CodecError, match="FileJournal"):
        open_journal(stock)
    other = tmp_path / "other.journal"
    other.write_bytes(b"NOTAJRNL" + bytes(8))
    with pytest.raises(CodecError, match="not a kvps journal"):
        open_journal(other)
    newer = tmp_path / "newer.journal"
    newer.write_bytes(struct.pack("<8sHHI", MAGIC, 99, 0, 0))
    with pytest.raises(CodecError, match="version 99"):
        open_journal(newer)
    for name, head, match in (("bad", b"NOTASEGM" + bytes(20), "not a kvps journal segment"),
                              ("newer-seg", SEG_HEADER.pack(SEG_MAGIC, 9, 1, 1, 0), "version 9")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "raft.journal.seg-000001").write_bytes(head + bytes(SEGMENT - len(head)))
        with pytest.raises(CodecError, match=match):
            open_journal(tmp_path / name / "raft.journal")


def test_delete_entries_from_ends_the_log_without_truncating(tmp_path):
    path = tmp_path / "raft.journal"
    j = open_journal(path)
    added = fill(j, 30, size=1000)  # several segments
    assert len(j._live) > 2
    seg, offset = record_at(j, 4)
    j.deleteEntriesFrom(4)
    j.deleteEntriesFrom(40)  # past the end: nothing
    assert entries(j) == added[:4]
    j._settle()  # (the worker may be allocating a spare meanwhile)
    assert all(p.stat().st_size == SEGMENT for p in segment_files(tmp_path))
    assert seg.read_bytes()[offset:offset + RECORD] == segments.marker(j._live[-1].epoch)
    assert len(j._live) == 1 and len(j._free) >= 2  # the later ones, free at once
    j.add(b"new", 5, 2)  # a new leader's entry replaces the old 5th, in a fresh segment
    assert record_at(j, 4)[1] == DATA
    assert entries(open_journal(crashed_copy(tmp_path, "crash"))) == added[:4] + [(b"new", 5, 2)]
    j._destroy()
    assert entries(open_journal(path)) == added[:4] + [(b"new", 5, 2)]


def test_a_later_segment_replaces_the_log_where_a_lost_end_marker_left_it(tmp_path):
    """A power loss can keep the records a truncation's end marker covered (the marker never
    reached the disk) and the new leader's entries written after it, in a later segment: the
    later segment wins from its first index on."""
    path = tmp_path / "raft.journal"
    j = open_journal(path)
    added = fill(j, 8)
    seg, offset = record_at(j, 4)
    header = seg.read_bytes()[offset:offset + RECORD]
    j.deleteEntriesFrom(4)
    new = fill(j, 2, first=5, term=2)
    j._destroy()
    with open(seg, "r+b") as f:  # the marker lost: the old records 5..8 are back
        f.seek(offset)
        f.write(header)
    damage: list[str] = []
    assert entries(open_journal(path, on_damage=damage.append)) == added[:4] + new
    assert damage == []


def test_delete_entries_to_retires_whole_segments_for_reuse(tmp_path):
    path = tmp_path / "raft.journal"
    j = open_journal(path, fsync="always")
    added = fill(j, 30, first=3, size=1000)
    j._settle()
    files = {p: p.stat().st_ino for p in segment_files(tmp_path)}
    j.deleteEntriesTo(20)
    assert entries(j) == added[20:]  # in memory at once; segments freed in the background
    j._settle()
    assert j._free and not j._retired and all(s.first <= 23 for s in j._live[:1])
    for k in range(200):  # many compactions: segments come back round, no file is created
        fill(j, 5, first=33 + 5 * k, size=1000)
        j.deleteEntriesTo(len(j) - 3)
    j._settle()
    assert {p: p.stat().st_ino for p in segment_files(tmp_path)} == files
    kept = entries(j)
    j.deleteEntriesTo(0)  # nothing to drop
    j._destroy()
    # the first segment may hold older records too: ShardGroup passes the snapshot's index
    assert entries(open_journal(path, first_index=kept[0][1])) == kept


def test_a_recycled_segment_never_returns_its_old_records(tmp_path):
    """Its records are summed with the segment's epoch, bumped on each use: an earlier use's
    record beyond the new tail fails its checksum, even one with the very same bytes (same index,
    term, command and offset) that would continue the log."""
    path = tmp_path / "raft.journal"
    j = open_journal(path)
    old = fill(j, 10, size=20)
    (seg, _), = {(s, 0) for s, _ in j._locs}
    j.clear()  # a snapshot from the leader replaces the log
    j._settle()
    assert j._free == [seg]
    new = fill(j, 5, size=20)  # the same entries as the first five: the same bytes at the same offsets
    assert new == old[:5] and j._live == [seg]
    data = seg.path.read_bytes()
    offset = j._locs[4][1] + RECORD + len(new[4][0])  # the old sixth record, still there
    assert data[offset + 4:offset + RECORD] == struct.pack("<IQQ", len(old[5][0]), 6, 1)
    assert data[offset + RECORD:offset + RECORD + len(old[5][0])] == old[5][0]
    assert entries(open_journal(crashed_copy(tmp_path, "crash"))) == new  # as after kill -9
    j._destroy()
    assert entries(open_journal(path)) == new


def _header(state: int, epoch: int) -> bytes:
    fields = SEG_HEADER.pack(SEG_MAGIC, 1, state, epoch, 0)[:-8]
    return fields + struct.pack("<Q", xxhash.xxh3_64_intdigest(fields))


@pytest.mark.parametrize("step", ["take", "free"])
def test_a_crash_mid_recycle_at_every_byte_of_the_header_keeps_the_log(tmp_path, caplog, step):
    """Recycling rewrites one segment header: ``take`` (a free segment gets a new epoch and
    becomes live, before its first record) and ``free`` (a retired segment, all of its entries
    below the snapshot, is marked free). A crash leaves that header written up to any byte.
    Every such state opens to the same log, reports no damage, and takes appends that survive
    the next open: a torn header fails its checksum and reads as free, and a new epoch with no
    record of its own holds nothing (the old records fail its checksum)."""
    path = tmp_path / "raft.journal"
    j = open_journal(path)
    fill(j, 40, size=1000)  # several 16 KiB segments
    covered = 25
    j.deleteEntriesTo(covered)  # a compaction: the segments below entry 26 retire
    j._settle()
    kept = entries(j)
    if step == "take":
        seg = j._free[-1]  # the one the next _take pops
        new = _header(segments.LIVE, j._epoch + 1)
    else:  # a snapshot past the first live segment: the crash came while marking it free
        seg = j._live[0]
        kept = [e for e in kept if e[1] > seg.last]
        new = _header(segments.FREE, seg.epoch)
    first_index = kept[0][1]
    before = seg.path.read_bytes()[:SEG_HEADER.size]
    j._destroy()
    caplog.set_level(logging.INFO, logger="kvps.raft")
    for cut in range(SEG_HEADER.size + 1):
        crashed = crashed_copy(tmp_path, f"cut-{cut}")
        with open(crashed.with_name(seg.path.name), "r+b") as f:
            f.write(new[:cut] + before[cut:])
        damage: list[str] = []
        j2 = open_journal(crashed, first_index=first_index, on_damage=damage.append)
        assert entries(j2) == kept and not damage, (cut, step)
        more = fill(j2, 8, first=kept[-1][1] + 1, size=1000)  # across a segment end: takes one
        j2._destroy()
        assert entries(open_journal(crashed, first_index=first_index)) == kept + more, (cut, step)


def test_a_stale_tmp_file_is_removed_at_open(tmp_path):
    path = tmp_path / "raft.journal"
    j = open_journal(path)
    added = fill(j, 3)
    j._destroy()
    (tmp_path / "raft.journal.tmp").write_bytes(MAGIC + b"half a rewrite")
    (tmp_path / "raft.journal.meta.tmp").write_bytes(b"half a meta")
    assert entries(open_journal(path)) == added
    assert not list(tmp_path.glob("*.tmp"))


def test_clear(tmp_path):
    path = tmp_path / "raft.journal"
    j = open_journal(path)
    fill(j, 30, size=1000)
    j.clear()
    j._settle()  # (a spare segment the worker creates has its size once allocated)
    assert len(j) == 0 and all(p.stat().st_size == SEGMENT for p in segment_files(tmp_path))
    assert entries(open_journal(crashed_copy(tmp_path, "crash"))) == []  # no entry comes back
    j.add(b"a", 50, 4)
    j._destroy()
    assert entries(open_journal(path)) == [(b"a", 50, 4)]


# ---- meta -----------------------------------------------------------------------------------------

def test_meta_round_trip(tmp_path):
    path = tmp_path / "raft.journal"
    j = open_journal(path)  # policy never: the commit index is written by onOneSecondTimer
    assert (j.getCurrentTerm(), j.getVotedForNodeId(), j.getRaftCommitIndex()) == (0, None, 1)
    fill(j, 10)
    j.setCurrentTerm(5, "127.0.0.1:7201")
    j.setRaftCommitIndex(7)
    assert open_journal(path).getRaftCommitIndex() == 1  # written on the one-second timer ...
    assert open_journal(path).getVotedForNodeId() == "127.0.0.1:7201"  # ... the vote at once
    j.onOneSecondTimer()
    again = open_journal(path)
    assert (again.getCurrentTerm(), again.getVotedForNodeId(), again.getRaftCommitIndex()) == \
        (5, "127.0.0.1:7201", 7)
    j.setCurrentTerm(6, None)
    assert open_journal(path).getVotedForNodeId() is None
    j.setRaftCommitIndex(8)
    j._destroy()  # closing writes what the timer had not yet
    assert open_journal(path).getRaftCommitIndex() == 8


def test_commit_index_past_the_journal_is_clamped(tmp_path, caplog):
    path = tmp_path / "raft.journal"
    j = open_journal(path)
    fill(j, 10)
    j.setRaftCommitIndex(10)
    j.flush()
    seg, last = record_at(j, 9)
    j._destroy()
    with open(seg, "r+b") as f:  # the tail a power loss took, while the meta survived
        f.seek(last + RECORD + 50)
        f.write(bytes(100))
    with caplog.at_level(logging.WARNING, logger="kvps.raft"):
        assert open_journal(path).getRaftCommitIndex() == 9
    assert "commit index 10 is past the journal's last entry 9" in caplog.text


@pytest.mark.parametrize("damage", ["flip-both", "truncate", "magic-both", "empty", "version-1-flip"])
def test_corrupt_meta_is_refused(tmp_path, damage):
    path = tmp_path / "raft.journal"
    j = open_journal(path)
    j.setCurrentTerm(3, "a:1")
    j._destroy()
    meta = tmp_path / "raft.journal.meta"
    data = bytearray(meta.read_bytes())
    if damage == "flip-both":  # a byte of each slot's body
        data[30] ^= 1
        data[SLOT + 30] ^= 1
    elif damage == "truncate":
        data = data[:-2]
    elif damage == "magic-both":
        data[:8] = data[SLOT:SLOT + 8] = b"XXXXXXXX"
    elif damage == "empty":
        data = bytearray()
    else:  # an older kvps's format-1 file, damaged
        data = bytearray(v1_meta(3, "a:1", 1))
        data[-1] ^= 1
    meta.write_bytes(bytes(data))
    with pytest.raises(CodecError, match="raft journal meta"):
        open_journal(path)


def v1_meta(term: int, vote: str | None, commit: int) -> bytes:
    """A meta file as kvps wrote it before format 2 (one record, replaced by rename)."""
    body = struct.pack("<QQi", term, commit, -1 if vote is None else len(vote)) + (vote or "").encode()
    return struct.pack("<8sHHII", META_MAGIC, 1, 0, zlib.crc32(body), len(body)) + body


def test_a_torn_newest_meta_slot_falls_back_to_the_state_before_it(tmp_path):
    """The two slots are written in turn: a write torn by a power loss leaves the other slot,
    the state before that write."""
    path = tmp_path / "raft.journal"
    j = open_journal(path)
    j.setCurrentTerm(4, "a:1")
    j.setCurrentTerm(5, None)  # the newest write
    j._destroy()
    meta = tmp_path / "raft.journal.meta"
    inode = os.stat(meta).st_ino
    data = bytearray(meta.read_bytes())
    assert len(data) == 2 * SLOT
    again = open_journal(path)
    assert (again.getCurrentTerm(), again.getVotedForNodeId()) == (5, None)
    again._destroy()
    newest = max((0, SLOT), key=lambda at: struct.unpack_from("<Q", data, at + 20)[0])
    data[newest + 25] ^= 0xFF  # torn: its CRC fails
    meta.write_bytes(bytes(data))
    back = open_journal(path)
    assert (back.getCurrentTerm(), back.getVotedForNodeId()) == (4, "a:1")
    back.setCurrentTerm(6, "b:2")  # and writing goes on in place
    back._destroy()
    assert os.stat(meta).st_ino == inode
    last = open_journal(path)
    assert (last.getCurrentTerm(), last.getVotedForNodeId()) == (6, "b:2")


def test_a_format_1_meta_file_is_read_and_converted(tmp_path):
    path = tmp_path / "raft.journal"
    meta = tmp_path / "raft.journal.meta"
    meta.write_bytes(v1_meta(7, "127.0.0.1:7201", 3))
    j = open_journal(path)
    assert (j.getCurrentTerm(), j.getVotedForNodeId()) == (7, "127.0.0.1:7201")
    assert os.path.getsize(meta) == 2 * SLOT
    j.setCurrentTerm(8, None)
    j._destroy()
    again = open_journal(path)
    assert (again.getCurrentTerm(), again.getVotedForNodeId()) == (8, None)


def test_term_and_vote_are_overwritten_in_place_never_renamed(tmp_path):
    """Renaming a new meta file over the old one freed a block per vote, and with ``discard``
    that waited in the device queue behind heavy writeback, on the tick thread."""
    path = tmp_path / "raft.journal"
    j = open_journal(path, "interval")
    inode = os.stat(tmp_path / "raft.journal.meta").st_ino
    for term in range(1, 6):
        j.setCurrentTerm(term, f"n:{term}")
    j.setRaftCommitIndex(1)
    j.flush()
    assert os.stat(tmp_path / "raft.journal.meta").st_ino == inode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raft.journal.meta"]  # (no entry yet)
    j._destroy()


# ---- fsync policies -------------------------------------------------------------------------------

class SyncCounter:
    def __init__(self, monkeypatch) -> None:
        self.fdatasync = 0
        self.fsync = 0
        self.on_test_thread = 0  # calls made by the thread that runs the test (pysyncobj's, here)
        self._test_thread = threading.current_thread()
        self.event = threading.Event()
        monkeypatch.setattr(disk, "fdatasync", self._fdatasync)
        monkeypatch.setattr(disk, "fsync", self._fsync)

    def _fdatasync(self, fd: int) -> None:
        self.fdatasync += 1
        self.on_test_thread += threading.current_thread() is self._test_thread
        self.event.set()

    def _fsync(self, fd: int) -> None:
        self.fsync += 1
        self.on_test_thread += threading.current_thread() is self._test_thread

    def take(self) -> tuple[int, int]:
        counts = (self.fdatasync, self.fsync)
        self.fdatasync = self.fsync = 0
        return counts


def test_never_syncs_nothing(tmp_path, monkeypatch):
    counter = SyncCounter(monkeypatch)
    j = open_journal(tmp_path / "raft.journal", "never")
    fill(j, 3)
    j.deleteEntriesFrom(2)
    j.deleteEntriesTo(1)
    j.setRaftCommitIndex(2)
    j.onOneSecondTimer()
    j.setCurrentTerm(1, "a:1")
    j._destroy()
    assert counter.take() == (0, 0)


def test_always_syncs_each_change_before_returning(tmp_path, monkeypatch):
    counter = SyncCounter(monkeypatch)
    j = open_journal(tmp_path / "raft.journal", "always")
    assert counter.take() == (0, 2)  # the new meta file, and the directory
    fill(j, 3)  # the first append creates a segment: the file and the directory
    assert counter.take() == (3, 2)  # then one fdatasync per append
    j.deleteEntriesFrom(2)
    assert counter.take() == (1, 0)
    j.deleteEntriesTo(1)
    j._settle()  # nothing retired: the segment still holds the entry kept
    assert counter.take() == (0, 0)
    fill(j, 30, first=2, size=1000)
    j._settle()
    counter.take()
    before = counter.on_test_thread
    j.deleteEntriesTo(25)
    assert counter.on_test_thread == before  # the tick thread syncs nothing for a compaction
    j._settle()  # the worker fsyncs the directory (the snapshot's rename first), nothing else
    assert counter.take() == (0, 1)
    j.setCurrentTerm(1, "a:1")
    assert counter.take() == (1, 0)  # the meta slot written in place, before pysyncobj sends anything
    j.setRaftCommitIndex(2)
    j.onOneSecondTimer()  # not on the tick thread: the background thread writes it
    assert counter.take()[0] == 0
    path = tmp_path / "raft.journal"
    wait_for(lambda: open_journal(path).getRaftCommitIndex() == 2
             and j._meta._synced == j._meta._changes, 10, "the commit index on disk, synced")
    counter.take()
    j._destroy()
    assert counter.take()[0] == 1  # nothing left to sync but the end marker a clean stop writes


def test_interval_syncs_in_the_background(tmp_path, monkeypatch):
    counter = SyncCounter(monkeypatch)
    j = open_journal(tmp_path / "raft.journal", "interval", fsync_interval=0.01)
    counter.take()
    counter.event.clear()
    fill(j, 3)
    before = counter.on_test_thread
    j.setCurrentTerm(1, "a:1")
    assert counter.on_test_thread == before  # written in place; no sync on the calling thread
    wait_for(lambda: j._meta._synced == j._meta._changes, 10, "the background fdatasync of the meta")
    assert counter.fdatasync >= 2  # the journal's and the meta file's
    synced = counter.fdatasync
    j._sync()  # nothing changed since: no fdatasync
    assert counter.fdatasync == synced
    j.add(b"last", 4, 1)
    j._destroy()  # closing syncs what the thread has not
    assert j._synced == j._changes


def open_fds(folder: Path) -> list[str]:
    """The targets of this process's descriptors that lie in ``folder`` (the journal's own files:
    counting every descriptor of the process also counted other tests' sockets and threads)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith(str(folder)):
            out.append(target)
    return sorted(out)


def test_recycling_opens_no_new_files(tmp_path):
    """In a steady append + compaction loop the journal's own descriptors stay the same files:
    retired segments come back as the next ones, none is created or unlinked."""
    j = open_journal(tmp_path / "raft.journal", "interval", fsync_interval=3600)
    fill(j, 40, size=1000)
    j.deleteEntriesTo(len(j) - 2)
    j._settle()
    before = open_fds(tmp_path)
    for k in range(50):
        fill(j, 10, first=41 + 10 * k, size=1000)
        j.deleteEntriesTo(len(j) - 2)
        j._settle()  # (compactions are far apart: the worker has freed the segments by the next)
    assert open_fds(tmp_path) == before
    kept = entries(j)
    j._destroy()
    assert open_fds(tmp_path) == []
    assert entries(open_journal(tmp_path / "raft.journal", first_index=kept[0][1])) == kept


def test_a_reserve_creates_the_pool_ahead_and_a_longer_log_then_creates_nothing(tmp_path):
    """``reserve(n)``: the worker makes segments until the pool holds n; appends and compactions
    within them then never create a file (no fresh page cache in the middle of a run), retired
    ones are kept up to the reserve, and a smaller reserve later shrinks nothing."""
    j = open_journal(tmp_path / "raft.journal", "interval", fsync_interval=3600)
    fill(j, 3, size=1000)
    j._settle()
    assert len(segment_files(tmp_path)) <= 2  # no reserve: the active one and at most a spare
    j.reserve(6)
    j._settle()
    made = {p: p.stat().st_ino for p in segment_files(tmp_path)}
    assert len(made) == 6 and len(j._live) + len(j._free) == 6
    j.reserve(3)  # never shrinks
    j._settle()
    # the log spans at most 5 of them (16 KiB segments, ~1 KiB records), then compacts
    for k in range(20):
        fill(j, 40, first=4 + 40 * k, size=1000)
        assert len(j._live) <= 5
        j.deleteEntriesTo(len(j) - 2)
        j._settle()
        assert {p: p.stat().st_ino for p in segment_files(tmp_path)} == made, k
    kept = entries(j)
    j._destroy()
    assert entries(open_journal(tmp_path / "raft.journal", first_index=kept[0][1])) == kept


def test_an_oversized_record_gets_a_segment_of_its_own(tmp_path):
    path = tmp_path / "raft.journal"
    j = open_journal(path, "always")
    added = fill(j, 2) + [(b"x" * (3 * SEGMENT), 3, 1)]
    j.add(*added[-1])
    big = j._locs[-1][0]
    assert big.size > SEGMENT and big.size % (1 << 20) == 0
    added += fill(j, 2, first=4)
    j._destroy()
    assert entries(open_journal(path)) == added
    j = open_journal(path)
    j.deleteEntriesTo(len(j))  # (the rest of its megabyte took the next records too)
    j._settle()
    assert not big.path.exists()  # unlinked once retired, never reused
    j._destroy()


def test_flush_syncs_under_every_policy(tmp_path, monkeypatch):
    counter = SyncCounter(monkeypatch)
    j = open_journal(tmp_path / "raft.journal", "never")
    fill(j, 1)
    j.flush()
    assert counter.take() == (1, 0)


# ---- retiring segments off the tick thread --------------------------------------------------------

def after_a_crash(path: Path, first_index: int) -> list[tuple[bytes, int, int]]:
    """The entries a restart would see if the process died now: the files copied as they are,
    opened with the snapshot's previous index, as ShardGroup does."""
    crashed = path.parent / "crashed"
    shutil.rmtree(crashed, ignore_errors=True)
    j = open_journal(crashed_copy(path.parent, "crashed"), first_index=first_index)
    try:
        return entries(j)
    finally:
        j._destroy()


@pytest.mark.parametrize("policy", ["interval", "always"])
def test_delete_entries_to_does_not_wait_for_the_disk(tmp_path, monkeypatch, policy):
    """Every fsync sleeps (5 s, unless released): deleteEntriesTo returns while the segment
    worker is still asleep in one, and (``interval``) appends and truncations go on meanwhile."""
    path = tmp_path / "raft.journal"
    j = open_journal(path, policy, fsync_interval=3600)
    model = fill(j, 30, size=1000)
    j._settle()
    sleeping, woken, release = threading.Event(), threading.Event(), threading.Event()
    waiters: list[str] = []

    def slow_fsync(fd: int) -> None:
        waiters.append(threading.current_thread().name)
        sleeping.set()
        release.wait(5)
        woken.set()

    monkeypatch.setattr(disk, "fsync", slow_fsync)
    monkeypatch.setattr(disk, "fdatasync", slow_fsync)
    j.deleteEntriesTo(24)
    assert not woken.is_set(), "deleteEntriesTo waited for an fsync"
    model = model[24:]
    assert entries(j) == model
    wait_for(sleeping.is_set, 10, "the worker to sleep in an fsync")
    if policy == "interval":
        model += fill(j, 3, first=31)
        j.deleteEntriesFrom(4)
        model = model[:4]
    assert not woken.is_set()
    assert all(name.startswith("kvps-journal-segments") for name in waiters), waiters
    release.set()
    j._settle()
    monkeypatch.undo()
    j._destroy()
    assert entries(open_journal(path, first_index=model[0][1])) == model


def test_open_drops_the_records_the_snapshot_covers(tmp_path, caplog):
    path = tmp_path / "raft.journal"
    j = open_journal(path)
    added = fill(j, 10)
    j._destroy()
    with caplog.at_level(logging.INFO, logger="kvps.raft"):
        j = open_journal(path, first_index=7)
    assert "dropping entries 1..6, older than the snapshot's previous entry 7" in caplog.text
    assert entries(j) == added[6:]
    j.add(b"next", 11, 1)
    j._destroy()
    assert entries(open_journal(path, first_index=7)) == added[6:] + [(b"next", 11, 1)]
    j = open_journal(path, first_index=50)  # all of it older than the snapshot
    assert len(j) == 0
    j._settle()
    assert len(j._free) == len(segment_files(tmp_path))  # every segment free for reuse
    j.add(b"dump prev", 50, 2)
    j._destroy()
    assert entries(open_journal(path, first_index=50)) == [(b"dump prev", 50, 2)]
    assert entries(open_journal(path, first_index=3)) == [(b"dump prev", 50, 2)]


# ---- the list model -------------------------------------------------------------------------------

class JournalModel(RuleBasedStateMachine):
    """The journal behaves like the list pysyncobj keeps, across reopens and crashes, with small
    segments (records cross their ends often), retired segments freed and reused at any point."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="kvps-journal-"))
        self.path = self.dir / "raft.journal"
        self.journal = self.open()
        self.model: list[tuple[bytes, int, int]] = []
        self.next_index = 1  # of the next entry while the model is empty
        self.term = 1
        self.covered = 0  # the snapshot's previous index: records below it may come back
        self.released_to = 0  # entries up to this index have left memory (release)

    def open(self) -> RaftJournal:
        return open_journal(self.path, "interval", fsync_interval=3600, segment_bytes=8192,
                            first_index=self.first_index() if hasattr(self, "model") else 0)

    def teardown(self) -> None:
        self.journal._destroy()
        shutil.rmtree(self.dir, ignore_errors=True)

    def first_index(self) -> int:
        """The snapshot's previous entry as pysyncobj would have it: the first one kept."""
        return self.model[0][1] if self.model else self.next_index

    @rule(command=st.one_of(st.binary(max_size=64), st.binary(min_size=1000, max_size=1500)),
          term_step=st.integers(0, 1))
    def add(self, command, term_step):
        self.term += term_step
        entry = (command, self.model[-1][1] + 1 if self.model else self.next_index, self.term)
        self.journal.add(*entry)
        self.model.append(entry)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def delete_from(self, data):
        cut = data.draw(st.integers(0, len(self.model)))
        if cut == 0:  # the next entry takes the first one's index
            self.next_index = self.model[0][1]
        self.journal.deleteEntriesFrom(cut)
        if cut < len(self.model):  # an entry appended at a dropped index is in memory again
            self.released_to = min(self.released_to, self.model[cut][1] - 1)
        del self.model[cut:]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def delete_to(self, data):
        cut = data.draw(st.integers(1, len(self.model)))
        if cut == len(self.model):
            self.next_index = self.model[-1][1] + 1
        self.journal.deleteEntriesTo(cut)
        self.model = self.model[cut:]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def release(self, data):  # what ShardGroup does once entries are applied and held by all
        upto = data.draw(st.integers(self.model[0][1] - 1, self.model[-1][1] + 1))
        self.journal.release_to(upto)
        self.released_to = max(self.released_to, min(upto, self.model[-1][1]))  # none past the log

    @rule()
    def settle(self):
        self.journal._settle()

    @rule()
    def clear(self):
        if self.model:
            self.next_index = self.model[-1][1] + 1
        self.journal.clear()
        self.model = []
        self.released_to = 0

    @rule()
    def reopen(self):
        self.journal._destroy()
        self.journal = self.open()
        self.released_to = 0  # read back into memory
        assert entries(self.journal) == self.model  # a clean close left nothing to drop

    @rule()
    def crash(self):
        assert after_a_crash(self.path, self.first_index()) == self.model

    @invariant()
    def same_as_the_model(self):
        assert entries(self.journal) == self.model  # released commands read back from segments
        assert len(self.journal) == len(self.model)

    @invariant()
    def payload_memory_accounted(self):
        j = self.journal
        assert j._held_from == sum(1 for _, index, _ in self.model if index <= self.released_to)
        assert [len(c) for c, _, _ in j[:]] == [len(c) for c, _, _ in self.model]
        assert j.held_bytes == sum(len(c) for c, _, _ in self.model[j._held_from:])
        for k, (command, _, _) in enumerate(j[:]):
            assert (type(command) is Released) == (k < j._held_from and len(command) >= RELEASE_MIN_BYTES)


JournalModel.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                          derandomize=True)
test_journal_against_a_list = JournalModel.TestCase


# ---- injection ------------------------------------------------------------------------------------

def test_using_journal_replaces_create_journal_for_registered_paths_only(tmp_path):
    mine, theirs = tmp_path / "mine.journal", tmp_path / "theirs.journal"
    with using_journal(mine, fsync="always", fsync_interval=0.05):
        ours = pysyncobj.syncobj.createJournal(str(mine))
        stock = pysyncobj.syncobj.createJournal(str(theirs))
        memory = pysyncobj.syncobj.createJournal(None)
    assert isinstance(ours, RaftJournal) and ours._policy == "always"
    assert isinstance(stock, FileJournal) and not isinstance(memory, RaftJournal)
    ours._destroy()
    stock._destroy()
    # outside the block the path is no longer ours
    stock = pysyncobj.syncobj.createJournal(str(mine) + ".2")
    assert isinstance(stock, FileJournal)
    stock._destroy()


def test_using_journal_fails_if_pysyncobj_never_asked(tmp_path):
    with pytest.raises(RuntimeError, match="did not open"), \
            using_journal(tmp_path / "raft.journal", fsync="never", fsync_interval=0.05):
        pass


# ---- config ---------------------------------------------------------------------------------------

def test_config_fsync_fields():
    with pytest.raises(ConfigError) as err:
        RaftConfig(fsync="sometimes").validate()
    assert err.value.field == "fsync"
    with pytest.raises(ConfigError) as err:
        RaftConfig(fsync_interval=0).validate()
    assert err.value.field == "fsync_interval"
    RaftConfig(fsync="always").validate()


def test_config_fsync_round_trips_through_cluster_toml(tmp_path):
    nodes = (NodeConfig(id=0),)
    default = ClusterConfig(nodes=nodes, shards=1, replicas=1)
    assert "fsync" not in dump_cluster(default)  # defaults are not pinned in the file
    cfg = ClusterConfig(nodes=nodes, shards=1, replicas=1,
                        raft=RaftConfig(fsync="always", fsync_interval=0.2))
    path = tmp_path / "cluster.toml"
    path.write_text(dump_cluster(cfg))
    loaded = load_cluster(path)
    assert (loaded.raft.fsync, loaded.raft.fsync_interval) == ("always", 0.2)


# ---- a real group ---------------------------------------------------------------------------------

def test_group_journals_survive_a_full_restart(tmp_path):
    """All three replicas stopped and started again from their journals alone (fsync always,
    compaction on so that deleteEntriesTo runs): same sequence, terms and votes reloaded."""
    from test_raft_group import FAST, Cluster

    raft = RaftConfig(**{**FAST.__dict__, "fsync": "always", "compact_bytes": 48 * 1024})
    c = Cluster(tmp_path, raft=raft)
    try:
        c.start_all()
        for i in range(30):
            c.propose(f"{i}-".encode() + b"z" * 4000)
        reference = c.wait_converged()
        for address, group in c.groups.items():
            assert isinstance(group._SyncObj__raftLog, RaftJournal), address
            wait_for(lambda g=group: g._SyncObj__raftLog[0][1] > 1, 20, f"compaction on {address}")
        terms = {a: g.term() for a, g in c.groups.items()}
        c.stop_all()
        for address in c.addresses:
            d = tmp_path / address.replace(":", "_")
            assert not (d / "raft.journal").exists()
            assert all(p.read_bytes()[:8] == SEG_MAGIC for p in segment_files(d))
        for address in c.addresses:
            c.start(address)
        assert all(c.groups[a].term() >= terms[a] for a in c.addresses)
        c.propose(b"after")
        assert c.wait_converged() == reference + [b"after"]
    finally:
        c.stop_all()


def test_a_group_restarted_in_a_compaction_crash_window_keeps_its_entries(tmp_path):
    """The journal on disk starts long before the snapshot's entries (a segment is retired only
    once the snapshot covers all of it; and the crash window before it is). pysyncobj clears such a
    journal at start, keeping only the snapshot's two entries: every entry after the snapshot
    would be gone from this replica. ShardGroup passes the snapshot's previous index to the
    journal, which drops the older records at open instead."""
    from test_raft_group import FAST, Cluster

    from kvps.raft import snapshot_file

    raft = RaftConfig(**{**FAST.__dict__, "compact_bytes": 48 * 1024})
    c = Cluster(tmp_path, n=1, raft=raft)
    try:
        c.start_all()
        (address,) = c.addresses
        group = c.groups[address]
        for i in range(16):
            c.propose(f"{i}-".encode() + b"z" * 4000)
        wait_for(lambda: group.status()["compactions"]["succeeded"] >= 1 and
                 not group._compaction.running, 20, "a compaction")
        for i in range(3):  # entries after the snapshot: only the journal holds them
            c.propose(f"after-{i}".encode())
        reference = c.wait_converged()
        c.stop_all()

        d = tmp_path / address.replace(":", "_")
        snap = snapshot_file.read(d / "raft.snapshot")
        journal = open_journal(d / "raft.journal", first_index=snap.prev_entry[1])
        kept = entries(journal)
        journal._destroy()
        assert kept[0][1] == snap.prev_entry[1] and kept[-1][1] > snap.last_entry[1] + 2
        for p in segment_files(d):  # as if no segment had been retired: from entry 1 on
            p.unlink()
        old = open_journal(d / "raft.journal")
        for index in range(1, kept[0][1]):
            old.add(b"covered by the snapshot", index, 1)
        for entry in kept:
            old.add(*entry)
        old._destroy()

        c.start(address)
        machine = c.machines[address]
        wait_for(lambda: machine.sequence() == reference, 20, "the entries after the snapshot")
        c.propose(b"last")
        wait_for(lambda: machine.sequence() == reference + [b"last"], 20, "a new entry")
    finally:
        c.stop_all()


def test_kvps_up_takes_fsync():
    from kvps.cli.main import build_parser

    assert build_parser().parse_args(["up", "--fsync", "always"]).fsync == "always"
    assert build_parser().parse_args(["up"]).fsync == RaftConfig.fsync
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--fsync", "sometimes"])
