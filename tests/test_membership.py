"""Assignments (pure) and the pysyncobj internals kvps/raft/membership.py relies on."""
from __future__ import annotations

import inspect
import re

import pytest
from pysyncobj import SyncObj

from kvps.assignment import Assignment
from kvps.config import ClusterConfig, NodeConfig
from kvps.errors import InvalidRequest


def src(obj) -> str:
    return re.sub(r"\s+", " ", inspect.getsource(obj))


def cfg(nodes: int = 4, shards: int = 4) -> ClusterConfig:
    return ClusterConfig(nodes=tuple(NodeConfig(id=i) for i in range(nodes)), shards=shards).validate()


def test_initial_assignment_is_the_config_placement():
    c = cfg()
    a = Assignment.initial(c)
    assert a.version == 0 and a.epochs == (0, 0, 0, 0)
    assert [list(a.nodes_of(s)) for s in range(4)] == [c.replica_nodes(s) for s in range(4)]
    assert a.shards_of(0) == c.shards_on(0)
    assert a.load([0, 1, 2, 3, 4]) == {0: 3, 1: 3, 2: 3, 3: 3, 4: 0}


def test_with_shard_bumps_version_and_that_shards_epoch_and_round_trips():
    a = Assignment.initial(cfg()).with_shard(1, [1, 2, 3, 0])
    assert a.version == 1 and a.epochs == (0, 1, 0, 0) and a.nodes_of(1) == (1, 2, 3, 0)
    assert Assignment.from_json(a.to_json()) == a
    with pytest.raises(InvalidRequest):
        a.with_shard(0, [1, 1, 2])
    with pytest.raises(InvalidRequest):
        Assignment.from_json({"version": 1, "shards": [{"id": 1, "nodes": [0]}]})


def test_pysyncobj_membership_internals_are_where_we_expect():
    init = src(SyncObj.__init__)
    # hold_elections() moves this deadline
    assert "self.__raftElectionDeadline = monotonicTime() + self.__generateRaftTimeout()" in init
    tick = src(SyncObj._onTick)
    assert "if self.__raftElectionDeadline < monotonicTime() and self.__connectedToAnyone():" in tick
    assert list(inspect.signature(SyncObj.addNodeToCluster).parameters) == ["self", "node", "callback"]
    assert list(inspect.signature(SyncObj.removeNodeFromCluster).parameters) == ["self", "node", "callback"]
    assert list(inspect.signature(SyncObj.transferLeadership).parameters) == ["self", "node", "callback"]
    change = src(SyncObj._SyncObj__doChangeCluster)
    # re-adding a member / removing a non-member or oneself is refused, not applied twice
    assert "if newNode == self.__selfNode or newNode in self.__otherNodes: return False" in change
    assert "if oldNode == self.__selfNode: return False" in change
    assert "if oldNode not in self.__otherNodes: return False" in change
    # a change is refused until the leader's no-op of its term is applied
    assert "if self.__raftLastApplied < self.__noopIDx: # No-op entry was not commited yet return False" \
        in src(SyncObj._SyncObj__changeCluster)
