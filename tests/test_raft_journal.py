"""kvps.raft.journal: the record format, torn tails and corruption, crash-safe compaction rewrites,
the meta file, the fsync policies (fsync calls counted), the list model (hypothesis), the
injection into pysyncobj, and a 3-replica group restarted entirely from its journals."""
from __future__ import annotations

import logging
import os
import shutil
import struct
import tempfile
import threading
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
from kvps.raft import journal as journal_module
from kvps.raft.journal import MAGIC, RaftJournal, using_journal

HEADER = 16  # '<8sHHI'
RECORD = 24  # '<IIQQ'


class IOErrorSeen(Exception):
    pass


def raise_instead_of_exit(exc: OSError, what: str) -> None:
    raise IOErrorSeen(what) from exc


def open_journal(path: Path, fsync: str = "never", **kwargs) -> RaftJournal:
    return RaftJournal(path, fsync=fsync, on_io_error=raise_instead_of_exit, **kwargs)


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
        with caplog.at_level(logging.WARNING, logger="kvps.raft"):
            j = open_journal(torn)
        assert entries(j) == added[:2], cut
        assert os.path.getsize(torn) == last  # truncated to the last good record
        if cut > last:
            assert f"dropped {cut - last} bytes" in caplog.text
        j.add(*added[2])  # the log goes on where the good records end
        j._destroy()
        assert entries(open_journal(torn)) == added


def test_crc_corruption_in_the_middle_stops_there(tmp_path, caplog):
    path = tmp_path / "raft.journal"
    j = open_journal(path)
    added = fill(j, 5)
    offsets = list(j._offsets)
    j._destroy()
    for where in (offsets[2] + RECORD + 10,  # a command byte
                  offsets[2] + 8,  # the index (covered by the CRC)
                  offsets[2]):  # the CRC itself
        data = bytearray(path.read_bytes())
        data[where] ^= 0x40
        bad = tmp_path / f"bad-{where}" / "raft.journal"
        bad.parent.mkdir()
        bad.write_bytes(bytes(data))
        with caplog.at_level(logging.WARNING, logger="kvps.raft"):
            j = open_journal(bad)
        assert entries(j) == added[:2]
        assert os.path.getsize(bad) == offsets[2]
        j._destroy()
    assert "CRC mismatch" in caplog.text


def test_a_record_that_does_not_continue_the_log_ends_it(tmp_path):
    path = tmp_path / "raft.journal"
    j = open_journal(path)
    added = fill(j, 2)
    j.add(b"gap", 10, 1)  # pysyncobj never does this: what was read must be a log
    j._destroy()
    assert entries(open_journal(path)) == added


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
    assert entries(j) == added[4:]
    assert os.stat(path).st_ino != inode  # a new file, renamed over the old one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raft.journal"]  # no tmp left behind
    j.add(b"more", 9, 1)
    j.deleteEntriesTo(0)  # nothing to drop
    j._destroy()
    assert entries(open_journal(path)) == added[4:] + [(b"more", 9, 1)]


def test_delete_entries_to_cut_short_leaves_the_old_journal(tmp_path, monkeypatch):
    path = tmp_path / "raft.journal"
    j = open_journal(path)
    added = fill(j, 6)

    def crash(src, dst):
        raise OSError(5, "simulated crash before the rename")

    monkeypatch.setattr(journal_module.os, "rename", crash)
    with pytest.raises(IOErrorSeen):
        j.deleteEntriesTo(3)
    monkeypatch.undo()
    assert (tmp_path / "raft.journal.tmp").exists()  # what a crash here leaves behind
    reopened = open_journal(path)  # as after a restart: the old journal, whole
    assert entries(reopened) == added
    assert not (tmp_path / "raft.journal.tmp").exists()


def test_a_stale_tmp_file_is_removed_at_open(tmp_path):
    path = tmp_path / "raft.journal"
    j = open_journal(path)
    added = fill(j, 3)
    j._destroy()
    (tmp_path / "raft.journal.tmp").write_bytes(MAGIC + b"half a rewrite")
    (tmp_path / "raft.journal.meta.tmp").write_bytes(b"half a meta")
    assert entries(open_journal(path)) == added
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raft.journal"]


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


@pytest.mark.parametrize("damage", ["flip", "truncate", "magic", "empty"])
def test_corrupt_meta_is_refused(tmp_path, damage):
    path = tmp_path / "raft.journal"
    j = open_journal(path)
    j.setCurrentTerm(3, "a:1")
    j._destroy()
    meta = tmp_path / "raft.journal.meta"
    data = bytearray(meta.read_bytes())
    if damage == "flip":
        data[-1] ^= 1
    elif damage == "truncate":
        data = data[:-2]
    elif damage == "magic":
        data[:8] = b"XXXXXXXX"
    else:
        data = bytearray()
    meta.write_bytes(bytes(data))
    with pytest.raises(CodecError, match="raft journal meta"):
        open_journal(path)


# ---- fsync policies -------------------------------------------------------------------------------

class SyncCounter:
    def __init__(self, monkeypatch) -> None:
        self.fdatasync = 0
        self.fsync = 0
        self.event = threading.Event()
        monkeypatch.setattr(journal_module, "_fdatasync", self._fdatasync)
        monkeypatch.setattr(journal_module, "_fsync", self._fsync)

    def _fdatasync(self, fd: int) -> None:
        self.fdatasync += 1
        self.event.set()

    def _fsync(self, fd: int) -> None:
        self.fsync += 1

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
    assert counter.take() == (0, 2)  # the new file's header: file + directory
    fill(j, 3)
    assert counter.take() == (3, 0)  # one fdatasync per append
    j.deleteEntriesFrom(2)
    assert counter.take() == (1, 0)
    j.deleteEntriesTo(1)
    assert counter.take() == (0, 2)  # the rewritten file, then the directory after the rename
    j.setCurrentTerm(1, "a:1")
    assert counter.take() == (0, 2)  # meta file + directory, before pysyncobj sends anything
    j.setRaftCommitIndex(2)
    j.onOneSecondTimer()  # not on the tick thread: the background thread writes it
    assert counter.take()[0] == 0
    path = tmp_path / "raft.journal"
    wait_for(lambda: open_journal(path).getRaftCommitIndex() == 2, 10, "the commit index on disk")
    j._destroy()
    assert counter.take()[0] == 0  # nothing left to sync


def test_interval_syncs_in_the_background(tmp_path, monkeypatch):
    counter = SyncCounter(monkeypatch)
    j = open_journal(tmp_path / "raft.journal", "interval", fsync_interval=0.01)
    counter.take()
    counter.event.clear()
    fill(j, 3)
    j.setCurrentTerm(1, "a:1")
    assert counter.fsync == 2  # term and vote: synchronously, like "always"
    wait_for(counter.event.is_set, 10, "the background fdatasync")
    assert counter.fdatasync >= 1
    synced = counter.fdatasync
    j._sync()  # nothing changed since: no fdatasync
    assert counter.fdatasync == synced
    j.add(b"last", 4, 1)
    j._destroy()  # closing syncs what the thread has not
    assert j._synced == j._changes


def test_compaction_leaves_the_replaced_file_to_the_background_thread(tmp_path):
    """Closing the replaced journal frees its blocks and waits for write-back in flight: the
    tick thread (which calls deleteEntriesTo) hands that to the background thread."""
    j = open_journal(tmp_path / "raft.journal", "interval", fsync_interval=0.01)
    added = fill(j, 4)
    j.deleteEntriesTo(2)
    wait_for(lambda: not j._to_close, 10, "the replaced file to be closed")
    assert entries(j) == added[2:]
    j._destroy()
    assert entries(open_journal(tmp_path / "raft.journal")) == added[2:]


def test_flush_syncs_under_every_policy(tmp_path, monkeypatch):
    counter = SyncCounter(monkeypatch)
    j = open_journal(tmp_path / "raft.journal", "never")
    fill(j, 1)
    j.flush()
    assert counter.take() == (1, 0)


# ---- the list model -------------------------------------------------------------------------------

class JournalModel(RuleBasedStateMachine):
    """The journal behaves like the list pysyncobj keeps, across reopens."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="kvps-journal-"))
        self.path = self.dir / "raft.journal"
        self.journal = open_journal(self.path)
        self.model: list[tuple[bytes, int, int]] = []
        self.next_index = 1
        self.term = 1

    def teardown(self) -> None:
        self.journal._destroy()
        shutil.rmtree(self.dir, ignore_errors=True)

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
        self.journal.deleteEntriesFrom(cut)
        del self.model[cut:]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def delete_to(self, data):
        cut = data.draw(st.integers(0, len(self.model)))
        if cut == len(self.model):
            self.next_index = self.model[-1][1] + 1
        self.journal.deleteEntriesTo(cut)
        self.model = self.model[cut:]

    @rule()
    def clear(self):
        if self.model:
            self.next_index = self.model[-1][1] + 1
        self.journal.clear()
        self.model = []

    @rule()
    def reopen(self):
        self.journal._destroy()
        self.journal = open_journal(self.path)

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


def test_kvps_up_takes_fsync():
    from kvps.cli import build_parser

    assert build_parser().parse_args(["up", "--fsync", "always"]).fsync == "always"
    assert build_parser().parse_args(["up"]).fsync == RaftConfig.fsync
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--fsync", "sometimes"])
