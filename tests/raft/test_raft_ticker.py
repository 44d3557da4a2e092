"""One ``Ticker`` drives several Raft groups on one thread and one poller (kvps/raft/ticker.py).

Three tickers stand for three node processes; each ticks one replica of two shards. Every wait is
a condition with a deadline.
"""
from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import free_ports, wait_for

from kvps.config import RaftConfig
from kvps.raft.group import GROUP_STOPPED, ShardGroup
from kvps.raft.ticker import GroupHalted, Ticker

SECRET = b"test-secret-for-raft-ticker-0123456789"
FAST = RaftConfig(election_timeout_min=0.3, election_timeout_max=0.6, heartbeat_period=0.05,
                  leader_fallback_timeout=0.6, connection_timeout=1.5, connection_retry=0.1)
SUCCESS = 0


class Applied:
    """A state machine that records its entries; ``halt_on`` makes one entry halt the group once."""

    def __init__(self, halt_on: bytes | None = None) -> None:
        self.entries: list[bytes] = []
        self.halt_on = halt_on
        self.lock = threading.Lock()

    def apply(self, data: Any) -> int:
        data = bytes(data)
        if data == self.halt_on:
            self.halt_on = None
            raise GroupHalted("test: this replica cannot apply " + data.decode())
        with self.lock:
            self.entries.append(data)
            return len(self.entries)

    def snapshot(self) -> bytes:
        with self.lock:
            return b"\n".join(self.entries)

    def restore(self, blob: Any) -> None:
        with self.lock:
            self.entries = [e for e in bytes(blob).split(b"\n") if e]


class Nodes:
    """``n`` tickers (nodes) × ``shards`` groups, each shard's replicas on different tickers."""

    def __init__(self, root: Path, n: int = 3, shards: int = 2, raft: RaftConfig = FAST) -> None:
        self.root = root
        self.raft = raft
        ports = free_ports(n * shards)
        self.addresses = {s: [f"127.0.0.1:{ports[s * n + i]}" for i in range(n)] for s in range(shards)}
        self.tickers = [Ticker(period=0.05, name=f"ticker-{i}") for i in range(n)]
        self.groups: dict[tuple[int, int], ShardGroup] = {}
        self.machines: dict[tuple[int, int], Applied] = {}
        self.halted: list[tuple[tuple[int, int], str]] = []

    def start(self, node: int, shard: int, machine: Applied | None = None) -> ShardGroup:
        machine = machine or Applied()
        self.machines[(node, shard)] = machine
        group = ShardGroup(
            self_address=self.addresses[shard][node], peers=self.addresses[shard], raft=self.raft,
            secret=SECRET, context=f"test/shard={shard}",
            journal_dir=self.root / f"n{node}" / f"s{shard}", applier=machine.apply,
            snapshot_state=machine.snapshot, restore_state=machine.restore,
            ticker=self.tickers[node],
            on_halted=lambda reason, key=(node, shard): self.halted.append((key, reason)))
        self.groups[(node, shard)] = group
        return group

    def start_all(self) -> None:
        for shard in self.addresses:
            for node in range(len(self.tickers)):
                self.start(node, shard)

    def leader(self, shard: int, timeout: float = 20.0) -> ShardGroup:
        def find():
            leaders = [g for (n, s), g in self.groups.items() if s == shard and g.is_leader()]
            return leaders[0] if len(leaders) == 1 else None
        return wait_for(find, timeout, f"one leader of shard {shard}")

    def propose(self, shard: int, data: bytes, timeout: float = 20.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result, reason = propose_sync(self.leader(shard, max(0.1, deadline - time.monotonic())), data,
                                          max(0.1, deadline - time.monotonic()))
            if reason == SUCCESS:
                return result
        raise AssertionError(f"could not commit {data!r} on shard {shard}")

    def stop_all(self) -> None:
        for group in self.groups.values():
            group.stop()
        for ticker in self.tickers:
            ticker.stop()


def propose_sync(group: ShardGroup, data: bytes, timeout: float) -> tuple[Any, int]:
    box: list[tuple[Any, int]] = []
    done = threading.Event()
    group.propose(data, lambda result, reason: (box.append((result, reason)), done.set()))
    return box[0] if done.wait(timeout) else (None, -1)


@pytest.fixture
def nodes(tmp_path):
    n = Nodes(tmp_path)
    try:
        yield n
    finally:
        n.stop_all()


def test_one_thread_per_process_ticks_every_group_and_each_shard_commits_in_order(nodes):
    before = {t.name for t in threading.enumerate()}
    nodes.start_all()
    for i in range(10):
        for shard in (0, 1):
            nodes.propose(shard, f"s{shard}-{i}".encode())
    for shard in (0, 1):
        want = [f"s{shard}-{i}".encode() for i in range(10)]
        wait_for(lambda: all(m.entries == want for (n, s), m in nodes.machines.items() if s == shard),
                 20, f"every replica of shard {shard} to apply the same entries")
    # Each group was ticked by its node's ticker and no group started a tick thread of its own.
    for (node, shard), group in nodes.groups.items():
        assert group._tick_thread is nodes.tickers[node].thread
    started = {t.name for t in threading.enumerate()} - before
    assert not [name for name in started if "_autoTickThread" in name], started
    assert all(t.groups == 2 for t in nodes.tickers)


def test_stopping_one_group_leaves_its_siblings_on_the_same_ticker_running(nodes):
    nodes.start_all()
    nodes.propose(0, b"a")
    leader = nodes.leader(1)
    node = next(n for (n, s), g in nodes.groups.items() if g is leader)
    nodes.groups.pop((node, 1)).stop()  # shard 1's leader goes; its node's shard 0 replica stays
    assert nodes.tickers[node].groups == 1
    nodes.propose(1, b"b")  # a new leader among the other two
    nodes.propose(0, b"c")
    wait_for(lambda: nodes.machines[(node, 0)].entries == [b"a", b"c"], 20,
             "the stopped group's sibling to keep applying")


def test_a_halted_group_stops_before_the_entry_and_its_siblings_go_on(nodes, tmp_path):
    nodes.start_all()
    nodes.propose(0, b"first")
    nodes.propose(1, b"other")
    node = next(n for (n, s), g in nodes.groups.items() if s == 0 and not g.is_leader())
    nodes.machines[(node, 0)].halt_on = b"poison"
    nodes.propose(0, b"poison")  # the two others commit it
    wait_for(lambda: nodes.halted, 20, "the follower to halt")
    assert nodes.halted[0][0] == (node, 0) and "poison" in nodes.halted[0][1]
    assert nodes.machines[(node, 0)].entries == [b"first"]  # the entry was not applied there
    assert nodes.tickers[node].groups == 1
    halted = nodes.groups[(node, 0)]
    assert propose_sync(halted, b"x", 5)[1] == GROUP_STOPPED  # a halted group takes nothing
    nodes.propose(1, b"sibling")  # its sibling on the same ticker still replicates
    wait_for(lambda: nodes.machines[(node, 1)].entries == [b"other", b"sibling"], 20, "the sibling")
    # Restarted from its journal (as kvps.replica does), the replica applies the entry it stopped at.
    halted.stop()
    restarted = nodes.start(node, 0)
    wait_for(lambda: nodes.machines[(node, 0)].entries == [b"first", b"poison"], 20,
             "the restarted replica to apply the entry it halted at")
    # (entries can apply before its first full tick: pysyncobj applies, then returns early,
    # while the Raft port is not bound yet; the tick callback that notes the thread comes later)
    wait_for(lambda: restarted._tick_thread is not None, 20, "the restarted replica's first full tick")
    assert restarted._tick_thread is nodes.tickers[node].thread


def test_a_group_whose_port_is_taken_binds_later_without_stalling_its_siblings(nodes):
    for node in range(3):
        nodes.start(node, 1)
    nodes.propose(1, b"before")
    host, port = nodes.addresses[0][0].rsplit(":", 1)
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    squatter.bind((host, int(port)))
    squatter.listen(1)
    try:
        started = time.monotonic()
        nodes.start(0, 0)  # cannot bind yet: built anyway, on the ticker shared with shard 1
        assert time.monotonic() - started < 5.0
        for node in (1, 2):
            nodes.start(node, 0)
        nodes.propose(1, b"while-squatted")  # node 0's ticker keeps its shard 1 replica going
        wait_for(lambda: nodes.machines[(0, 1)].entries == [b"before", b"while-squatted"], 20,
                 "node 0's shard 1 replica to keep applying")
    finally:
        squatter.close()
    nodes.propose(0, b"after")
    wait_for(lambda: nodes.machines[(0, 0)].entries == [b"after"], 20,
             "the late-bound replica to join its group")


class _Counted:
    """A stand-in group that counts its ticks (no hint: ticked every period)."""

    def __init__(self) -> None:
        self.ticks = 0

    def _onTick(self, timeToWait: float = 0.0) -> None:  # noqa: N802,N803 (pysyncobj's names)
        self.ticks += 1


class _Hinted(_Counted):
    """... that asks for its next tick half a second later."""

    def next_tick(self, period: float) -> float:
        return 0.5


def test_a_group_that_asks_for_fewer_ticks_gets_fewer_and_the_thread_sleeps_meanwhile():
    ticker = Ticker(period=0.05, name="ticker-hints")
    slow, busy = _Hinted(), _Counted()
    try:
        ticker.call(lambda: (ticker.add(slow, ticker.poller()), ticker.add(busy, ticker.poller())))
        wait_for(lambda: busy.ticks >= 40, 20, "forty ticks of the group without a hint")
        # 40 ticks of the busy group take >= 1.95 s; the slow one, every 0.5 s, got at most 6
        assert 2 <= slow.ticks <= 6, (slow.ticks, busy.ticks)
        ticks, rounds = ticker.call(lambda: (ticker.remove(busy), (slow.ticks, ticker.rounds))[1])
        wait_for(lambda: slow.ticks >= ticks + 4, 20, "four more ticks of the slow group")
        # alone, it wakes the thread about once per tick (every period would be ~40 rounds)
        assert ticker.rounds - rounds <= 10, (ticker.rounds - rounds, slow.ticks - ticks)
    finally:
        ticker.stop()


class _Heavy(_Counted):
    """... whose every tick works for ``seconds`` (applying large entries, on a loaded machine)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def _onTick(self, timeToWait: float = 0.0) -> None:  # noqa: N802,N803
        super()._onTick(timeToWait)
        end = time.monotonic() + self.seconds
        while time.monotonic() < end:  # CPU work, as an apply is
            pass


def test_the_longest_tick_and_the_latest_start_are_reported():
    """What makes a leader's heartbeats late on a busy node (a sibling's tick applying megabytes)
    shows in ``status()["stalls"]``: a group kept waiting by a 0.12 s sibling starts its tick
    at least 0.05 s after it was due."""
    ticker = Ticker(period=0.05, name="ticker-stalls")
    heavy, light = _Heavy(0.12), _Counted()
    try:
        ticker.call(lambda: (ticker.add(heavy, ticker.poller()), ticker.add(light, ticker.poller())))
        wait_for(lambda: heavy.ticks >= 4 and light.ticks >= 4, 30, "four ticks of each group")
        stalls = ticker.call(ticker.status)["stalls"]
        assert stalls["tick_max_seconds"] >= 0.12, stalls
        assert stalls["late_max_seconds"] >= 0.05, stalls
    finally:
        ticker.stop()
