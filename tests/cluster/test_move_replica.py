"""Moving shard replicas between nodes (kvps/rebalance.py) on a real cluster while pushes stream."""
from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import numpy as np
import pytest

import kvps_client as kc
from kvps.assignment import Assignment
from kvps.delta import frame
from kvps.placement import block_shard

from conftest import wait_for

pytestmark = pytest.mark.cluster

KEY = "counter"


def rpc(cluster, node: int, shard: int, op: str, meta: dict) -> dict | None:
    url = cluster.cfg.node(node).data_url(shard) + "/v1/rpc/" + op
    req = urllib.request.Request(url, data=frame.encode(frame.KIND_REQUEST, meta), method="POST",
                                 headers={"Authorization": f"Bearer {cluster.token}"})
    try:
        with urllib.request.urlopen(req, timeout=2) as resp:
            return frame.decode(resp.read()).meta
    except OSError:
        return None


def converged(cluster, shard: int, nodes: list[int]) -> bool:
    hashes = [rpc(cluster, n, shard, "state_hash", {}) for n in nodes]
    return None not in hashes and len({(h["hash"], h["applied_index"]) for h in hashes}) == 1


def assignment_of(cluster, node: int) -> Assignment:
    req = urllib.request.Request(cluster.cfg.node(node).admin_url + "/v1/assignment",
                                 headers={"Authorization": f"Bearer {cluster.token}"})
    with urllib.request.urlopen(req, timeout=2) as r:
        return Assignment.from_json(json.loads(r.read()))


def admin(cluster, method: str, path: str, body: dict | None = None, node: int = 0) -> dict:
    req = urllib.request.Request(cluster.cfg.node(node).admin_url + path, method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {cluster.token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def move(cluster, shard: int, source: int, target: int) -> dict:
    """Queue a move through any node (they forward to the metadata leader) and wait for it."""
    done = admin(cluster, "GET", "/v1/meta")["rebalance"]["moves_done"]
    admin(cluster, "POST", "/v1/moves", {"shard": shard, "source": source, "target": target},
          node=target % 3)
    rebalance = wait_for(lambda: (lambda r: r["moves_done"] > done and r["moving"] is None and r)(
        admin(cluster, "GET", "/v1/meta")["rebalance"]), 120, f"the move of shard {shard}")
    return rebalance["last"]


async def count_pushes(ps, stop: asyncio.Event, acks: list[float]) -> None:
    one = np.ones(1, np.float32)
    while not stop.is_set():
        await ps.push({KEY: one})
        acks.append(time.monotonic())


def test_move_leader_then_follower_replica_while_pushes_stream(cluster_factory):
    cluster = cluster_factory(nodes=4, shards=2).start()
    cfg = cluster.cfg
    shard = block_shard(KEY, 0, cfg.shards)
    spare = next(n.id for n in cfg.nodes if n.id not in cfg.replica_nodes(shard))

    async def main():
        async with kc.Client(cluster.endpoints, token=cluster.token, seed=1, timeout=60) as ps:
            await ps.create(KEY, np.zeros(1, np.float32))
            stop, acks = asyncio.Event(), []
            workers = [asyncio.create_task(count_pushes(ps, stop, acks)) for _ in range(3)]
            try:
                await asyncio.to_thread(wait_for, lambda: len(acks) >= 30, 30, "30 acks")
                # only the moves asked for: no evening-out by the rebalancer meanwhile
                await asyncio.to_thread(admin, cluster, "POST", "/v1/rebalance", {"auto": False})
                leader = (await asyncio.to_thread(wait_for, lambda: cluster.leader(shard), 20, "a leader"))["node"]
                first = await asyncio.to_thread(move, cluster, shard, leader, spare)  # the leader's
                n = len(acks) + 30
                await asyncio.to_thread(wait_for, lambda: len(acks) >= n, 30, "acks after move 1")
                now_leader = await asyncio.to_thread(wait_for, lambda: cluster.leader(shard), 20, "a leader")
                placed = Assignment.from_json((await asyncio.to_thread(admin, cluster, "GET", "/v1/meta"))["assignment"])
                follower = next(m for m in placed.nodes_of(shard)
                                if m != spare and m != now_leader["node"])
                second = await asyncio.to_thread(move, cluster, shard, follower, leader)  # a follower's
                n = len(acks) + 30
                await asyncio.to_thread(wait_for, lambda: len(acks) >= n, 30, "acks after move 2")
            finally:
                stop.set()
                await asyncio.gather(*workers)
            value, version = await ps.get(KEY)
            return len(acks), acks, value, version, first, second, follower, leader

    acked, acks, value, version, first, second, follower, leader = asyncio.run(main())
    print("moves:", first, second)
    assert value[0] == acked, f"{acked} pushes acknowledged, counter says {value[0]}"
    assert version == acked
    # the first move took the leader's replica (leadership had to move first); the second a
    # follower's, unless leadership landed on it meanwhile
    assert first["leader_moved"] or second["leader_moved"], (first, second)
    gaps = np.diff(np.array(acks))
    assert gaps.max() < 5.0, f"pushes stalled for {gaps.max():.2f}s during the moves"

    final = sorted((set(cfg.replica_nodes(shard)) - {leader, follower}) | {spare, leader})
    for node in cfg.nodes:  # every node follows the final assignment
        wait_for(lambda: sorted(assignment_of(cluster, node.id).nodes_of(shard)) == final, 10,
                 f"node {node.id} to follow the final assignment")
    addresses = sorted(cfg.node(n).raft_address(shard) for n in final)
    for n in final:  # every member's Raft group is exactly the final one
        wait_for(lambda: (rpc(cluster, n, shard, "membership", {"op": "members"}) or {})
                 .get("members") == addresses, 20, f"node {n}'s member list")
    wait_for(lambda: converged(cluster, shard, final), 30, "the final replicas to converge")
    cmap = cluster.cluster_map()
    assert sorted(r["node"] for r in cmap["shards"][shard]["replicas"]) == final
    # the replica moved away from `follower` is stopped and its data deleted
    wait_for(lambda: not (cluster.data_dir / f"node-{follower}" / f"shard-{shard}").exists(), 10,
             "the retired replica's data to be deleted")
    assert rpc(cluster, follower, shard, "state_hash", {}) is None
