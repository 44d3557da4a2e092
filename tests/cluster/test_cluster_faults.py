"""Faults on real clusters: leader kills, follower restarts, whole-cluster crashes, lost replies."""
from __future__ import annotations

import asyncio
import json
import shutil
import signal
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

import kvps_client as kc
from kvps.config import ServerConfig
from kvps.delta import frame
from kvps.node.local import wait_until
from kvps.meta import meta_address
from kvps.placement import block_shard
from kvps.raft import recovery

pytestmark = pytest.mark.cluster

KEY = "counter"


def replica_hashes(cluster, shard: int) -> dict[int, tuple[str, int] | None]:
    """{node: (state hash, applied index)} for every replica of ``shard`` (None if unreachable)."""
    body = frame.encode(frame.KIND_REQUEST, {})
    out = {}
    for n in cluster.cfg.replica_nodes(shard):
        url = cluster.cfg.node(n).data_url(shard) + "/v1/rpc/state_hash"
        req = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Authorization": f"Bearer {cluster.token}"})
        try:
            with urllib.request.urlopen(req, timeout=2) as resp:
                meta = frame.decode(resp.read()).meta
                out[n] = (meta["hash"], meta["applied_index"])
        except OSError:
            out[n] = None
    return out


def converged(cluster, shard: int) -> bool:
    hashes = replica_hashes(cluster, shard)
    return None not in hashes.values() and len({h for h, _ in hashes.values()}) == 1


def client(cluster, **kw) -> kc.Client:
    return kc.Client(cluster.endpoints, token=cluster.token, seed=1, timeout=30, **kw)


async def count_pushes(ps, stop: asyncio.Event, acks: list[float]) -> None:
    one = np.ones(1, np.float32)
    while not stop.is_set():
        await ps.push({KEY: one})
        acks.append(time.monotonic())


def test_leader_kill_loses_nothing_and_resumes_fast(cluster_factory):
    cluster = cluster_factory().start()
    shard = block_shard(KEY, 0, cluster.cfg.shards)

    async def main():
        async with client(cluster) as ps:
            await ps.create(KEY, np.zeros(1, np.float32))
            stop, acks = asyncio.Event(), []
            workers = [asyncio.create_task(count_pushes(ps, stop, acks)) for _ in range(3)]
            await asyncio.to_thread(wait_until, lambda: len(acks) >= 30, 30, "30 acks")
            leader = await asyncio.to_thread(cluster.wait_leader, shard)
            killed_at = time.monotonic()
            cluster.kill_node(leader["node"], signal.SIGKILL)  # procs 1: the leader's whole node
            await asyncio.to_thread(wait_until, lambda: any(t > killed_at for t in acks), 10,
                                    "an ack after the kill")
            resumed = min(t for t in acks if t > killed_at) - killed_at
            # started again (on this thread: see start_node) once the survivors serve, so that its
            # start-up does not compete with their election on a 2-core machine
            cluster.start_node(leader["node"])
            n_after = len(acks) + 30
            await asyncio.to_thread(wait_until, lambda: len(acks) >= n_after, 30, "more acks")
            stop.set()
            await asyncio.gather(*workers)
            value, version = await ps.get(KEY)
            return len(acks), value, version, resumed

    acked, value, version, resumed = asyncio.run(main())
    assert value[0] == acked, f"{acked} pushes acknowledged, counter says {value[0]}"
    assert version == acked
    assert resumed < 2.0, f"pushes resumed {resumed:.2f}s after the leader was killed"
    wait_until(lambda: converged(cluster, shard), 30, "replicas to converge after restart")


def test_follower_restart_catches_up_from_journal(cluster_factory):
    cluster = cluster_factory().start()
    shard = block_shard(KEY, 0, cluster.cfg.shards)

    async def main():
        async with client(cluster) as ps:
            await ps.create(KEY, np.zeros(1, np.float32))
            for _ in range(20):
                await ps.push({KEY: np.ones(1, np.float32)})
            leader, follower, *_ = await asyncio.to_thread(cluster.wait_replicas, shard)
            cluster.kill_replica(follower)
            for _ in range(20):
                await ps.push({KEY: np.ones(1, np.float32)})
            return follower

    follower = asyncio.run(main())
    # Started again (its node, or the node's supervisor): it replays its journal and catches up.
    wait_until(lambda: (cluster.replica(shard, follower["node"]) or {}).get("pid") not in
               (None, follower["pid"]), 30, "the follower to be restarted")
    wait_until(lambda: converged(cluster, shard), 30, "the restarted follower to catch up")
    restarted = cluster.replica(shard, follower["node"])
    assert restarted["pid"] != follower["pid"]


def test_a_replica_whose_data_is_lost_recovers_without_voting_then_votes_again(cluster_factory):
    """A follower's shard directory (and its metadata replica's) deleted while its node is down:
    the node knows it hosted them (its ``hosted`` records), so it restarts them marked as
    recovering; they catch up from their leaders, leave recovery (their logs say so) and the
    markers are gone. Nothing acked is lost."""
    cluster = cluster_factory().start()
    shard = block_shard(KEY, 0, cluster.cfg.shards)

    async def push(n: int, create: bool = False) -> tuple[float, int]:
        async with client(cluster) as ps:
            if create:
                await ps.create(KEY, np.zeros(1, np.float32))
            for _ in range(n):
                await ps.push({KEY: np.ones(1, np.float32)})
            value, version = await ps.get(KEY)
            return float(value[0]), version

    asyncio.run(push(20, create=True))
    leader = cluster.wait_leader(shard)
    node = next(n for n in cluster.cfg.replica_nodes(shard) if n != leader["node"])
    node_dir = cluster.data_dir / cluster.cfg.node(node).data_dir
    assert (node_dir / "hosted" / f"shard-{shard}").exists()
    cluster.stop_node(node)
    shutil.rmtree(node_dir / f"shard-{shard}")
    shutil.rmtree(node_dir / "meta")  # its metadata replica's too (the first three nodes run one)
    assert asyncio.run(push(10)) == (30.0, 30)  # the other two commit meanwhile
    cluster.start_node(node)
    # its logs: logs/node.log, and logs/shard-N.log where replicas are processes of their own
    replica = cluster.cfg.node(node).raft_address(shard)
    meta = meta_address(cluster.cfg.node(node), cluster.cfg.shards)

    def logs() -> str:
        return "".join(p.read_text(errors="replace") for p in sorted((node_dir / "logs").glob("*.log")))
    wait_until(lambda: f"raft {replica}: caught up" in logs(), 60,
               "the emptied replica to catch up and leave recovery")
    assert f"raft {replica}: recovering lost state" in logs()
    assert not (node_dir / f"shard-{shard}" / recovery.MARKER).exists()
    wait_until(lambda: f"raft {meta}: caught up" in logs(), 60, "the metadata replica to recover")
    assert "metadata replica's data is gone" in logs()
    assert not (node_dir / "meta" / recovery.MARKER).exists()
    wait_until(lambda: (cluster.replica(shard, node) or {}).get("recovering") is False, 30,
               "its status to say it no longer recovers")
    wait_until(lambda: converged(cluster, shard), 30, "the replicas to converge")
    assert asyncio.run(push(5)) == (35.0, 35)


def test_whole_cluster_kill9_and_restart_keeps_acknowledged_pushes(cluster_factory):
    cluster = cluster_factory().start()

    async def push_some(n: int) -> int:
        async with client(cluster) as ps:
            await ps.create(KEY, np.zeros(1, np.float32))
            await ps.create("w", np.zeros((300, 1000), np.float32), optimizer=kc.SGD(lr=1.0))
            for _ in range(n):
                await ps.push({KEY: np.ones(1, np.float32), "w": np.ones((300, 1000), np.float32)})
            return n

    acked = asyncio.run(push_some(25))
    for node in cluster.cfg.nodes:
        cluster.kill_node(node.id, signal.SIGKILL)  # replicas die with their node
    cluster.start(timeout=90)

    async def read():
        async with client(cluster) as ps:
            return (await ps.get(KEY)), (await ps.pull("w"))["w"]

    (value, version), w = asyncio.run(read())
    assert value[0] == acked and version == acked
    np.testing.assert_array_equal(w, np.full((300, 1000), -acked, np.float32))


class LoseFirstPushReply:
    """Delivers the first push, then loses its reply and kills the shard leader before the client
    sees anything, so the client must retry the same push id against a new leader."""

    def __init__(self, inner, on_lost):
        self.inner, self.on_lost, self.lost = inner, on_lost, False

    async def open(self):
        await self.inner.open()

    async def close(self):
        await self.inner.close()

    async def request(self, method, url, body, *, headers, timeout):
        status, data = await self.inner.request(method, url, body, headers=headers, timeout=timeout)
        if url.endswith("/v1/rpc/push") and status == 200 and not self.lost:
            self.lost = True
            await asyncio.to_thread(self.on_lost)
            raise kc.Unavailable("reply lost on purpose")
        return status, data


@pytest.mark.parametrize("dedup", [True, False], ids=["dedup", "dedup-disabled"])
def test_push_whose_reply_is_lost_is_applied_once(cluster_factory, dedup):
    server = ServerConfig(unsafe_disable_dedup=not dedup)
    cluster = cluster_factory(server=server).start()
    shard = block_shard(KEY, 0, cluster.cfg.shards)

    def kill_leader():
        cluster.kill_replica(cluster.wait_leader(shard))

    async def main():
        transport = LoseFirstPushReply(kc.HttpTransport(), kill_leader)
        async with kc.Client(cluster.endpoints, token=cluster.token, seed=2, transport=transport) as ps:
            await ps.create(KEY, np.zeros(1, np.float32))
            versions = await ps.push({KEY: np.ones(1, np.float32)})
            value, version = await ps.get(KEY)
            return versions, value, version, ps.stats.retries

    versions, value, version, retries = asyncio.run(main())
    assert retries >= 1
    if dedup:
        assert value[0] == 1.0 and version == 1 and versions[KEY] == 1
    else:  # the debug switch proves this test would catch a double apply
        assert value[0] == 2.0


def test_replayed_push_is_answered_and_forged_push_id_is_refused(cluster_factory):
    """An exact replay of a push body is a duplicate (original answer, nothing applied); the same
    (client, seq) with other content is a forged or reused id: a typed error, nothing applied."""
    cluster = cluster_factory(shards=1).start()

    def body(value: float) -> bytes:
        return frame.encode(frame.KIND_REQUEST, {"client": "victim", "seq": 7, "floor": 7,
                                                 "dense": [{"key": KEY, "block": 0, "array": 0}]},
                            [np.full(1, value, np.float32)])

    def post(data: bytes) -> tuple[int, dict]:
        leader = wait_until(lambda: cluster.leader(0), 30, "a leader")
        req = urllib.request.Request(leader["data_url"] + "/v1/rpc/push", data=data, method="POST",
                                     headers={"Authorization": f"Bearer {cluster.token}"})
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, frame.decode(resp.read()).meta
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    async def create_and_read(read_only=False):
        async with client(cluster) as ps:
            if not read_only:
                await ps.create(KEY, np.zeros(1, np.float32))
            return await ps.get(KEY)

    asyncio.run(create_and_read())
    assert post(body(5.0)) == (200, {"versions": {KEY: 1}})
    assert post(body(5.0)) == (200, {"versions": {KEY: 1}})        # replay: same answer
    status, err = post(body(6.0))                                   # forged: other content
    assert status == 400 and err["error"] == "InvalidRequest" and "already used" in err["message"]
    value, version = asyncio.run(create_and_read(read_only=True))
    assert value[0] == 5.0 and version == 1
