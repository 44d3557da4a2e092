"""``server.procs = 1``: every replica of a node in the node's process, one Raft ticker for all.

Real node processes on 127.0.0.1; the last test runs three ``ResidentReplica``s of one shard in
this process to halt one of them and restart it alone, as its node does.
"""
from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import wait_for

import kvps_client as kc
from kvps.command import CreateKey, Push
from kvps.config import RaftConfig, ServerConfig
from kvps.merge import PushRequest
from kvps.node.local import free_port_base, make_config, ports_needed, wait_until
from kvps.placement import block_shard
from kvps.raft.ticker import GroupHalted, Ticker
from kvps.replica.resident import ResidentReplica
from kvps.service.auth import TokenStore

pytestmark = pytest.mark.cluster

KEY = "counter"
RESIDENT = ServerConfig(procs=1, raft_threads=2)


def threads_of(pid: int) -> list[str]:
    return [Path(f"/proc/{pid}/task/{t}/comm").read_text().strip()
            for t in os.listdir(f"/proc/{pid}/task")]


def children_of(pid: int) -> list[int]:
    out: list[int] = []
    for t in os.listdir(f"/proc/{pid}/task"):
        out += [int(c) for c in Path(f"/proc/{pid}/task/{t}/children").read_text().split()]
    return out


def test_every_replica_of_a_node_lives_in_its_process_on_one_raft_thread(cluster_factory):
    cluster = cluster_factory(shards=4, server=RESIDENT).start()
    # within 30 s of start-up every node leads shards / nodes ± 1 (kvps.node.leaders)
    wait_until(cluster.leaders_spread, 30, "every shard led, leaders spread over the nodes")
    cmap = cluster.cluster_map()
    for shard in cmap["shards"]:
        for r in shard["replicas"]:
            assert r["pid"] == cluster.procs[r["node"]].pid, r  # the node's own process
    for node, proc in cluster.procs.items():
        assert children_of(proc.pid) == []  # no replica processes
        names = threads_of(proc.pid)
        # two threads tick the node's four shard groups and its metadata group (raft_threads):
        # no tick thread per group (pysyncobj's own are named raft-tick)
        assert sorted(n for n in names if n.startswith("raft-ticker")) == ["raft-ticker-0", "raft-ticker-1"], names
        assert "raft-tick" not in names, names

    async def main():
        async with kc.Client(cluster.endpoints, token=cluster.token, seed=3, timeout=30) as ps:
            await ps.create("w", np.zeros((64, 8), np.float32), optimizer=kc.SGD(lr=1.0))
            for _ in range(5):
                await ps.push({"w": np.ones((64, 8), np.float32)})
            return await ps.pull(["w"])

    assert np.array_equal(asyncio.run(main())["w"], np.full((64, 8), -5.0, np.float32))


async def count_pushes(ps, stop: asyncio.Event, acks: list[float]) -> None:
    one = np.ones(1, np.float32)
    while not stop.is_set():
        await ps.push({KEY: one})
        acks.append(time.monotonic())


def test_a_node_killed_under_pushes_loses_nothing_and_comes_back(cluster_factory):
    """kill -9 of a whole node (all its replicas at once): its shards elect elsewhere, no
    acknowledged push is lost or applied twice, and the restarted node catches up."""
    cluster = cluster_factory(shards=3, server=RESIDENT).start()
    shard = block_shard(KEY, 0, cluster.cfg.shards)

    async def main():
        async with kc.Client(cluster.endpoints, token=cluster.token, seed=5, timeout=60) as ps:
            await ps.create(KEY, np.zeros(1, np.float32))
            stop, acks = asyncio.Event(), []
            workers = [asyncio.create_task(count_pushes(ps, stop, acks)) for _ in range(3)]
            await asyncio.to_thread(wait_until, lambda: len(acks) >= 30, 30, "30 acks")
            node = (await asyncio.to_thread(cluster.wait_leader, shard))["node"]
            killed_at = time.monotonic()
            cluster.kill_node(node)
            await asyncio.to_thread(wait_until, lambda: any(t > killed_at for t in acks), 30,
                                    "an ack after the node was killed")
            cluster.start_node(node)
            restarted.append(time.monotonic())
            n_after = len(acks) + 30
            await asyncio.to_thread(wait_until, lambda: len(acks) >= n_after, 30, "more acks")
            stop.set()
            await asyncio.gather(*workers)
            value, version = await ps.get(KEY)
            return len(acks), value, version, node

    restarted: list[float] = []
    acked, value, version, node = asyncio.run(main())
    assert value[0] == acked, f"{acked} pushes acknowledged, counter says {value[0]}"
    assert version == acked

    def caught_up():  # the same state (hash and applied index) on the three replicas
        got = {cluster.state_hash(n, shard) for n in cluster.cfg.replica_nodes(shard)}
        return None not in got and len(got) == 1
    wait_until(caught_up, 60, f"node {node}'s replica to catch up after its restart")
    # The restarted node replayed its journals before anything read its replicas' state: no
    # entry was applied before the replica was wired (it would be recorded as a failed apply).
    logs = "".join(p.read_text() for p in cluster.data_dir.glob("node-*/logs/*.log"))
    assert "raised in the applier" not in logs
    # Within 30 s of its restart the node leads its share again: one shard each.
    wait_until(cluster.leaders_spread, max(1.0, restarted[0] + 30 - time.monotonic()),
               "the leaders to spread over the nodes again after the restart")


# ---- one replica halts in a process that hosts others ---------------------------------------------

# Election timeouts no stall of this test process on a loaded machine runs out: the test talks
# to the leaders it found and is not about elections.
STEADY = RaftConfig(election_timeout_min=1.0, election_timeout_max=2.0, heartbeat_period=0.05,
                    leader_fallback_timeout=2.0, connection_timeout=3.0, connection_retry=0.1)


class _Residents:
    """``ResidentReplica``s of shards 0 and 1 on three 'nodes' (a ticker each), in this process."""

    def __init__(self, root: Path) -> None:
        port = free_port_base(ports_needed(3, 2), seed=17)
        self.cfg = make_config(nodes=3, shards=2, replicas=3, port=port, block_bytes=1 << 20,
                               raft=STEADY, server=RESIDENT)
        (root / "token").write_text("test-token-for-residents\n")
        self.tickers = [Ticker(name=f"ticker-{n}") for n in range(3)]
        self.downs: list[tuple[int, int, str]] = []
        self.replicas = {
            (n, s): ResidentReplica(self.cfg, n, s, data_dir=root / f"node-{n}",
                                    secret=b"test-secret-for-resident-replicas-0123",
                                    tokens=TokenStore(root / "token"), ticker=self.tickers[n])
            for n in range(3) for s in range(2)}

    def start(self, n: int, s: int) -> None:
        peers = [self.cfg.node(m).raft_address(s) for m in range(3) if m != n]
        self.replicas[(n, s)].start(peers=peers, joining=False, on_down=self._down)

    def _down(self, rr: ResidentReplica, reason: str) -> None:
        self.downs.append((rr.node_id, rr.shard, reason))

    def leader(self, shard: int) -> ResidentReplica | None:
        return next((rr for (n, s), rr in self.replicas.items()
                     if s == shard and rr.alive and rr.read_status()["serving"]), None)

    async def stop(self) -> None:
        await asyncio.gather(*(rr.stop() for rr in self.replicas.values()), return_exceptions=True)
        for t in self.tickers:
            t.stop()


def _create(key: str) -> CreateKey:
    return CreateKey(key, (1,), "float32", 1, {"name": "add"}, "sum", ((0, np.zeros(1, np.float32)),))


def _push(key: str, seq: int) -> PushRequest:
    return PushRequest("test-client", seq, seq, dense=((key, 0, np.ones(1, np.float32)),))


def test_a_halted_replica_restarts_alone_and_its_siblings_keep_serving(tmp_path):
    """A replica whose apply cannot go on (GroupHalted: kvps.replica.resident's ``fatal``) stops
    before the entry, goes down alone (its node-mate of another shard, on the same ticker, keeps
    replicating), and started again replays its journal and catches up."""
    async def main():
        res = _Residents(tmp_path)
        try:
            for key in res.replicas:
                res.start(*key)
            await asyncio.to_thread(wait_for, lambda: res.leader(0) and res.leader(1), 30,
                                    "a serving leader of both shards")
            await res.leader(0).replica.write(_create(KEY))
            await res.leader(1).replica.write(_create("other"))
            victim = next(k for k, rr in res.replicas.items() if k[1] == 0 and rr is not res.leader(0))
            sibling = res.replicas[(victim[0], 1)]
            host = res.replicas[victim].replica.host
            apply = host.apply

            def halting_apply(cmd, _apply=apply):
                if isinstance(cmd, Push) and host.lookup(lambda s: s.key_version_or_absent(KEY)) == 2:
                    raise GroupHalted("test: the third push cannot be applied here")
                return _apply(cmd)
            host.apply = halting_apply
            for seq in range(5):
                await res.leader(0).replica.push(_push(KEY, seq))
            await asyncio.to_thread(wait_for, lambda: res.downs, 30, "the victim to halt")
            assert res.downs[0][:2] == victim and "third push" in res.downs[0][2]
            assert not res.replicas[victim].alive and res.replicas[victim].last_exit
            for seq in range(5, 8):  # its sibling on the same ticker still follows shard 1
                await res.leader(1).replica.push(_push("other", seq))
            await asyncio.to_thread(
                wait_for, lambda: sibling.replica.host.lookup(lambda s: s.key_version_or_absent("other")) == 3,
                30, "the sibling to apply shard 1's pushes")
            # Its node restarts it (Node._supervise_once; here the test): it replays its journal,
            # applies the entry it halted at, and catches up with the other two.
            res.start(*victim)

            def versions():
                reps = [res.replicas[(n, 0)] for n in range(3)]
                if not all(rr.alive for rr in reps):
                    return None
                got = [rr.replica.host.lookup(lambda s: s.key_version_or_absent(KEY)) for rr in reps]
                return got if got == [5, 5, 5] else None
            await asyncio.to_thread(wait_for, versions, 30, "the restarted replica to catch up")
        finally:
            await res.stop()

    asyncio.run(main())
