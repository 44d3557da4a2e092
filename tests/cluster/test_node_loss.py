"""A node lost for good that ran a metadata replica: declared dead after ``node_dead_after``, its
shard replicas re-created on the live nodes, then its metadata replica moved, then removed; every
acknowledged push present once (``kvps/node/liveness.py``, ``Mover._replace``, ``MetaMover``).
The chaos ``lose-node`` fault covers a joined node lost under training."""
from __future__ import annotations

import asyncio
import os
import shutil
import signal

import numpy as np
import pytest
from conftest import wait_for

import kvps_client as kc
from kvps.config import ServerConfig
from kvps_chaos.elastic import meta, replicas_agree, settled

pytestmark = pytest.mark.cluster

KEYS = [f"loss/c{i}" for i in range(4)]  # spread over both shards


def test_a_lost_metadata_node_is_replaced_and_nothing_acknowledged_is_lost(cluster_factory):
    c = cluster_factory(nodes=4, shards=2, server=ServerConfig(node_dead_after=3.0)).start(timeout=90)
    one = np.ones(1, np.float32)

    async def run() -> tuple[int, dict[str, float]]:
        async with kc.Client(c.endpoints, c.token, seed=0, timeout=60) as ps:
            for k in KEYS:
                await ps.create(k, np.zeros(1, np.float32), optimizer=kc.Add())
            acked = 0
            for _ in range(10):
                await ps.push({k: one for k in KEYS})
                acked += 1
            # node 1 runs a metadata replica and a replica of both shards: lose it for good
            os.killpg(c.procs[1].pid, signal.SIGKILL)
            c.procs[1].wait()
            shutil.rmtree(c.data_dir / "node-1")

            def replaced():
                m = settled(c, [0, 2, 3])
                return m if m is not None and m["nodes"][1]["state"] == "removed" else None

            waiting = asyncio.create_task(asyncio.to_thread(
                wait_for, replaced, 120, "node 1 declared dead, replaced and removed"))
            while not waiting.done():  # pushes go on throughout the re-replication
                await ps.push({k: one for k in KEYS})
                acked += 1
            m = await waiting
            assert m["meta_members"] == [0, 2, 3] and all(1 not in s["nodes"] for s in m["assignment"]["shards"])
            await ps.push({k: one for k in KEYS})
            acked += 1
            return acked, {k: float((await ps.pull([k]))[k][0]) for k in KEYS}

    acked, values = asyncio.run(run())
    assert values == {k: float(acked) for k in KEYS}, (acked, values)
    wait_for(lambda: replicas_agree(c), 60, "every shard's three replicas to agree")
    assert (meta(c) or {}).get("rebalance", {}).get("moving") is None
