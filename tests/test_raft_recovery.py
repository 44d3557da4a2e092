"""The node's side of kvps.raft.recovery: which restarts mark a replica as recovering.

(The group's side, withholding votes until caught up, is in test_raft_group.py; a node restarting
a replica whose directory was deleted is in test_cluster_faults.py.)"""
from __future__ import annotations

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
    assert not r.active and not r.withholds({"type": "request_vote", "term": 3})
    r.active = True
    assert r.withholds({"type": "request_vote", "term": 3}) and r.votes_withheld == 1
    assert not r.withholds({"type": "append_entries", "term": 3})
    assert not r.withholds({"type": "timeout_now", "term": 3})
