"""The faults, one at a time, from a seeded schedule.

Each fault injects, holds for a seeded while, heals (also when interrupted), and fills a
``FaultRecord``; the schedule then waits until every shard has a serving leader again before the
next quiet period. Targets that depend on the running cluster (which replica leads) are looked up at
injection time, so a seed replays the same sequence of fault kinds, shards, nodes and durations.

Faults that need packet filtering (partitions, isolation, loss) or the transparent delay proxy
run only in network-namespace mode (``NETNS_ONLY``).
"""
from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from kvps.node.local import wait_until

from kvps_chaos import elastic
from kvps_chaos.cluster import ChaosCluster

__all__ = ["ALL_FAULTS", "FaultContext", "FaultRecord", "NETNS_ONLY", "run_schedule"]


@dataclass
class FaultRecord:
    kind: str
    start: float
    end: float | None = None        # healed
    ready: float | None = None      # every shard had a serving leader again
    shard: int | None = None
    node: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    invoked: float | None = None    # when its action began (``start`` is when it took effect)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def injected(self) -> None:
        """The fault is in force from now on: after finding its target (a cluster-map round trip)
        and after the action took effect, so recovery times do not count the set-up."""
        self.start = time.monotonic()


@dataclass
class FaultContext:
    cluster: ChaosCluster
    rng: random.Random
    set_reply_loss: Callable[[float], None]
    hold: tuple[float, float] = (2.0, 4.0)     # how long a fault lasts (s)
    log: Callable[[str], None] = lambda line: None

    def hold_time(self) -> float:
        return self.rng.uniform(*self.hold)

    async def leader(self, shard: int, timeout: float = 30.0) -> dict[str, Any]:
        return await asyncio.to_thread(wait_until, lambda: self.cluster.leader(shard), timeout,
                                       f"a serving leader of shard {shard}", 0.1)

    def others(self, node: int) -> list[int]:
        return [n.id for n in self.cluster.cfg.nodes if n.id != node]


def _in_node_process(ctx: FaultContext, node: int, pid: int) -> bool:
    """Whether the replica with ``pid`` lives in its node's process (``server.procs = 1``)."""
    return pid == ctx.cluster.node_pid(node)


async def _kill_leader(ctx: FaultContext, rec: FaultRecord) -> None:
    rec.shard = ctx.rng.randrange(ctx.cluster.cfg.shards)
    leader = await ctx.leader(rec.shard)
    rec.node, rec.detail["pid"] = leader["node"], leader["pid"]
    rec.injected()
    if _in_node_process(ctx, rec.node, leader["pid"]):
        # The replica's process is its node's: it dies with every replica of that node, and
        # comes back when the node is started again (what a supervisor like systemd would do).
        rec.detail["whole_node"] = True
        await asyncio.to_thread(ctx.cluster.kill_node, rec.node, signal.SIGKILL)
        ctx.cluster.start_node(rec.node)
    else:
        ctx.cluster.kill_pid(leader["pid"], signal.SIGKILL)
    # The node supervisor restarts it; healed once the replica runs again under a new pid.
    await asyncio.to_thread(wait_until, lambda: (ctx.cluster.replica(rec.shard, rec.node) or {}).get(
        "pid") not in (None, leader["pid"]), 60, "the killed replica to be restarted", 0.1)


async def _pause_leader(ctx: FaultContext, rec: FaultRecord) -> None:
    rec.shard = ctx.rng.randrange(ctx.cluster.cfg.shards)
    hold = ctx.hold_time()
    leader = await ctx.leader(rec.shard)
    rec.node, rec.detail["pid"], rec.detail["paused_s"] = leader["node"], leader["pid"], hold
    rec.injected()
    ctx.cluster.kill_pid(leader["pid"], signal.SIGSTOP)
    try:
        await asyncio.sleep(hold)
    finally:
        ctx.cluster.kill_pid(leader["pid"], signal.SIGCONT)


async def _kill_node(ctx: FaultContext, rec: FaultRecord) -> None:
    rec.node = ctx.rng.randrange(len(ctx.cluster.cfg.nodes))
    down = ctx.hold_time()
    rec.detail["down_s"] = down
    await asyncio.to_thread(ctx.cluster.kill_node, rec.node, signal.SIGKILL)
    rec.injected()
    try:
        await asyncio.sleep(down)
    finally:
        ctx.cluster.start_node(rec.node)


async def _kill_all(ctx: FaultContext, rec: FaultRecord) -> None:
    down = ctx.rng.uniform(0.5, 1.5)
    rec.detail["down_s"] = down
    try:
        for n in ctx.cluster.cfg.nodes:
            await asyncio.to_thread(ctx.cluster.kill_node, n.id, signal.SIGKILL)
        rec.injected()  # once every node is dead
        await asyncio.sleep(down)
    finally:
        for n in ctx.cluster.cfg.nodes:
            ctx.cluster.start_node(n.id)


async def _cut(ctx: FaultContext, rec: FaultRecord, *, leader: bool) -> None:
    """Drop one replica's Raft traffic with its peers (clients still reach it)."""
    topo = ctx.cluster.topology
    assert topo is not None
    rec.shard = ctx.rng.randrange(ctx.cluster.cfg.shards)
    hold = ctx.hold_time()
    pick = ctx.rng.random()
    lead = (await ctx.leader(rec.shard))["node"]
    followers = [n for n in ctx.cluster.cfg.replica_nodes(rec.shard) if n != lead]
    rec.node = lead if leader else followers[int(pick * len(followers))]
    rec.detail["held_s"] = hold
    peers = [topo.address(n) for n in ctx.others(rec.node)]
    await asyncio.to_thread(topo.drop_between, rec.node, peers, ctx.cluster.raft_ports(rec.shard))
    rec.injected()  # once the rules are in (nft takes tens of ms)
    try:
        await asyncio.sleep(hold)
    finally:
        await asyncio.to_thread(topo.heal, rec.node)


async def _partition_leader(ctx: FaultContext, rec: FaultRecord) -> None:
    await _cut(ctx, rec, leader=True)


async def _isolate_follower(ctx: FaultContext, rec: FaultRecord) -> None:
    await _cut(ctx, rec, leader=False)


async def _packet_loss(ctx: FaultContext, rec: FaultRecord) -> None:
    topo = ctx.cluster.topology
    assert topo is not None
    rec.node = ctx.rng.randrange(len(ctx.cluster.cfg.nodes))
    percent, hold = ctx.rng.randint(10, 30), ctx.hold_time()
    rec.detail.update(percent=percent, held_s=hold)
    await asyncio.to_thread(topo.lose_packets, rec.node, percent)
    rec.injected()
    try:
        await asyncio.sleep(hold)
    finally:
        await asyncio.to_thread(topo.heal, rec.node)


async def _delay(ctx: FaultContext, rec: FaultRecord) -> None:
    """Delay every Raft byte to and from one node (its own proxy for the connections it opened,
    its peers' proxies for the ones they opened to it)."""
    cluster, topo = ctx.cluster, ctx.cluster.topology
    assert topo is not None
    rec.node = ctx.rng.randrange(len(cluster.cfg.nodes))
    delay = ctx.rng.uniform(0.02, 0.1)
    jitter, hold = delay / 3, ctx.hold_time()
    rec.detail.update(delay_ms=round(delay * 1000, 1), jitter_ms=round(jitter * 1000, 1), held_s=hold)
    rules = {n: ({"*": (delay, jitter)} if n == rec.node else {topo.address(rec.node): (delay, jitter)})
             for n in range(len(cluster.cfg.nodes))}
    try:
        for n, r in rules.items():
            await asyncio.to_thread(cluster.set_delay, n, r)
        rec.injected()
        await asyncio.sleep(hold)
    finally:
        for n in rules:
            await asyncio.to_thread(cluster.set_delay, n, {})


async def _reply_loss(ctx: FaultContext, rec: FaultRecord) -> None:
    hold = ctx.hold_time()
    rec.detail.update(loss=0.3, held_s=hold)
    ctx.set_reply_loss(0.3)
    try:
        await asyncio.sleep(hold)
    finally:
        ctx.set_reply_loss(0.0)


async def _wipe_replica(ctx: FaultContext, rec: FaultRecord) -> None:
    """kill -9 a follower, delete its data dir, let its node restart it empty: it must catch up
    from the leader (log or snapshot), withholding its vote until then (it has forgotten entries
    it acknowledged; kvps/raft/recovery.py). The node supervisor is stopped meanwhile so it cannot
    restart the replica on the old files."""
    cluster = ctx.cluster
    rec.shard = ctx.rng.randrange(cluster.cfg.shards)
    pick = ctx.rng.random()
    lead = await ctx.leader(rec.shard)
    followers = [n for n in cluster.cfg.replica_nodes(rec.shard) if n != lead["node"]]
    rec.node = followers[int(pick * len(followers))]
    def running() -> tuple[dict, int] | None:  # a replica restarted by the last fault comes up
        victim, node_pid = cluster.replica(rec.shard, rec.node) or {}, cluster.node_pid(rec.node)
        return (victim, node_pid) if victim.get("pid") and node_pid is not None else None
    try:
        victim, node_pid = await asyncio.to_thread(wait_until, running, 20, "the replica to run", 0.1)
    except TimeoutError:
        raise RuntimeError(f"replica of shard {rec.shard} on node {rec.node} is not running") from None
    rec.injected()
    if victim["pid"] == node_pid:  # server.procs = 1: the replica's process is its node's
        rec.detail["whole_node"] = True
        await asyncio.to_thread(cluster.kill_node, rec.node, signal.SIGKILL)
        shutil.rmtree(cluster.replica_dir(rec.node, rec.shard), ignore_errors=True)
        cluster.start_node(rec.node)
    else:
        os.kill(node_pid, signal.SIGSTOP)
        try:
            cluster.kill_pid(victim["pid"], signal.SIGKILL)
            await asyncio.to_thread(wait_until, lambda: _dead(victim["pid"]), 10, "the replica to die", 0.02)
            shutil.rmtree(cluster.replica_dir(rec.node, rec.shard), ignore_errors=True)
        finally:
            os.kill(node_pid, signal.SIGCONT)
    target = (cluster.state_hashes(rec.shard).get(lead["node"]) or ("", 0))[1]
    rec.detail.update(pid=victim["pid"], leader_applied=target)
    started = time.monotonic()

    def caught_up() -> bool:  # and left recovery: it votes again (kvps/raft/recovery.py)
        got = cluster.state_hashes(rec.shard, timeout=1.0).get(rec.node)
        return (got is not None and got[1] >= target
                and (cluster.replica(rec.shard, rec.node) or {}).get("recovering") is False)

    try:
        await asyncio.to_thread(wait_until, caught_up, 60, "the wiped replica to catch up", 0.2)
        rec.detail["caught_up_s"] = round(time.monotonic() - started, 2)
    except TimeoutError:
        rec.detail["caught_up_s"] = None
        rec.error = f"wiped replica (shard {rec.shard}, node {rec.node}) did not catch up within 60 s"


async def _membership(ctx: FaultContext, rec: FaultRecord) -> None:
    """A node joins mid-run (``kvps node join``; in namespace mode in a namespace of its own, added
    now), replicas move onto it one at a time, then it is drained (its replicas move back) and
    removed; its process exits by itself. Both halves in one fault, so the placement checks after
    the run see the initial nodes again."""
    cluster = ctx.cluster
    initial = [n.id for n in cluster.cfg.nodes]
    view = await asyncio.to_thread(elastic.meta, cluster)
    if view is None:
        raise RuntimeError("no node answered GET /v1/meta")
    node_id = rec.node = len(view["nodes"])  # ids are never reused
    started = time.monotonic()
    rec.injected()
    proc = await asyncio.to_thread(cluster.join_node, node_id)
    try:
        grown = await asyncio.to_thread(wait_until, lambda: elastic.settled(cluster, [*initial, node_id]),
                                        120, f"replicas to spread onto node {node_id}", 0.2)
        rec.detail["replicas_on_joined"] = elastic.loads(grown)[node_id]
        rec.detail["grow_s"] = round(time.monotonic() - started, 2)
        drained = time.monotonic()
        await asyncio.to_thread(cluster.admin, "POST", f"/v1/nodes/{node_id}/drain", {})
        shrunk = await asyncio.to_thread(wait_until, lambda: elastic.settled(cluster, initial), 120,
                                         f"node {node_id} to be drained and removed", 0.2)
        await asyncio.to_thread(wait_until, lambda: proc.poll() is not None, 30,
                                f"node {node_id}'s process to exit", 0.1)
        rec.detail["shrink_s"] = round(time.monotonic() - drained, 2)
        rec.detail["moves_done"] = shrunk["rebalance"]["moves_done"]
    finally:
        await asyncio.to_thread(cluster.release_node, node_id)


async def _lose_node(ctx: FaultContext, rec: FaultRecord) -> None:
    """A host lost for good: a node joins (its own namespace in namespace mode) and replicas spread
    onto it; then its processes are killed, its data wiped and its namespace removed, and it never
    comes back. After ``server.node_dead_after`` the metadata leader declares it dead, its replicas
    are re-created on the initial nodes (each dead member removed from its group first) and it is
    removed (``kvps/node/liveness.py``). Healed once the placement is back on the initial nodes."""
    cluster = ctx.cluster
    initial = [n.id for n in cluster.cfg.nodes]
    view = await asyncio.to_thread(elastic.meta, cluster)
    if view is None:
        raise RuntimeError("no node answered GET /v1/meta")
    node_id = rec.node = len(view["nodes"])  # ids are never reused
    proc = await asyncio.to_thread(cluster.join_node, node_id)
    try:
        grown = await asyncio.to_thread(wait_until, lambda: elastic.settled(cluster, [*initial, node_id]),
                                        120, f"replicas to spread onto node {node_id}", 0.2)
        rec.detail["replicas_on_lost"] = elastic.loads(grown)[node_id]
        rec.injected()
        os.killpg(proc.pid, signal.SIGKILL)  # the node and its replicas at once, as a host dies
        await asyncio.to_thread(proc.wait)
        shutil.rmtree(cluster.data_dir / f"joined-{node_id}", ignore_errors=True)
    finally:
        await asyncio.to_thread(cluster.release_node, node_id)  # and its network with it
    lost = time.monotonic()
    dead_after = cluster.cfg.server.node_dead_after

    def node_state() -> str | None:
        m = elastic.meta(cluster, timeout=2.0)
        return m["nodes"][node_id]["state"] if m is not None and node_id < len(m["nodes"]) else None

    await asyncio.to_thread(wait_until, lambda: node_state() in ("dead", "removed"), dead_after + 30,
                            f"node {node_id} to be declared dead", 0.2)
    rec.detail["declared_dead_s"] = round(time.monotonic() - lost, 2)
    def replaced() -> dict | None:
        m = elastic.settled(cluster, initial)
        return m if m is not None and m["nodes"][node_id]["state"] == "removed" else None

    shrunk = await asyncio.to_thread(wait_until, replaced, 120,
                                     f"node {node_id}'s replicas re-created on nodes {initial}, it removed", 0.2)
    rec.detail["replaced_s"] = round(time.monotonic() - lost, 2)
    rec.detail["moves_done"] = shrunk["rebalance"]["moves_done"]


def _dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


ALL_FAULTS: dict[str, Callable[[FaultContext, FaultRecord], Awaitable[None]]] = {
    "kill-leader": _kill_leader,
    "kill-node": _kill_node,
    "kill-all": _kill_all,
    "pause-leader": _pause_leader,
    "partition-leader": _partition_leader,
    "isolate-follower": _isolate_follower,
    "packet-loss": _packet_loss,
    "delay": _delay,
    "wipe-replica": _wipe_replica,
    "reply-loss": _reply_loss,
    "membership": _membership,
    "lose-node": _lose_node,
}
NETNS_ONLY = frozenset({"partition-leader", "isolate-follower", "packet-loss", "delay"})


async def run_schedule(ctx: FaultContext, kinds: list[str], deadline: float,
                       quiet: tuple[float, float], records: list[FaultRecord],
                       every_kind: bool = False) -> None:
    """Faults until ``deadline``: every kind once in a seeded order, then seeded random picks.
    ``every_kind``: the first pass over the kinds runs to its end even past the deadline (how
    long a fault and its recovery take depends on the machine's load, and a kind that never ran
    proves nothing)."""
    order = list(kinds)
    ctx.rng.shuffle(order)
    while True:
        pause = ctx.rng.uniform(*quiet)
        if not (every_kind and order) and time.monotonic() + pause + ctx.hold[1] + 2.0 > deadline:
            return
        await asyncio.sleep(pause)  # schedule pacing (the quiet period), not synchronisation
        kind = order.pop(0) if order else ctx.rng.choice(kinds)
        invoked = time.monotonic()
        rec = FaultRecord(kind, invoked, invoked=invoked)
        records.append(rec)
        ctx.log(f"inject {kind}")
        try:
            await ALL_FAULTS[kind](ctx, rec)
        except (OSError, RuntimeError, TimeoutError) as exc:
            rec.error = rec.error or f"{type(exc).__name__}: {exc}"
        rec.end = time.monotonic()
        try:
            await asyncio.to_thread(ctx.cluster.wait_ready, 60)
            rec.ready = time.monotonic()
        except TimeoutError:
            rec.error = rec.error or "no serving leader on every shard 60 s after healing"
        ctx.log(f"healed {kind} {rec.detail}")
