"""Shared memory between a worker and the nodes on its host, in a real cluster.

Pulls through a same-host leader's mirror (kvps.delta.mirror, kvps_client._shm): they return what
TCP pulls return and send no request; ``Client(shm=False)`` never reads one; a worker reads its
own writes across a leader killed or paused while it reads the mirror.

Pushes through the worker's ring (kvps.delta.ring, kvps_client._ring, kvps.service.ring): they
apply what TCP pushes apply; a worker writing over its ring while its pushes are in flight gets
each push applied as checked or refused, never changed after the check; a worker killed while it
writes into its ring leaves every push whole and nothing mapped on the nodes."""
from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import urllib.request

import numpy as np
import pytest

import kvps_client as kc
from conftest import ROOT, module_cluster, wait_for
from kvps.delta import ring as ring_layout
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


def test_ring_pushes_apply_what_tcp_pushes_apply(cluster):
    async def main():
        async with kc.Client(cluster.endpoints, token=cluster.token, seed=5) as ps, \
                kc.Client(cluster.endpoints, token=cluster.token, seed=6, shm=False) as tcp:
            start = np.random.default_rng(0).standard_normal((700, 900)).astype(np.float32)
            for c, key in ((ps, "ring/mine"), (tcp, "ring/theirs")):
                await c.create(key, start, optimizer=kc.Adam(lr=0.01))
            for step in range(4):
                grad = np.random.default_rng(10 + step).standard_normal(start.shape).astype(np.float32)
                await asyncio.gather(ps.push({"ring/mine": grad}), tcp.push({"ring/theirs": grad}))
            mine = (await tcp.pull("ring/mine"))["ring/mine"]
            assert np.array_equal(mine, (await tcp.pull("ring/theirs"))["ring/theirs"])
            assert not np.array_equal(mine, start)
            wire = ps.sender.wire
            assert wire.ring_requests >= 4 and wire.ring_bytes_sent >= 4 * start.nbytes
            assert tcp.sender.wire.ring_requests == 0 and not wire._no_ring
            return wire.ring_bytes_sent

    sent = asyncio.run(main())
    copied = sum(_node_series(url, "kvps_ring_bytes_total") for url in cluster.endpoints)
    assert copied >= sent, "the nodes' metrics miss bodies copied out of rings"
    assert sum(_node_series(url, "kvps_ring_refused_total") for url in cluster.endpoints) == 0


def _node_series(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def test_a_worker_cannot_change_a_push_after_sending_it(cluster):
    """A thread writes random bytes over the ring's first places (where each push's body goes)
    while pushes of ones are in flight: each push is applied as checked (the node copied it
    before the check) or refused as corrupt; the value is minus the number applied, everywhere.
    One block, so that each push is one request (a push refused by one shard may have been
    applied by another)."""
    seed = random.randrange(1 << 30)
    print("seed", seed)

    async def main():
        async with kc.Client(cluster.endpoints, token=cluster.token, seed=7) as ps:
            shape = (256, 1024)  # 1 MiB: one block
            await ps.create("scribbled", np.zeros(shape, np.float32), optimizer=kc.SGD(lr=1.0))
            one = np.ones(shape, np.float32)
            await ps.push({"scribbled": one})  # makes the ring
            applied, refused, stop = 1, 0, threading.Event()
            wire = ps.sender.wire

            def scribble() -> None:
                rng = np.random.default_rng(seed)
                while not stop.is_set():
                    ring = wire._ring  # (a fresh one after a request went unanswered)
                    if ring is not None and not ring.closed:
                        at = ring_layout.HEADER + int(rng.integers(0, (3 << 19) - 256))
                        ring._bytes[at:at + 256] = rng.integers(0, 256, 256, dtype=np.uint8)
                    stop.wait(rng.uniform(0, 0.004))  # paced: some pushes get through whole

            thread = threading.Thread(target=scribble, daemon=True)
            thread.start()
            try:
                for n in range(400):  # 40 pushes, more until both outcomes were seen
                    if n >= 40 and applied > 1 and refused:
                        break
                    try:
                        await ps.push({"scribbled": one})
                        applied += 1
                    except (kc.CodecError, kc.InvalidRequest):
                        refused += 1
            finally:
                stop.set()
                thread.join()
            print("applied", applied, "refused", refused)
            got = (await ps.pull("scribbled", consistency="linearizable"))["scribbled"]
            assert (got == -applied).all(), f"seed {seed}: values {np.unique(got)[:5]}, {applied} pushes applied"
            assert applied > 1 and refused > 0, f"seed {seed}: {applied} applied, {refused} refused"

    asyncio.run(main())


_DYING = textwrap.dedent("""
    import asyncio, os, signal, sys
    import numpy as np
    import kvps_client as kc
    from kvps_client import _ring

    armed = [False]
    if sys.argv[3] == "inside":  # dies in the middle of copying a body into the ring, once armed
        place = _ring.PushRing.place

        def dying_place(self, parts):
            if armed[0]:
                self._bytes[64:64 + len(parts[-1]) // 2] = 7
                os.kill(os.getpid(), signal.SIGKILL)
            return place(self, parts)

        _ring.PushRing.place = dying_place

    async def main():
        endpoints, token = sys.argv[1].split(","), sys.argv[2]
        async with kc.Client(endpoints, token=token, seed=1, timeout=60) as ps:
            one = np.ones((4096, 1024), np.float32)  # 16 MiB a push
            await ps.push({"dying": one})
            print("pushing", flush=True)
            armed[0] = True
            while True:
                await ps.push({"dying": one})

    asyncio.run(main())
""")


def _ring_maps(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as f:
        return sum("kvps-push-ring" in line for line in f)


def test_a_worker_killed_while_writing_its_ring(cluster):
    """kill -9 of a worker in the middle of copying a body into its ring, and twice at a random
    moment of its pushes (16 MiB each, written into its ring): every block's part of a push is
    applied whole or not at all (each block holds one value), the nodes drop their mappings of
    its ring, and the cluster serves the next worker."""
    seed = random.randrange(1 << 30)
    print("seed", seed)
    rng = random.Random(seed)

    async def create():
        async with kc.Client(cluster.endpoints, token=cluster.token, seed=8) as ps:
            await ps.create("dying", np.zeros((4096, 1024), np.float32), optimizer=kc.SGD(lr=1.0))

    asyncio.run(create())
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for when in ("inside", "any", "any"):
        worker = subprocess.Popen([sys.executable, "-c", _DYING, ",".join(cluster.endpoints), cluster.token, when],
                                  stdout=subprocess.PIPE, env=env, cwd=ROOT)
        try:
            assert worker.stdout.readline().strip() == b"pushing", f"seed {seed}"
            if when == "inside":
                assert worker.wait(timeout=60) == -signal.SIGKILL
            else:
                threading.Event().wait(rng.uniform(0.0, 0.4))  # a moment inside its push loop
        finally:
            worker.kill()
            worker.wait()
    nodes = [p.pid for p in cluster.procs.values()]
    wait_for(lambda: sum(_ring_maps(pid) for pid in nodes) == 0, 20,
             f"the nodes let go of the dead workers' rings (seed {seed})")

    async def check():
        async with kc.Client(cluster.endpoints, token=cluster.token, seed=9) as ps:
            versions = await ps.push({"dying": np.ones((4096, 1024), np.float32)})
            got = (await ps.pull("dying", consistency="linearizable"))["dying"]
            # a push of 16 blocks is several requests (per shard, 4 MiB at most): a worker killed
            # between them leaves some applied, as over TCP; each block's part is whole or absent
            info = await ps.describe("dying")
            blocks = got.reshape(-1, info["block_rows"], 1024)
            assert (blocks == blocks[:, :1, :1]).all(), f"seed {seed}: a block's part applied in part"
            assert (got <= -2).all() and (got == np.round(got)).all(), f"seed {seed}: {np.unique(got)}"
            assert ps.sender.wire.ring_requests > 0 and versions["dying"] > 1

    asyncio.run(check())


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
