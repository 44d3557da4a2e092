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

import pysyncobj.syncobj
import pytest
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
from kvps.errors import CodecError, ConfigError
from kvps.raft import disk
from kvps.raft import journal as journal_module
from kvps.raft import journal_rewrite
from kvps.raft.journal import MAGIC, RaftJournal, using_journal
from kvps.raft.meta_file import META_MAGIC, SLOT

HEADER = 16  # '<8sHHI'
RECORD = 24  # '<IIQQ'


class IOErrorSeen(Exception):
    pass


def raise_instead_of_exit(exc: OSError, what: str) -> None:
    raise IOErrorSeen(what) from exc


def open_journal(path: Path, fsync: str = "never", **kwargs) -> RaftJournal:
    kwargs.setdefault("on_io_error", raise_instead_of_exit)
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

def test_version_1_journal_keeps_crc32_records_and_new_ones_get_xxh3(tmp_path, monkeypatch):
    """A journal written before XXH3 (version 1, CRC-32 records) opens, appends and rewrites in
    its own version; a new file is version 2. A record whose sum is computed the other way is a
    torn tail, not a good record."""
    old = tmp_path / "old" / "raft.journal"
    old.parent.mkdir()
    monkeypatch.setattr(journal_module, "VERSION", 1)
    j = open_journal(old)
    added = fill(j, 3)
    j._destroy()
    monkeypatch.undo()
    assert struct.unpack_from("<H", old.read_bytes(), 8)[0] == 1
    j = open_journal(old)
    assert entries(j) == added
    added += fill(j, 2, first=4)
    j.deleteEntriesTo(2)  # drops the first two; the rewrite copies records: still version 1
    j._destroy()
    data = old.read_bytes()
    assert struct.unpack_from("<H", data, 8)[0] == 1
    crc, length, index, term = struct.unpack_from("<IIQQ", data, HEADER)
    command = data[HEADER + RECORD:HEADER + RECORD + length]
    assert crc == zlib.crc32(command, zlib.crc32(data[HEADER + 4:HEADER + RECORD]))
    assert entries(open_journal(old)) == added[2:]

    new = tmp_path / "raft.journal"
    j = open_journal(new)
    fill(j, 2)
    j._destroy()
    data = bytearray(new.read_bytes())
    assert struct.unpack_from("<H", data, 8)[0] == 2
    struct.pack_into("<H", data, 8, 1)  # relabel as version 1: the XXH3 sums no longer match
    new.write_bytes(bytes(data))
    assert entries(open_journal(new)) == []


def test_round_trip_entries_and_layout(tmp_path):
    path = tmp_path / "raft.journal"
    j = open_journal(path)
    added = fill(j, 5, first=7, term=2)
    j.add(b"", 12, 3)  # empty commands are legal
    added.append((b"", 12, 3))
    assert entries(j) == added and len(j) == 6
    assert j[-1] == (b"", 12, 3) and j[1:3] == added[1:3]  # pysyncobj indexes and slices
    j._destroy()
    data = path.read_bytes()
    assert data[:8] == MAGIC
    assert len(data) == HEADER + sum(RECORD + len(c) for c, _, _ in added)
    _crc, length, index, term = struct.unpack_from("<IIQQ", data, HEADER)
    assert (length, index, term) == (100, 7, 2)
    j = open_journal(path)
    assert entries(j) == added
    j.add(b"after", 13, 3)  # appends continue at the end of what was read
    j._destroy()
    assert entries(open_journal(path))[-1] == (b"after", 13, 3)


def test_torn_tail_at_every_byte_of_the_last_record(tmp_path, caplog):
    path = tmp_path / "raft.journal"
    j = open_journal(path)
    added = fill(j, 3, size=40)
    j._destroy()
    whole = path.read_bytes()
    last = len(whole) - (RECORD + len(added[-1][0]))
    for cut in range(last, len(whole)):
        torn = tmp_path / f"cut-{cut}" / "raft.journal"
        torn.parent.mkdir()
        torn.write_bytes(whole[:cut])
        caplog.clear()
        damage: list[str] = []
        with caplog.at_level(logging.WARNING, logger="kvps.raft"):
            j = open_journal(torn, on_damage=damage.append)
        assert entries(j) == added[:2], cut
        assert damage == [], cut  # a crash's footprint: the replica goes on voting
        assert not list(torn.parent.glob("*.damaged-*"))
        assert os.path.getsize(torn) == last  # truncated to the last good record
        if cut > last:
            assert f"dropped {cut - last} bytes" in caplog.text
        j.add(*added[2])  # the log goes on where the good records end
        j._destroy()
        assert entries(open_journal(torn)) == added


def test_damage_in_the_middle_keeps_the_records_before_it_and_is_reported(tmp_path, caplog):
    """A complete record failing its checksum with records after it is damage, not a torn tail:
    the entries after it may have been acknowledged, so the group must learn it (it then
    recovers before it votes) before anything is dropped, and the dropped bytes are kept."""
    path = tmp_path / "raft.journal"
    j = open_journal(path)
    added = fill(j, 5)
    offsets = list(j._offsets)
    j._destroy()
    whole = path.read_bytes()
    for where in (offsets[2] + RECORD + 10,  # a command byte
                  offsets[2] + 8,  # the index (covered by the checksum)
                  offsets[2]):  # the checksum itself
        data = bytearray(whole)
        data[where] ^= 0x40
        bad = tmp_path / f"bad-{where}" / "raft.journal"
        bad.parent.mkdir()
        bad.write_bytes(bytes(data))
        damage: list[str] = []

        def on_damage(what: str) -> None:  # called before the file is cut
            assert os.path.getsize(bad) == len(whole)
            damage.append(what)
        with caplog.at_level(logging.WARNING, logger="kvps.raft"):
            j = open_journal(bad, on_damage=on_damage)
        assert entries(j) == added[:2]
        assert os.path.getsize(bad) == offsets[2]
        assert len(damage) == 1 and f"offset {offsets[2]}" in damage[0]
        kept, = bad.parent.glob("raft.journal.damaged-*")
        assert kept.read_bytes() == bytes(data[offsets[2]:])
        j._destroy()
    assert "checksum mismatch" in caplog.text


def test_a_damaged_last_record_is_a_torn_tail(tmp_path):
    """The file's last record failing its checksum is what a crash mid-append leaves (its pages
    written out of order): truncated, not reported as damage."""
    path = tmp_path / "raft.journal"
    j = open_journal(path)
    added = fill(j, 3)
    last = j._offsets[-1]
    j._destroy()
    data = bytearray(path.read_bytes())
    data[last + RECORD + 5] ^= 0x01
    path.write_bytes(bytes(data))
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


def test_delete_entries_from_truncates(tmp_path):
    path = tmp_path / "raft.journal"
    j = open_journal(path)
    added = fill(j, 6)
    j.deleteEntriesFrom(4)
    j.deleteEntriesFrom(10)  # past the end: nothing
    assert entries(j) == added[:4]
    assert os.path.getsize(path) == j._offsets[-1] + RECORD + len(added[3][0])
    j.add(b"new", 5, 2)  # a new leader's entry replaces the old 5th
    j._destroy()
    assert entries(open_journal(path)) == added[:4] + [(b"new", 5, 2)]


def test_delete_entries_to_rewrites_by_rename(tmp_path):
    path = tmp_path / "raft.journal"
    j = open_journal(path, fsync="always")
    added = fill(j, 6, first=3)
    inode = os.stat(path).st_ino
    j.deleteEntriesTo(4)
    assert entries(j) == added[4:]  # in memory at once; the file is rewritten in the background
    j._wait_rewritten()
    assert os.stat(path).st_ino != inode  # a new file, renamed over the old one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raft.journal", "raft.journal.meta"]  # no tmp
    j.add(b"more", 9, 1)
    j.deleteEntriesTo(0)  # nothing to drop
    j._destroy()
    assert entries(open_journal(path)) == added[4:] + [(b"more", 9, 1)]


def test_delete_entries_to_cut_short_leaves_the_old_journal(tmp_path, monkeypatch):
    path = tmp_path / "raft.journal"
    errors: list[str] = []
    j = open_journal(path, "always", on_io_error=lambda exc, what: errors.append(what))
    added = fill(j, 6)

    def crash(src, dst):
        raise OSError(5, "simulated crash before the rename")

    monkeypatch.setattr(journal_module.os, "rename", crash)
    j.deleteEntriesTo(3)  # the tick thread is not the one that meets the error
    j._wait_rewritten()
    monkeypatch.undo()
    assert errors == [f"rewriting the journal into {path}.tmp"]
    assert (tmp_path / "raft.journal.tmp").exists()  # what a crash here leaves behind
    reopened = open_journal(path)  # as after a restart: the old journal, whole
    assert entries(reopened) == added
    assert not (tmp_path / "raft.journal.tmp").exists()
    reopened._destroy()
    # and where the snapshot is known, from its previous entry on (ShardGroup passes it)
    assert entries(open_journal(path, first_index=added[3][1])) == added[3:]


def test_a_stale_tmp_file_is_removed_at_open(tmp_path):
    path = tmp_path / "raft.journal"
    j = open_journal(path)
    added = fill(j, 3)
    j._destroy()
    (tmp_path / "raft.journal.tmp").write_bytes(MAGIC + b"half a rewrite")
    (tmp_path / "raft.journal.meta.tmp").write_bytes(b"half a meta")
    assert entries(open_journal(path)) == added
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raft.journal", "raft.journal.meta"]


def test_clear(tmp_path):
    path = tmp_path / "raft.journal"
    j = open_journal(path)
    fill(j, 3)
    j.clear()
    assert len(j) == 0 and os.path.getsize(path) == HEADER
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
    j._destroy()
    with open(path, "r+b") as f:  # the tail a power loss took, while the meta survived
        f.truncate(os.path.getsize(path) - 50)
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
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raft.journal", "raft.journal.meta"]
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
    assert counter.take() == (0, 4)  # the new files (meta, journal header): each file + directory
    fill(j, 3)
    assert counter.take() == (3, 0)  # one fdatasync per append
    j.deleteEntriesFrom(2)
    assert counter.take() == (1, 0)
    j.deleteEntriesTo(1)
    j._wait_rewritten()  # on the rewriter thread: the directory (the snapshot's rename first),
    assert counter.take() == (2, 2)  # the copy, the file before and the directory after the rename
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
    assert counter.take()[0] == 0  # nothing left to sync


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


def test_the_rewriter_closes_the_replaced_file(tmp_path):
    """Closing the replaced journal frees its blocks and waits for write-back in flight: the
    rewriter thread does it, not the tick thread."""
    j = open_journal(tmp_path / "raft.journal", "interval", fsync_interval=3600)
    added = fill(j, 4)
    before = open_fds(tmp_path)
    j.deleteEntriesTo(2)
    j._wait_rewritten()
    assert open_fds(tmp_path) == before  # the new file's descriptor replaced the old one's
    assert entries(j) == added[2:]
    j._destroy()
    assert entries(open_journal(tmp_path / "raft.journal")) == added[2:]


def test_flush_syncs_under_every_policy(tmp_path, monkeypatch):
    counter = SyncCounter(monkeypatch)
    j = open_journal(tmp_path / "raft.journal", "never")
    fill(j, 1)
    j.flush()
    assert counter.take() == (1, 0)


# ---- compaction rewrites off the tick thread ------------------------------------------------------

def is_rewriter() -> bool:
    return threading.current_thread().name.startswith("kvps-journal-rewrite")


class RewriteGate:
    """Stands in for the journal's fdatasync: holds the rewriter thread in its first one, after it
    copied the kept records into the new file and before it switches files, until ``release``.
    Other threads' fdatasyncs, and the rewriter's once released, pass straight through."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.opened = threading.Event()
        self.stuck = False

    def __call__(self, fd: int) -> None:
        if is_rewriter() and not self.opened.is_set():
            self.reached.set()
            if not self.opened.wait(30):
                self.stuck = True  # the test forgot to release: it fails on this flag

    def hold(self, j: RaftJournal, cut: int) -> None:
        """``j.deleteEntriesTo(cut)``, then wait for the rewriter to stop at the gate."""
        self.opened.clear()
        self.reached.clear()
        j.deleteEntriesTo(cut)
        wait_for(lambda: self.reached.is_set() or j._rewriter is None, 10, "the rewriter's copy")
        assert self.reached.is_set(), "the rewriter finished without syncing the new file"

    def release(self, j: RaftJournal) -> None:
        self.opened.set()
        j._wait_rewritten()
        assert not self.stuck


def after_a_crash(path: Path, first_index: int) -> list[tuple[bytes, int, int]]:
    """The entries a restart would see if the process died now: the files copied as they are
    (a stale .tmp included), opened with the snapshot's previous index, as ShardGroup does."""
    crashed = path.parent / "crashed"
    shutil.rmtree(crashed, ignore_errors=True)
    crashed.mkdir()
    for name in ("raft.journal", "raft.journal.tmp", "raft.journal.meta"):
        if (path.parent / name).exists():
            shutil.copy(path.parent / name, crashed / name)
    j = open_journal(crashed / "raft.journal", first_index=first_index)
    try:
        return entries(j)
    finally:
        j._destroy()


@pytest.fixture()
def gate(monkeypatch) -> RewriteGate:
    gate = RewriteGate()
    monkeypatch.setattr(disk, "fdatasync", gate)
    yield gate
    gate.opened.set()


@pytest.mark.parametrize("catch_up_bytes", [0, 1 << 20], ids=["rounds", "one-round"])
def test_appends_during_a_pending_rewrite_land_in_the_new_file(tmp_path, gate, monkeypatch,
                                                                catch_up_bytes):
    monkeypatch.setattr(journal_rewrite, "_CATCH_UP_BYTES", catch_up_bytes)
    path = tmp_path / "raft.journal"
    j = open_journal(path, "interval", fsync_interval=3600)
    model = fill(j, 8)
    inode = os.stat(path).st_ino
    gate.hold(j, 5)
    model = model[5:]
    assert entries(j) == model and j._rewriter is not None
    model += fill(j, 4, first=9, term=2)  # into the old file, while the new one is being synced
    assert entries(j) == model
    assert after_a_crash(path, first_index=6) == model
    gate.release(j)
    assert os.stat(path).st_ino != inode
    model += fill(j, 2, first=13, term=2)  # into the new file
    assert after_a_crash(path, first_index=6) == model
    assert entries(open_journal(path)) == model  # the new file alone, without first_index
    j._destroy()
    assert entries(open_journal(path)) == model


def test_delete_entries_from_during_a_pending_rewrite(tmp_path, gate):
    path = tmp_path / "raft.journal"
    j = open_journal(path, "interval", fsync_interval=3600)
    model = fill(j, 8)
    gate.hold(j, 3)  # the new file holds entries 4..8 now
    model = model[3:]
    j.deleteEntriesFrom(2)  # a new leader replaces 6..8, which the rewriter already copied
    model = model[:2]
    model += fill(j, 2, first=6, term=3, size=7)  # shorter records: the old bytes would show
    assert after_a_crash(path, first_index=4) == model
    gate.release(j)
    assert entries(j) == model
    j._destroy()
    assert entries(open_journal(path)) == model


def test_delete_entries_to_during_a_pending_rewrite(tmp_path, gate):
    path = tmp_path / "raft.journal"
    j = open_journal(path, "interval", fsync_interval=3600)
    model = fill(j, 10)
    gate.hold(j, 2)
    model = model[2:]
    model += fill(j, 1, first=11)
    j.deleteEntriesTo(4)  # a second compaction finished before the first rewrite did
    model = model[4:]
    assert entries(j) == model
    assert after_a_crash(path, first_index=7) == model
    gate.release(j)  # the rewriter went round again, from the new cut
    assert entries(open_journal(path)) == model  # without first_index: nothing older is left
    j._destroy()
    assert entries(open_journal(path)) == model


def test_clear_during_a_pending_rewrite(tmp_path, gate):
    path = tmp_path / "raft.journal"
    j = open_journal(path, "interval", fsync_interval=3600)
    fill(j, 6)
    gate.hold(j, 3)
    j.clear()  # a snapshot installed from the leader
    model = fill(j, 2, first=40, term=5)
    assert after_a_crash(path, first_index=40) == model
    gate.release(j)  # the rewrite gave up: it copied records that are gone
    assert not (tmp_path / "raft.journal.tmp").exists()
    assert entries(open_journal(path)) == model
    gate.hold(j, 1)  # and a later compaction still rewrites
    gate.release(j)
    j._destroy()
    assert entries(open_journal(path)) == model[1:]


@pytest.mark.parametrize("policy", ["interval", "always"])
def test_delete_entries_to_does_not_wait_for_the_disk(tmp_path, monkeypatch, policy):
    """Every fsync sleeps (5 s, unless released): deleteEntriesTo returns while the rewriter is
    still asleep in one, and (``interval``) appends and truncations go on meanwhile."""
    path = tmp_path / "raft.journal"
    j = open_journal(path, policy, fsync_interval=3600)
    model = fill(j, 6)
    sleeping, woken, release = threading.Event(), threading.Event(), threading.Event()
    waiters: list[str] = []

    def slow_fsync(fd: int) -> None:
        waiters.append(threading.current_thread().name)
        sleeping.set()
        release.wait(5)
        woken.set()

    monkeypatch.setattr(disk, "fsync", slow_fsync)
    monkeypatch.setattr(disk, "fdatasync", slow_fsync)
    j.deleteEntriesTo(4)
    assert not woken.is_set(), "deleteEntriesTo waited for an fsync"
    model = model[4:]
    assert entries(j) == model
    wait_for(sleeping.is_set, 10, "the rewriter to sleep in an fsync")
    if policy == "interval":
        model += fill(j, 3, first=7)
        j.deleteEntriesFrom(4)
        model = model[:4]
    assert not woken.is_set()
    assert all(name.startswith("kvps-journal-rewrite") for name in waiters), waiters
    release.set()
    j._wait_rewritten()
    monkeypatch.undo()
    j._destroy()
    assert entries(open_journal(path)) == model


def test_open_drops_the_records_the_snapshot_covers(tmp_path, caplog):
    path = tmp_path / "raft.journal"
    j = open_journal(path)
    added = fill(j, 10)
    j._destroy()
    with caplog.at_level(logging.WARNING, logger="kvps.raft"):
        j = open_journal(path, first_index=7)
    assert "dropping entries 1..6, older than the snapshot's previous entry 7" in caplog.text
    assert entries(j) == added[6:]
    j._wait_rewritten()  # the file is rewritten without them, like after deleteEntriesTo
    assert entries(open_journal(path)) == added[6:]
    j.add(b"next", 11, 1)
    j._destroy()
    assert entries(open_journal(path, first_index=7)) == added[6:] + [(b"next", 11, 1)]
    j = open_journal(path, first_index=50)  # all of it older than the snapshot
    assert len(j) == 0
    j.add(b"dump prev", 50, 2)
    j._destroy()
    assert entries(open_journal(path, first_index=50)) == [(b"dump prev", 50, 2)]
    assert entries(open_journal(path, first_index=3)) == [(b"dump prev", 50, 2)]


# ---- the list model -------------------------------------------------------------------------------

class JournalModel(RuleBasedStateMachine):
    """The journal behaves like the list pysyncobj keeps, across reopens and crashes, also while a
    compaction's rewrite is pending: every ``delete_to`` leaves the rewriter held at the gate
    (kept records copied, new file not yet switched to) until ``finish_rewrite``, so the other
    rules run against a pending rewrite."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="kvps-journal-"))
        self.path = self.dir / "raft.journal"
        self.gate = RewriteGate()
        self.real_fdatasync = disk.fdatasync
        disk.fdatasync = self.gate  # restored in teardown
        self.journal = open_journal(self.path, "interval", fsync_interval=3600)
        self.model: list[tuple[bytes, int, int]] = []
        self.next_index = 1  # of the next entry while the model is empty
        self.term = 1

    def teardown(self) -> None:
        self.gate.release(self.journal)
        self.journal._destroy()
        disk.fdatasync = self.real_fdatasync
        shutil.rmtree(self.dir, ignore_errors=True)

    def first_index(self) -> int:
        """The snapshot's previous entry as pysyncobj would have it: the first one kept."""
        return self.model[0][1] if self.model else self.next_index

    @rule(command=st.binary(max_size=300), term_step=st.integers(0, 1))
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
        del self.model[cut:]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def delete_to(self, data):
        cut = data.draw(st.integers(1, len(self.model)))
        if cut == len(self.model):
            self.next_index = self.model[-1][1] + 1
        if self.journal._rewriter is None:
            self.gate.hold(self.journal, cut)
        else:  # a rewrite is pending already: it will go round again
            self.journal.deleteEntriesTo(cut)
        self.model = self.model[cut:]

    @rule()
    def finish_rewrite(self):
        self.gate.release(self.journal)

    @rule()
    def clear(self):
        if self.model:
            self.next_index = self.model[-1][1] + 1
        self.journal.clear()
        self.model = []

    @rule()
    def reopen(self):
        self.gate.release(self.journal)
        self.journal._destroy()
        self.journal = open_journal(self.path, "interval", fsync_interval=3600)
        assert entries(self.journal) == self.model  # a clean close left nothing to drop

    @rule()
    def crash(self):
        assert after_a_crash(self.path, self.first_index()) == self.model

    @invariant()
    def same_as_the_model(self):
        assert entries(self.journal) == self.model
        assert len(self.journal) == len(self.model)


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
            assert (d / "raft.journal").read_bytes()[:8] == MAGIC
            assert not (d / "raft.journal.tmp").exists()
        for address in c.addresses:
            c.start(address)
        assert all(c.groups[a].term() >= terms[a] for a in c.addresses)
        c.propose(b"after")
        assert c.wait_converged() == reference + [b"after"]
    finally:
        c.stop_all()


def test_a_group_restarted_in_a_compaction_crash_window_keeps_its_entries(tmp_path):
    """The crash window of a compaction: the snapshot is in place, the journal's rewrite is not,
    so the journal on disk starts long before the snapshot's entries. pysyncobj clears such a
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
        journal = open_journal(d / "raft.journal")
        kept = entries(journal)
        journal._destroy()
        assert kept[0][1] == snap.prev_entry[1] and kept[-1][1] > snap.last_entry[1] + 2
        old = open_journal(tmp_path / "old.journal")  # as before the rewrite: from entry 1 on
        for index in range(1, kept[0][1]):
            old.add(b"covered by the snapshot", index, 1)
        for entry in kept:
            old.add(*entry)
        old._destroy()
        os.replace(tmp_path / "old.journal", d / "raft.journal")

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
