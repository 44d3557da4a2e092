"""A node whose whole data directory was lost is refused under its old id; ``--replace`` brings it
back with every replica recovering, and no acknowledged push is lost (kvps.node.identity)."""
from __future__ import annotations

import asyncio
import shutil

import numpy as np
import pytest
from conftest import wait_for

import kvps_client as kc

pytestmark = pytest.mark.cluster

KEY = "identity/w"


def incarnations(c) -> dict[int, str]:
    return {n["id"]: n.get("incarnation") for n in c.admin("GET", "/v1/meta")["nodes"]}


def test_a_wiped_node_is_refused_under_its_id_and_replace_loses_nothing(cluster_factory):
    c = cluster_factory(nodes=3, shards=1).start(timeout=90)

    async def push(n: int, create: bool = False) -> float:
        async with kc.Client(c.endpoints, c.token, seed=0) as ps:
            if create:
                await ps.create(KEY, np.zeros(4, np.float32), optimizer=kc.Add())
            for _ in range(n):
                await ps.push({KEY: np.ones(4, np.float32)})
            return float((await ps.pull([KEY]))[KEY][0])

    assert asyncio.run(push(20, create=True)) == 20.0
    before = wait_for(lambda: (lambda i: i if all(i.values()) else None)(incarnations(c)), 30,
                      "every node's incarnation to be recorded")

    c.kill_node(2)
    shutil.rmtree(c.data_dir / "node-2")
    c.start_node(2)
    rc = wait_for(lambda: c.procs[2].poll(), 60, "the wiped node to refuse to start")
    log_text = (c.data_dir / "node-2" / "logs" / "node.log").read_text()
    assert rc != 0 and "refused to start" in log_text and "--replace" in log_text, log_text[-2000:]
    assert not list((c.data_dir / "node-2").glob("shard-*")), "no replica may start under the old id"
    assert asyncio.run(push(10)) == 30.0  # the other two keep committing

    c.start_node(2, replace=True, zone="rack-b")  # the replacement sits elsewhere: it says so
    replica = c.cfg.node(2).raft_address(0)

    def logs() -> str:  # logs/node.log, and logs/shard-N.log where replicas are processes
        return "".join(p.read_text(errors="replace") for p in sorted((c.data_dir / "node-2" / "logs").glob("*.log")))
    wait_for(lambda: f"raft {replica}: caught up" in logs(), 90,
             "the replaced node's replica to catch up and leave recovery")
    assert f"raft {replica}: recovering lost state" in logs()
    after = wait_for(lambda: (lambda i: i if i[2] not in (None, before[2]) else None)(incarnations(c)),
                     30, "the new incarnation to be recorded")
    assert after[0] == before[0] and after[1] == before[1]
    wait_for(lambda: len({c.state_hash(n, 0) for n in range(3)} - {None}) == 1, 60,
             "the three replicas to agree")
    assert asyncio.run(push(1)) == 31.0  # every acknowledged push, once
    zones = wait_for(lambda: (lambda z: z if z[2] == "rack-b" else None)(
        {n["id"]: n.get("zone", "") for n in c.admin("GET", "/v1/meta")["nodes"]}), 30,
        "node 2's zone (kvps node --zone) to be recorded")
    assert zones[0] == zones[1] == ""
