"""Pulls through a same-host leader's shared-memory mirror (kvps.delta.mirror, kvps_client._shm), in a real cluster:
they return what TCP pulls return and send no request; ``Client(shm=False)`` never reads one; a
worker reads its own writes across a leader killed or paused while it reads the mirror."""
from __future__ import annotations

import asyncio
import os
import signal

import numpy as np
import pytest

import kvps_client as kc
from conftest import module_cluster
from kvps.config import RaftConfig
from kvps.replica import mirror as shm

pytestmark = [pytest.mark.cluster,
              pytest.mark.skipif(not shm.supported(), reason="shared-memory mirrors need x86-64 and /dev/shm")]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    try:
        yield from module_cluster(tmp_path_factory, "shm", shards=2)
    finally:
        shm.sweep()


def test_mirror_pulls_equal_tcp_pulls_and_send_nothing(cluster):
    async def main():
        async with kc.Client(cluster.endpoints, token=cluster.token, seed=1) as ps, \
                kc.Client(cluster.endpoints, token=cluster.token, seed=2, shm=False) as tcp:
            keys = {f"shm/{i}": np.random.default_rng(i).standard_normal((300, 700)).astype(np.float32)
                    for i in range(4)}  # 840 KB each, blocks on both shards
            for k, v in keys.items():
                await ps.create(k, v, optimizer=kc.SGD(lr=0.25))
            await ps.pull(list(keys))  # learns the mirrors' places
            for step in range(5):
                grads = {k: np.random.default_rng(100 + step).standard_normal(v.shape).astype(np.float32)
                         for k, v in keys.items()}
                await (ps if step % 2 else tcp).push(grads)
                before = ps.stats.requests
                mine = await ps.pull(list(keys))
                assert ps.stats.requests == before, "a pull the mirrors could serve sent a request"
                theirs = await tcp.pull(list(keys))
                for k in keys:
                    assert np.array_equal(mine[k], theirs[k]), (step, k)
            assert ps.shared.blocks_read > 0 and ps.shared.bytes_read > 0
            assert tcp.shared.blocks_read == 0
            # nothing changed: the mirror says so without a copy
            copied = ps.shared.bytes_read
            await ps.pull(list(keys))
            assert ps.shared.bytes_read == copied

    asyncio.run(main())


def test_blocks_handed_out_are_never_written_over(cluster):
    """A pull reads a changed block into the buffer of the version before it when nothing else
    holds that one; blocks ``pull_blocks`` handed out keep their values."""
    async def main():
        async with kc.Client(cluster.endpoints, token=cluster.token, seed=4) as ps:
            await ps.create("held", np.zeros((100, 1000), np.float32))  # Add: values count pushes
            one = np.ones((100, 1000), np.float32)
            await ps.pull("held")
            handed = []
            for step in range(1, 7):
                await ps.push({"held": one})
                if step % 2:
                    layout, blocks = (await ps.pull_blocks(["held"]))["held"]
                    handed.append((step, blocks))
                else:
                    assert ((await ps.pull("held"))["held"] == step).all()
            assert ps.shared.blocks_read >= 5
            for step, blocks in handed:
                for block in blocks:
                    assert (block == step).all(), f"a block handed out at step {step} changed"
            assert ps.shared.reused >= 2, "no block buffer was ever reused"

    asyncio.run(main())


@pytest.mark.parametrize("fault", ["kill", "pause"])
def test_a_worker_reads_its_own_writes_across_a_leader_fault(cluster_factory, fault):
    """Push, pull (from the leader's mirror), fault the leader, push again (to the new leader),
    pull: the second push is in what the pull returns, not the old leader's mirror's value."""
    # kill: a long election timeout, so the mirror's lease (half of it) outlasts the fast
    # failover that replaces a dead leader (~0.3 s): only the writer's lock tells the reader
    c = cluster_factory(shards=1, **({"raft": RaftConfig(election_timeout_min=4.0, election_timeout_max=6.0,
                                                           connection_timeout=8.0)}
                                     if fault == "kill" else {}))
    c.start(timeout=90)
    try:
        async def main():
            async with kc.Client(c.endpoints, token=c.token, seed=3, timeout=60) as ps:
                await ps.create("rw", np.zeros((256, 512), np.float32))  # Add: the value sums pushes
                one = np.ones((256, 512), np.float32)
                await ps.push({"rw": one})
                await ps.pull("rw")
                got = (await ps.pull("rw"))["rw"]
                assert ps.shared.blocks_read > 0 and (got == 1).all()
                leader = c.wait_leader(0)
                if fault == "kill":
                    c.kill_node(leader["node"])
                else:
                    os.kill(leader["pid"], signal.SIGSTOP)
                try:
                    versions = await ps.push({"rw": one})  # retried until the new leader takes it
                    got = (await ps.pull("rw"))["rw"]
                    assert (got == 2).all(), f"read {got[0, 0]} after pushing twice ({fault})"
                    assert ps.shared.fallbacks > 0
                    assert max(ps._cache["rw"].versions) >= versions["rw"]
                    # the new leader's mirror serves the next pulls
                    read_before = ps.shared.blocks_read
                    await ps.push({"rw": one})
                    await ps.pull("rw")
                    assert ((await ps.pull("rw"))["rw"] == 3).all()
                    assert ps.shared.blocks_read > read_before
                finally:
                    if fault == "pause":
                        os.kill(leader["pid"], signal.SIGCONT)

        asyncio.run(main())
    finally:
        c.stop()
        shm.sweep()
