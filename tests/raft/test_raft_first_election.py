"""A fresh group's preferred replica stands for the first election once connected to a majority
(``kvps.raft.first_election``); a replica that is not fresh keeps pysyncobj's deadline."""
from __future__ import annotations

import dataclasses

from conftest import wait_for
from pysyncobj.monotonic import monotonic
from pysyncobj.node import TCPNode
from test_raft_group import FAST, Cluster

from kvps.raft import internals
from kvps.raft.first_election import stand_first


class FakeGroup:
    """What ``stand_first`` reads and writes of a SyncObj, under pysyncobj's names."""

    def __init__(self, term: int = 0, last_index: int = 1, connected: int = 2) -> None:
        self.otherNodes = [TCPNode("10.0.0.2:1"), TCPNode("10.0.0.3:1")]
        self._connected = set(self.otherNodes[:connected])
        self.callbacks: list = []
        self.recovering = False
        self._SyncObj__raftCurrentTerm = term
        self._SyncObj__raftLeader = None
        self._SyncObj__raftElectionDeadline = monotonic() + 100
        self._last_index = last_index

    def addOnTickCallback(self, fn) -> None:  # noqa: N802 (pysyncobj's name)
        self.callbacks.append(fn)

    def isNodeConnected(self, node) -> bool:  # noqa: N802
        return node in self._connected

    def _getLeader(self):  # noqa: N802
        return self._SyncObj__raftLeader

    def _SyncObj__getCurrentLogIndex(self) -> int:  # noqa: N802
        return self._last_index

    def tick(self) -> None:
        for fn in self.callbacks:
            fn()


def _deadline_after_ticks(group: FakeGroup, ticks: int = 3) -> float:
    stand_first(group)
    for _ in range(ticks):
        group.tick()
    return internals.election_deadline(group) - monotonic()


def test_a_fresh_preferred_replica_stands_once_connected_to_a_majority():
    group = FakeGroup(connected=0)
    assert _deadline_after_ticks(group) > 50  # alone: it waits (pre-votes would go nowhere)
    group._connected.add(group.otherNodes[0])  # itself and one of two others: a majority
    group.tick()
    assert internals.election_deadline(group) <= monotonic()
    internals.set_election_deadline(group, monotonic() + 100)  # an election timeout later: once only
    group.tick()
    assert internals.election_deadline(group) > monotonic() + 50


def test_a_replica_that_is_not_fresh_or_recovers_keeps_its_deadline():
    assert _deadline_after_ticks(FakeGroup(term=1)) > 50  # it has voted or led: pysyncobj's timer
    assert _deadline_after_ticks(FakeGroup(last_index=7)) > 50  # it has entries
    recovering = FakeGroup()
    recovering.recovering = True  # lost data replaced: it stands for nothing until caught up
    assert _deadline_after_ticks(recovering) > 50
    led = FakeGroup()
    led._SyncObj__raftLeader = led.otherNodes[1]  # it already follows a leader
    assert _deadline_after_ticks(led) > 50


def test_a_fresh_group_elects_its_preferred_replica_long_before_an_election_timeout(tmp_path):
    # Election timeouts of 20-30 s: without stand_first nobody could stand within the wait below.
    slow = dataclasses.replace(FAST, election_timeout_min=20.0, election_timeout_max=30.0,
                               connection_timeout=30.0)
    c = Cluster(tmp_path, raft=slow)
    try:
        c.start_all()
        preferred = c.addresses[1]
        stand_first(c.groups[preferred])
        leader = c.leader(timeout=15.0)
        assert leader.selfNode.address == preferred
        assert internals.current_term(leader) == 1  # the first election, won at once
        assert c.propose(b"first") is not None
        for address in c.addresses:
            if address != preferred:  # the others never stood
                assert "candidate" not in c.roles[address] and "leader" not in c.roles[address]
    finally:
        c.stop_all()
