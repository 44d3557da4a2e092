"""A Raft group's log keeps in memory only the commands some member may still need
(kvps.raft.log_memory): applied and held by every follower, a command is read back from the
journal if ever needed; a follower that lags behind what the leader released is served from it."""
from __future__ import annotations

import os
from dataclasses import replace

from conftest import wait_for
from test_raft_group import FAST, Cluster

from kvps.raft import internals
from kvps.raft.frame_buffers import frame_buffer_stats
from kvps.raft.released import Released

ENTRY = 64 * 1024


def command(i: int) -> bytes:
    return i.to_bytes(4, "little") + os.urandom(ENTRY - 4)  # incompressible, each its own


def released(group) -> int:
    return sum(type(c) is Released for c, _, _ in internals.raft_log(group)[:])


def test_applied_entries_every_follower_has_leave_memory_and_read_back_intact(tmp_path):
    c = Cluster(tmp_path)
    try:
        c.start_all()
        sent = [command(i) for i in range(40)]
        for data in sent:
            c.propose(data)
        assert c.wait_converged() == sent
        # every replica: applied, and (leader) acknowledged by both followers -> released
        wait_for(lambda: all(g.status()["log_memory"]["held_bytes"] < ENTRY
                             for g in c.groups.values()), 10, "every replica to release its log")
        for group in c.groups.values():
            st = group.status()
            assert st["log_entries"] >= len(sent)  # no compaction: the entries are still there
            assert released(group) >= len(sent) - 1
            assert st["log_memory"]["released_bytes"] >= (len(sent) - 1) * ENTRY
            log = internals.raft_log(group)[:]
            assert [bytes(cmd)[2:] for cmd, _, _ in log if len(cmd) == 2 + ENTRY] == sent  # read back (after our 2-byte prefix)
    finally:
        c.stop_all()


def test_a_lagging_follower_is_served_from_the_journal_and_the_leader_stays_in_budget(tmp_path):
    budget = 16 * ENTRY
    c = Cluster(tmp_path, raft=replace(FAST, log_memory_bytes=budget))
    try:
        c.start_all()
        first = command(0)
        c.propose(first)
        leader = c.leader()
        lagging = next(a for a in c.groups if a != leader.selfNode.address)
        c.stop(lagging)
        held = []
        sent = [command(i) for i in range(1, 61)]  # 60 x 64 KiB: 3.75 MiB, past the budget
        for data in sent:
            c.propose(data)
            held.append(leader.status()["log_memory"]["held_bytes"])
        # the leader releases what the lagging follower lacks once past the budget (one tick
        # after it applies: a proposal or two may be in between)
        assert max(held) <= budget + 4 * (2 + ENTRY), held
        assert leader.status()["log_memory"]["read_back_entries"] == 0
        c.start(lagging)
        assert c.wait_converged() == [first, *sent]
        st = leader.status()["log_memory"]
        assert st["read_back_entries"] >= len(sent) - 16 - 4  # all it had released, from disk
        assert st["read_back_bytes"] == st["read_back_entries"] * (2 + ENTRY)  # (our prefix)
    finally:
        c.stop_all()


def test_followers_receive_large_appends_into_recycled_buffers(tmp_path):
    """Frames past the staging buffer land in tick-thread pools (kvps.buffers): once their entries
    are applied and released, the next frames reuse them, and every entry still reads back intact."""
    before = frame_buffer_stats()
    c = Cluster(tmp_path)
    try:
        c.start_all()
        sent = [i.to_bytes(4, "little") + os.urandom(512 * 1024) for i in range(30)]
        for data in sent:
            c.propose(data)
        assert c.wait_converged() == sent
        after = frame_buffer_stats()
        assert after["reused"] - before["reused"] >= 10, (before, after)
        for group in c.groups.values():  # the log's entries (views of those frames) unchanged
            log = internals.raft_log(group)[:]
            assert [bytes(cmd)[2:] for cmd, _, _ in log if len(cmd) > 512 * 1024] == sent
    finally:
        c.stop_all()
