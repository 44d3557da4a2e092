"""Moving shard replicas between nodes (kvps/rebalance.py) on a real cluster while pushes stream."""
from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import aiohttp
import numpy as np
import pytest

import kvps_client as kc
from kvps.assignment import Assignment
from kvps.delta import frame
from kvps.placement import block_shard
from kvps.rebalance import Mover

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
    with urllib.request.urlopen(cluster.cfg.node(node).admin_url + "/v1/assignment", timeout=2) as r:
        return Assignment.from_json(json.loads(r.read()))


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
        async with kc.Client(cluster.endpoints, token=cluster.token, seed=1, timeout=60) as ps, \
                aiohttp.ClientSession() as session:
            await ps.create(KEY, np.zeros(1, np.float32))
            stop, acks = asyncio.Event(), []
            workers = [asyncio.create_task(count_pushes(ps, stop, acks)) for _ in range(3)]
            try:
                await asyncio.to_thread(wait_for, lambda: len(acks) >= 30, 30, "30 acks")
                mover = Mover.over_http(session, cluster.token, lambda: list(cfg.nodes), cfg.node,
                                        timeout=120)
                leader = cluster.leader(shard)["node"]
                first = await mover.move(shard, leader, spare)  # the leader's replica moves
                n = len(acks) + 30
                await asyncio.to_thread(wait_for, lambda: len(acks) >= n, 30, "acks after move 1")
                follower = next(m for m in assignment_of(cluster, spare).nodes_of(shard)
                                if m != spare and m != cluster.leader(shard)["node"])
                second = await mover.move(shard, follower, leader)  # a follower's moves back
                n = len(acks) + 30
                await asyncio.to_thread(wait_for, lambda: len(acks) >= n, 30, "acks after move 2")
            finally:
                stop.set()
                await asyncio.gather(*workers)
            value, version = await ps.get(KEY)
            return len(acks), acks, value, version, first, second, follower, leader

    acked, acks, value, version, first, second, follower, leader = asyncio.run(main())
    print("moves:", first.to_json(), second.to_json())
    assert value[0] == acked, f"{acked} pushes acknowledged, counter says {value[0]}"
    assert version == acked
    assert first.leader_moved and not second.leader_moved
    gaps = np.diff(np.array(acks))
    assert gaps.max() < 5.0, f"pushes stalled for {gaps.max():.2f}s during the moves"

    final = sorted((set(cfg.replica_nodes(shard)) - {leader, follower}) | {spare, leader})
    for node in cfg.nodes:  # every node follows the final assignment
        assert sorted(assignment_of(cluster, node.id).nodes_of(shard)) == final
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
