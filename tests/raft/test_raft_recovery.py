"""The node's side of kvps.raft.recovery: which restarts mark a replica as recovering.

(The group's side, withholding votes until caught up, is in test_raft_group.py; a node restarting
a replica whose directory was deleted is in test_cluster_faults.py.)"""
from __future__ import annotations

from types import SimpleNamespace

from kvps.raft import recovery


def test_only_a_replica_this_node_hosted_before_and_whose_data_is_gone_is_marked(tmp_path):
    name = "shard-3"
    data = tmp_path / name
    # First start (a new cluster, or a replica moved here): recorded, not recovering.
    assert recovery.prepare_start(tmp_path, name) is False
    assert (tmp_path / "hosted" / name).exists() and not (data / recovery.MARKER).exists()
    data.mkdir()
    (data / "raft.journal").write_bytes(b"entries")
    # A restart with its data: not recovering.
    assert recovery.prepare_start(tmp_path, name) is False
    assert not (data / recovery.MARKER).exists()
    # Its data is gone: recovering, and the group sees it.
    for path in data.iterdir():
        path.unlink()
    data.rmdir()
    assert recovery.prepare_start(tmp_path, name) is True
    assert (data / recovery.MARKER).exists() and recovery.Recovery(data).active
    # Crashed while recovering (the marker and a partial journal are there): still recovering.
    (data / "raft.journal").write_bytes(b"partial")
    assert recovery.prepare_start(tmp_path, name) is False  # nothing new to mark ...
    assert recovery.Recovery(data).active  # ... the marker from before still holds
    # Moved away: its data deleted and the record forgotten; a later move back starts it as new.
    for path in data.iterdir():
        path.unlink()
    data.rmdir()
    recovery.forget_hosted(tmp_path, name)
    assert recovery.prepare_start(tmp_path, name) is False
    assert not data.exists() or not (data / recovery.MARKER).exists()


def test_a_recovering_group_withholds_vote_requests_only(tmp_path):
    r = recovery.Recovery(tmp_path)  # no marker: not recovering
    assert not r.active and not r.withholds({"type": "request_vote", "term": 3}, 3)
    r.enter("test: a damaged journal")
    assert (tmp_path / recovery.MARKER).exists() and recovery.Recovery(tmp_path).reason == "test: a damaged journal"
    assert r.withholds({"type": "request_vote", "term": 3}, 3) and r.votes_withheld == 1
    assert not r.withholds({"type": "append_entries", "term": 3, "commit_index": 0}, 3)
    assert not r.withholds({"type": "timeout_now", "term": 3}, 3)


class FakeGroup:
    """What ``Recovery.check`` reads of a group: term, commit index, the log (pysyncobj
    internals) and ``selfNode.address`` (public: its log line names the replica)."""

    def __init__(self, log: list[tuple[bytes, int, int]], term: int, commit: int) -> None:
        self.log, self._SyncObj__raftCurrentTerm, self._SyncObj__raftCommitIndex = log, term, commit
        self.selfNode = SimpleNamespace(address="127.0.0.1:1")

    def _SyncObj__getEntries(self, index: int, count: int) -> list:
        return [e for e in self.log if e[1] == index][:count]


def test_recovery_ends_only_past_what_the_leader_announced_and_in_its_term(tmp_path):
    """(a) an entry of the current term at the commit index, (b) the commit index at or past what
    that term's leader announced first. A log that still ends with the entries of the term the
    replica knew (its meta file survived a damaged journal) proves nothing by itself."""
    r = recovery.Recovery(tmp_path)
    r.enter("test")
    log = [(b"", i, 2) for i in range(1, 5)]  # what survived: entries of term 2 up to 4
    assert not r.check(FakeGroup(log, term=2, commit=4))  # no leader heard since it started
    r.withholds({"type": "append_entries", "term": 1, "commit_index": 99}, 2)  # a stale leader
    assert not r.check(FakeGroup(log, term=2, commit=4))
    r.withholds({"type": "append_entries", "term": 2, "commit_index": 8}, 2)  # the same leader, on
    assert not r.check(FakeGroup(log, term=2, commit=4))  # (b): it had committed up to 8
    log += [(b"", i, 2) for i in range(5, 9)]
    r.withholds({"type": "append_entries", "term": 2, "commit_index": 9}, 2)  # later: not the floor
    assert r.check(FakeGroup(log, term=2, commit=8))
    assert not r.active and not (tmp_path / recovery.MARKER).exists()


def test_a_new_leader_must_have_committed_an_entry_of_its_own_term(tmp_path):
    r = recovery.Recovery(tmp_path)
    r.enter("test")
    log = [(b"", i, 2) for i in range(1, 9)]
    r.withholds({"type": "append_entries", "term": 3, "commit_index": 6}, 2)  # a leader of term 3
    assert not r.check(FakeGroup(log, term=3, commit=8))  # (a): no entry of term 3 yet
    log.append((b"", 9, 3))
    assert r.check(FakeGroup(log, term=3, commit=9))
