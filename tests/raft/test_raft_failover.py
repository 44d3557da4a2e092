"""Fast failover's parts on their own: the election delay, the deadline rule, the follower's
decision, and the transport's port probe (tests/raft/test_raft_group.py runs them in real groups)."""
from __future__ import annotations

import random
import socket
import time
from types import SimpleNamespace

import pytest
from pysyncobj.monotonic import monotonic
from pysyncobj.poller import createPoller

from kvps.config import RaftConfig
from kvps.errors import ConfigError
from kvps.raft.failover import FastFailover, election_delay, schedule_election
from kvps.raft.probe import PortProbe

A, B, C = "10.0.0.1:7200", "10.0.0.2:7200", "10.0.0.3:7200"
DEADLINE = "_SyncObj__raftElectionDeadline"


def test_survivors_take_disjoint_slots_by_address():
    rng = random.Random(5)
    for _ in range(1000):
        first = election_delay(A, [B, C], B, 0.1, rng.random())   # A is first of {A, C}
        second = election_delay(C, [A, B], B, 0.1, rng.random())  # C is second
        assert 0 <= first < 0.025 and 0.1 <= second < 0.125
        assert second - first > 0.075  # the first candidate's vote request has 3/4 of a stagger
    # The dead leader takes no slot, wherever it sorts.
    assert election_delay(B, [A, C], A, 0.1, 0.0) == 0.0
    assert election_delay(C, [A, B, "10.0.0.4:7200", "10.0.0.5:7200"], A, 0.1, 0.0) == pytest.approx(0.1)


NOW = 1000.0  # the clock the deadline tests read: frozen, so a descheduled test cannot miss a slot


@pytest.fixture
def frozen_clock(monkeypatch):
    monkeypatch.setattr("kvps.raft.failover.monotonic", lambda: NOW)


def group_with_deadline(seconds_from_now: float) -> SimpleNamespace:
    group = SimpleNamespace()
    setattr(group, DEADLINE, NOW + seconds_from_now)
    return group


def test_the_deadline_is_set_to_the_slot(frozen_clock):
    group = group_with_deadline(0.5)
    assert schedule_election(group, 0.05) == pytest.approx(-0.45)
    assert getattr(group, DEADLINE) == pytest.approx(NOW + 0.05)
    # A later survivor whose own timeout was about to run out waits for its slot instead, so it does
    # not stand together with the first one; by at most the slot.
    soon = group_with_deadline(0.01)
    assert schedule_election(soon, 0.12) == pytest.approx(0.11)
    assert getattr(soon, DEADLINE) == pytest.approx(NOW + 0.12)


def follower_of(leader: str | None, me: str = A, deadline: float = 0.6) -> SimpleNamespace:
    group = group_with_deadline(deadline)
    group.leader_address = lambda: leader
    group.selfNode = SimpleNamespace(address=me)
    group.otherNodes = [SimpleNamespace(address=a) for a in (A, B, C) if a != me]
    return group


def test_only_the_leader_we_follow_counts(frozen_clock):
    for group, gone in ((follower_of(B), C),       # another follower died
                        (follower_of(A), B),       # we lead
                        (follower_of(None), B)):   # an election is already under way
        before = getattr(group, DEADLINE)
        failover = FastFailover(group, 0.1, random.Random(1))
        failover.on_peer_gone(gone)
        assert getattr(group, DEADLINE) == before and failover.scheduled == 0
    group = follower_of(B)
    failover = FastFailover(group, 0.1, random.Random(1))
    failover.on_peer_gone(B)
    assert failover.scheduled == 1 and getattr(group, DEADLINE) - NOW < 0.05


def test_config_validates_the_knobs():
    assert RaftConfig().fast_failover is True
    RaftConfig(fast_failover=False).validate()
    with pytest.raises(ConfigError) as exc:
        RaftConfig(fast_failover="yes").validate()
    assert exc.value.fields["field"] == "fast_failover"
    for stagger in (0.0, -1.0, RaftConfig().election_timeout_min):
        with pytest.raises(ConfigError) as exc:
            RaftConfig(fast_failover_stagger=stagger).validate()
        assert exc.value.fields["field"] == "fast_failover_stagger"


# ---- the port probe ------------------------------------------------------------------------------

def run_probe(port: int, window: float = 2.0, during=None, probes: list | None = None) -> list[str]:
    poller = createPoller("auto")
    gone: list[str] = []
    done: list[bool] = []
    probe = PortProbe(poller, "peer", "127.0.0.1", port, window, gone.append, lambda: done.append(True))
    if probes is not None:
        probes.append(probe)
    probe.start()
    deadline = time.monotonic() + 10
    while not done:
        assert time.monotonic() < deadline, "the probe never ended"
        poller.poll(0.01)
        if during is not None:
            during()
        probe.checkTimers(monotonic())
    return gone


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_probe_reports_a_refused_port():
    assert run_probe(closed_port()) == ["peer"]


def test_probe_leaves_a_listening_peer_alone():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        assert run_probe(listener.getsockname()[1]) == []


def test_probe_reports_a_listener_that_closes_while_connecting():
    """Connected into the accept queue of a listener that then closes (its process exiting)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)

    def close_listener() -> None:
        if listener.fileno() != -1:
            listener.close()

    try:
        assert run_probe(listener.getsockname()[1], during=close_listener) == ["peer"]
    finally:
        listener.close()


def test_probe_without_an_answer_is_inconclusive():
    # A listener whose accept queue is full and which never accepts: the SYN goes unanswered.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        fillers = [socket.create_connection(listener.getsockname(), timeout=1)]
        try:
            probes: list[PortProbe] = []
            assert run_probe(listener.getsockname()[1], window=0.3, probes=probes) == []
            assert not probes[0]._connected  # it ended on its window, not on an answer
        finally:
            for s in fillers:
                s.close()
