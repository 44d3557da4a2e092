"""Quiet heartbeats (kvps/raft/quiet.py): a still group's leader heartbeats every quiet period.

Three tickers stand for three node processes, as in test_raft_ticker. Every wait is a condition
with a deadline; the counts compared are heartbeats sent over a window, with wide margins.
"""
from __future__ import annotations

import dataclasses
import threading

import pytest
from conftest import wait_for
from pysyncobj.monotonic import monotonic
from test_raft_ticker import FAST, Nodes

from kvps.config import RaftConfig
from kvps.errors import ConfigError

# Election timeouts a loaded 2-core CI machine does not run out by accident (1.2 s of margin
# after each quiet heartbeat, a stall of the whole test process included); quiet period 0.4 s
# (connection_timeout / 4 would allow 0.5).
QUIET = dataclasses.replace(FAST, election_timeout_min=1.2, election_timeout_max=2.0, connection_timeout=2.0,
                            leader_fallback_timeout=2.0, quiet_heartbeat_period=0.4, quiet_after=0.3)


@pytest.fixture
def nodes(tmp_path):
    n = Nodes(tmp_path, shards=1, raft=QUIET)
    try:
        yield n
    finally:
        n.stop_all()


def frames_sent(group) -> int:
    return group.transport_stats()["frames_sent"]


def heard(groups) -> int:
    return sum(g.status()["quiet"]["heard"] for g in groups)


def test_a_still_leader_heartbeats_every_quiet_period_and_a_proposal_wakes_it(nodes):
    nodes.start_all()
    nodes.propose(0, b"first")
    leader = nodes.leader(0)
    term = leader.term()
    wait_for(lambda: leader.status()["quiet"]["now"], 10, "the still leader to turn quiet")
    followers = [g for g in nodes.groups.values() if g is not leader]
    wait_for(lambda: all(g.status()["quiet"]["heard"] >= 2 for g in followers), 10,
             "both followers to hear quiet heartbeats")
    asked = [g.status()["pre_votes"]["asked"] for g in followers]  # the first election's included
    # Ten quiet heartbeats heard (five quiet periods, 2 s): 2 s of normal heartbeats would be 80
    # frames to two followers; quiet ones are ten, and a keepalive or two.
    sent, start = frames_sent(leader), heard(followers)
    wait_for(lambda: heard(followers) >= start + 10, 20, "ten more quiet heartbeats")
    assert frames_sent(leader) - sent <= 16, "frames a quiet leader sent for ten quiet heartbeats"
    # three times the quiet period and more without an election: the followers waited for it
    assert leader.is_leader() and leader.term() == term
    assert [g.status()["pre_votes"]["asked"] for g in followers] == asked  # nobody's timer ran out

    nodes.propose(0, b"second")  # ends the quiet: its append goes out at once
    assert leader.status()["quiet"]["left"] >= 1
    wait_for(lambda: all(m.entries == [b"first", b"second"] for m in nodes.machines.values()), 10,
             "every replica to apply the proposal")
    assert leader.is_leader() and leader.term() == term  # nobody stood meanwhile


def test_heartbeats_stay_normal_while_the_group_is_busy(tmp_path):
    # still for 2 s before it turns quiet: back-to-back proposals never leave it that long, even
    # on a loaded machine
    nodes = Nodes(tmp_path, shards=1, raft=dataclasses.replace(QUIET, quiet_after=2.0))
    try:
        nodes.start_all()
        nodes.propose(0, b"first")
        leader = nodes.leader(0)
        for i in range(100):  # one after another
            nodes.propose(0, b"busy-%d" % i)
            assert not leader.status()["quiet"]["now"]
        assert leader.status()["quiet"]["entered"] == 0
    finally:
        nodes.stop_all()


def test_a_pre_vote_asked_while_the_leader_is_quiet_is_refused(nodes):
    """A follower that asks for a pre-vote while its leader is quiet (as when its timer runs
    out) is refused by the leader and by the other follower, which counts the leader as heard
    for a quiet period beyond the election timeout, and it follows on: no election."""
    nodes.start_all()
    nodes.propose(0, b"first")
    leader = nodes.leader(0)
    term = leader.term()
    wait_for(lambda: leader.status()["quiet"]["now"], 10, "the still leader to turn quiet")
    asker, other = (g for g in nodes.groups.values() if g is not leader)
    wait_for(lambda: asker.status()["quiet"]["heard"] >= 1 and other.status()["quiet"]["heard"] >= 1, 10,
             "both followers to hear a quiet heartbeat")
    won, refused = asker.status()["pre_votes"]["won"], other.status()["pre_votes"]["refused"]
    node = next(n for (n, _), g in nodes.groups.items() if g is asker)
    nodes.tickers[node].defer(lambda: asker._prevote.ask(monotonic()))
    wait_for(lambda: other.status()["pre_votes"]["refused"] > refused
             and leader.status()["pre_votes"]["refused"] >= 1, 10, "both refusals")
    assert asker.status()["pre_votes"]["won"] == won
    assert leader.is_leader() and leader.term() == term and asker.term() == term
    nodes.propose(0, b"second")
    wait_for(lambda: all(m.entries == [b"first", b"second"] for m in nodes.machines.values()), 10,
             "every replica to apply the next entry in the same term")
    assert leader.term() == term


def test_a_paused_quiet_leader_is_replaced_and_steps_down_when_it_resumes(nodes):
    """A paused process closes nothing: its followers hear silence, wait the quiet period plus an
    election timeout, pre-vote and elect; the old leader steps down once it runs again."""
    nodes.start_all()
    nodes.propose(0, b"first")
    leader = nodes.leader(0)
    term = leader.term()
    wait_for(lambda: leader.status()["quiet"]["now"], 10, "the still leader to turn quiet")
    node = next(n for (n, _), g in nodes.groups.items() if g is leader)
    resume = threading.Event()
    paused = threading.Event()
    nodes.tickers[node].defer(lambda: (paused.set(), resume.wait(30)))  # its ticker stops
    assert paused.wait(10)
    try:
        new = wait_for(lambda: next((g for g in nodes.groups.values()
                                     if g is not leader and g.is_leader()), None), 20,
                       "a follower to take over from the paused leader")
        assert new.term() > term
    finally:
        resume.set()
    nodes.propose(0, b"after")
    wait_for(lambda: not leader.is_leader() and leader.term() > term, 20, "the old leader to step down")
    wait_for(lambda: all(m.entries == [b"first", b"after"] for m in nodes.machines.values()), 20,
             "every replica to apply the entry of the new term")


@pytest.mark.parametrize("fields", [
    {"quiet_heartbeat_period": 0.03},  # not above heartbeat_period
    {"quiet_after": -1.0},
])
def test_quiet_settings_are_checked(fields):
    with pytest.raises(ConfigError) as err:
        RaftConfig(**fields).validate()
    assert err.value.fields["field"] == next(iter(fields))


def test_quiet_heartbeats_can_be_turned_off_and_are_capped_at_the_keepalive():
    assert RaftConfig(quiet_heartbeat_period=0.0).validate().quiet_period == 0.0
    assert RaftConfig().validate().quiet_period == 0.8
    # a quarter of the connection timeout: a connection silent that long sends a keepalive
    assert RaftConfig(connection_timeout=2.0).validate().quiet_period == 0.5
