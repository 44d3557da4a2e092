"""User snapshots on real clusters: create / list / restore (by id and --at) / drop / export, the
timestamp contract under racing pushes, damaged files, a node killed mid-snapshot, a replica
that joined after the snapshot, and retention."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, module_cluster, wait_for

import kvps_client as kc
from kvps.config import RaftConfig, ServerConfig
from kvps.cli.snapshot import snapshot_state_dict

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # A cut that an election interrupts on a loaded machine can take longer than the default
    # hold allows (the coordinator then abandons it: a 503 these tests would read as a failure).
    yield from module_cluster(tmp_path_factory, "snap", shards=2, server=ServerConfig(snapshot_hold=20.0))


def run(coro):
    return asyncio.run(coro)


def client(cluster, **kw) -> kc.Client:
    return kc.Client(cluster.endpoints, token=cluster.token, seed=0, **kw)


def api(cluster, method: str, path: str, body: dict | None = None, endpoint: int = 0):
    req = urllib.request.Request(cluster.endpoints[endpoint] + path, method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {cluster.token}"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def kvps(cluster, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "KVPS_ENDPOINT": cluster.endpoints[0], "KVPS_TOKEN": cluster.token}
    out = subprocess.run([sys.executable, "-m", "kvps.cli", *args], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=300)
    if check:
        assert out.returncode == 0, out.stderr
    return out


def snapshot_files(cluster, snap_id: str) -> list[Path]:
    return sorted(cluster.data_dir.glob(f"node-*/**/snapshots/{snap_id}/*.kvsnap"))


def hashes_agree(cluster, shards: int) -> bool:
    """Every replica of every shard answers, with the same state hash."""
    try:
        return run(_hashes_agree(cluster, shards))
    except kc.KvpsError:
        return False


def _hashes_agree(cluster, shards: int):
    async def main():
        async with client(cluster) as ps:
            out = []
            for s in range(shards):
                urls = ps.cluster_map.replicas[s]
                hs = set()
                for u in urls:
                    from kvps.delta import frame
                    reply = await ps.sender.send_once(u, "state_hash", frame.encode(frame.KIND_REQUEST, {}))
                    hs.add((reply.meta["hash"], reply.meta["applied_index"]))
                out.append(len({h for h, _ in hs}) == 1)
            return all(out)
    return main()


# ---- the basic life cycle -------------------------------------------------------------------------

def test_create_list_restore_export_drop(cluster, tmp_path):
    async def setup():
        async with client(cluster) as ps:
            await ps.create("life/w", np.zeros((256, 512), np.float32), optimizer=kc.SGD(lr=1.0))
            await ps.create_table("life/emb", dim=4, optimizer=kc.SGD(lr=1.0))
            await ps.push({"life/w": np.ones((256, 512), np.float32)})
            await ps.push_rows("life/emb", np.array([3, 70]), np.ones((2, 4), np.float32))
            return (await ps.pull(["life/w"]))["life/w"], await ps.pull_rows("life/emb", np.array([3, 70]))
    w1, rows1 = run(setup())

    created = json.loads(kvps(cluster, "snapshot", "create", "--label", "first", "--json").stdout)
    assert created["label"] == "first" and created["shards"] == 2 and created["size"] > w1.nbytes
    listed = json.loads(kvps(cluster, "snapshot", "list", "--json").stdout)
    assert [s["id"] for s in listed] == [created["id"]]
    assert listed[0]["keys"] == 2
    for f in snapshot_files(cluster, created["id"]):  # every replica wrote its file, no leftovers
        assert f.stat().st_size > 0
    assert len(snapshot_files(cluster, created["id"])) == 3 * 2
    assert not list(cluster.data_dir.glob("node-*/**/*.kvsnap.tmp"))

    async def move_on():
        async with client(cluster) as ps:
            before = await ps.pull(["life/w"])  # the client now caches w's blocks and versions
            await ps.push({"life/w": np.ones((256, 512), np.float32)})
            await ps.push_rows("life/emb", np.array([3, 9]), np.ones((2, 4), np.float32))
            await ps.create("life/later", np.zeros(8, np.float32))
            return ps, before
    run(move_on())

    # restore by --at (a time after the snapshot's timestamp picks it), then check with a client
    # that cached the newer values: versions moved forward, so it sees the restored ones
    async def check_restored():
        async with client(cluster) as ps:
            newer = (await ps.pull(["life/w"]))["life/w"]
            assert np.all(newer == -2.0)
            at = created["time"] + 0.001
            out = kvps(cluster, "snapshot", "restore", "--at", str(at), "--json")
            assert json.loads(out.stdout)["restored"] == created["id"]
            w = (await ps.pull(["life/w"]))["life/w"]
            assert np.array_equal(w, w1)
            assert np.array_equal(await ps.pull_rows("life/emb", np.array([3, 70])), rows1)
            assert np.all(await ps.pull_rows("life/emb", np.array([9])) == 0)  # written after: gone
            with pytest.raises(kc.NotFound):
                await ps.describe("life/later", refresh=True)
            await ps.push({"life/w": np.ones((256, 512), np.float32)})  # training goes on from there
            assert np.all((await ps.pull(["life/w"]))["life/w"] == -2.0)
    run(check_restored())
    wait_for(lambda: hashes_agree(cluster, 2), 20, "replicas to agree after the restore")

    # export the snapshot (not the live state) to a torch file
    path = tmp_path / "snap.pt"
    kvps(cluster, "export", "--snapshot", created["id"], str(path))
    state = torch.load(path, weights_only=True)
    assert set(state) == {"life/w", "life/emb", "life/emb.ids"}
    assert np.array_equal(state["life/w"].numpy(), w1)
    assert state["life/emb.ids"].tolist() == [3, 70]
    assert np.array_equal(state["life/emb"].numpy(), rows1)

    # --at before any snapshot, and an unknown id: clear errors
    out = kvps(cluster, "snapshot", "restore", "--at", "2001-01-01T00:00:00", check=False)
    assert out.returncode != 0 and "no complete snapshot" in out.stderr
    out = kvps(cluster, "snapshot", "restore", "nope", check=False)
    assert out.returncode != 0 and "no complete snapshot" in out.stderr

    assert "dropped" in kvps(cluster, "snapshot", "drop", created["id"]).stdout
    assert json.loads(kvps(cluster, "snapshot", "list", "--json").stdout) == []
    wait_for(lambda: not snapshot_files(cluster, created["id"]), 10, "the files to be deleted")


def test_snapshot_api_errors(cluster):
    req = urllib.request.Request(cluster.endpoints[0] + "/v1/snapshots", method="GET")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 401
    status, body = api(cluster, "POST", "/v1/snapshots", {"label": 7})
    assert status == 400 and body["error"] == "InvalidRequest"
    status, body = api(cluster, "POST", "/v1/snapshots/restore", {"at": "yesterday-ish"})
    assert status == 400 and "not a time" in body["message"]


# ---- the timestamp contract -------------------------------------------------------------------------

def test_pushes_racing_a_snapshot_split_exactly_at_its_timestamp(cluster):
    """Workers push +1 to their own counter, one push at a time, while a snapshot is taken. In the
    snapshot each counter holds a prefix of its pushes; every push acknowledged before the
    snapshot's timestamp T is in it, every push not in it was acknowledged after T, and every
    push in it was sent before T."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    workers = 4
    keys = [f"race/{rng.randrange(1 << 20)}-{i}" for i in range(workers)]
    stop = threading.Event()
    logs: list[list[tuple[float, float]]] = [[] for _ in range(workers)]  # (sent, acked) per push

    async def setup():
        async with client(cluster) as ps:
            for k in keys:
                await ps.create(k, np.zeros(4, np.float32), optimizer=kc.Add())
    run(setup())

    def worker(i: int) -> None:
        async def main():
            async with client(cluster, client_id=f"race-{seed}-{i}") as ps:
                while not stop.is_set():
                    sent = time.time()
                    await ps.push({keys[i]: np.ones(4, np.float32)})
                    logs[i].append((sent, time.time()))
        run(main())

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(workers)]
    for t in threads:
        t.start()
    snaps = []
    try:
        wait_for(lambda: all(len(log) >= 20 for log in logs), 60, "pushes to flow")
        for _ in range(5):  # several cuts: each one is a chance to catch an early acknowledgement
            status, snap = api(cluster, "POST", "/v1/snapshots", {"label": "race"})
            assert status == 201, snap
            snaps.append(snap)
            wait_for(lambda: all(sum(1 for s, _ in log if s > snap["time"]) >= 5 for log in logs),
                     60, "pushes after the snapshot")
    finally:
        stop.set()
        for t in threads:
            t.join(60)

    args = argparse.Namespace(endpoint=cluster.endpoints[0], token=cluster.token, cafile=None)
    for snap in snaps:
        T = snap["time"]
        state = snapshot_state_dict(args, snap["id"])
        for i, key in enumerate(keys):
            n_in = int(state[key][0])
            log = logs[i]
            msg = f"seed {seed}, snapshot {snap['id']}, worker {i}: {n_in} pushes in it, T={T}"
            assert 0 < n_in < len(log), msg
            assert all(sent < T for sent, _ in log[:n_in]), msg + ": a push sent after T is in it"
            assert all(acked > T for _, acked in log[n_in:]), msg + ": a push acked before T is missing"
        status, _ = api(cluster, "DELETE", f"/v1/snapshots/{snap['id']}")
        assert status == 200


# ---- damaged and missing files ------------------------------------------------------------------------

def test_a_damaged_file_is_refused_and_the_live_state_is_untouched(cluster):
    async def setup():
        async with client(cluster) as ps:
            await ps.create("dmg/w", np.zeros((64, 1024), np.float32), optimizer=kc.SGD(lr=1.0))
            await ps.push({"dmg/w": np.ones((64, 1024), np.float32)})
    run(setup())
    status, snap = api(cluster, "POST", "/v1/snapshots", {"label": "to-damage"})
    assert status == 201

    async def push_again():
        async with client(cluster) as ps:
            await ps.push({"dmg/w": np.ones((64, 1024), np.float32)})
            return (await ps.pull(["dmg/w"]))["dmg/w"]
    live = run(push_again())

    victim = snapshot_files(cluster, snap["id"])[-1]
    data = bytearray(victim.read_bytes())
    data[len(data) - 100] ^= 0xFF  # one flipped bit in an array's payload
    victim.write_bytes(bytes(data))
    out = kvps(cluster, "snapshot", "restore", snap["id"], check=False)
    assert out.returncode != 0
    assert "refusing to restore" in out.stderr and ("CRC" in out.stderr or "checksum" in out.stderr), out.stderr

    async def unchanged():
        async with client(cluster) as ps:
            return (await ps.pull(["dmg/w"]))["dmg/w"]
    assert np.array_equal(run(unchanged()), live)
    assert hashes_agree(cluster, 2)
    api(cluster, "DELETE", f"/v1/snapshots/{snap['id']}")


# ---- crashes and replicas that joined later ---------------------------------------------------------

def test_node_killed_mid_snapshot_never_lists_a_corrupt_snapshot(cluster_factory):
    """kill -9 of a node while the replicas write a large snapshot; whatever is listed verifies
    and restores (the restarted node's replica replays the cut, or fetches its file)."""
    c = cluster_factory(shards=1)
    c.start(timeout=90)

    async def setup():
        async with kc.Client(c.endpoints, token=c.token, seed=0) as ps:
            for i in range(6):  # 96 MiB per replica: writing it takes a while
                await ps.create(f"big/{i}", np.full((4096, 1024), i, np.float32), optimizer=kc.SGD(lr=0.1))
    run(setup())
    result: dict = {}

    def take():
        result["reply"] = api(c, "POST", "/v1/snapshots", {"label": "crash"})
    t = threading.Thread(target=take)
    t.start()
    wait_for(lambda: list(c.data_dir.glob("node-2/**/*.kvsnap.tmp")), 60, "node 2 to be writing")
    c.kill_node(2)
    t.join(120)
    status, body = result["reply"]
    listed = api(c, "GET", "/v1/snapshots")[1]["snapshots"]
    if status == 201:  # a majority wrote it: complete, and it must restore
        assert [s["id"] for s in listed] == [body["id"]]
    else:
        assert listed == []
    cut_short = bool(list(c.data_dir.glob("node-2/**/*.kvsnap.tmp")))
    c.start_node(2)
    c.wait_ready(60)
    if cut_short:  # (the kill may also land just after the rename)
        wait_for(lambda: not list(c.data_dir.glob("node-2/**/*.kvsnap.tmp")), 60, "the leftover to be swept")
    wait_for(lambda: hashes_agree(c, 1), 60, "the restarted replica to catch up")
    if status == 201:
        status, out = api(c, "POST", f"/v1/snapshots/{body['id']}/restore")
        assert status == 200, out

        async def check():
            async with kc.Client(c.endpoints, token=c.token, seed=0) as ps:
                vals = await ps.pull([f"big/{i}" for i in range(6)])
                assert all(np.all(vals[f"big/{i}"] == i) for i in range(6))
        run(check())
        wait_for(lambda: hashes_agree(c, 1), 30, "replicas to agree")


def test_restore_on_a_replica_that_joined_after_the_snapshot(cluster_factory):
    """A replica rebuilt from the leader's log-compaction snapshot (taken after the user
    snapshot, so it never sees the cut) has no file: the restore fetches it from a peer."""
    c = cluster_factory(shards=1, raft=RaftConfig(compact_bytes=64 * 1024))
    c.start(timeout=90)

    async def put(v: float):
        async with kc.Client(c.endpoints, token=c.token, seed=0) as ps:
            if v == 1.0:
                await ps.create("join/w", np.zeros(4096, np.float32), optimizer=kc.Add())
            await ps.push({"join/w": np.ones(4096, np.float32)})
    run(put(1.0))
    wait_for(lambda: hashes_agree(c, 1), 60, "every replica to hold the key before the cut")
    status, snap = api(c, "POST", "/v1/snapshots", {"label": "before-join"})
    assert status == 201
    for _ in range(8):  # enough for the leaders to compact their logs past the cut
        run(put(2.0))
    # node 2 loses its disk and comes back empty: it catches up from its peers and has no file
    c.kill_node(2)
    shutil.rmtree(c.data_dir / "node-2")
    c.start_node(2, replace=True)  # its directory is gone: refused under its id without --replace
    run(put(2.0))
    c.wait_ready(60)
    wait_for(lambda: hashes_agree(c, 1), 60, "the wiped replica to catch up")
    assert all("node-2" not in str(p) for p in snapshot_files(c, snap["id"]))
    status, out = api(c, "POST", f"/v1/snapshots/{snap['id']}/restore", endpoint=2)
    assert status == 200, out
    assert out["fetched_files"] == 1
    wait_for(lambda: hashes_agree(c, 1), 30, "every replica, the new one included, to restore")

    async def check():
        async with kc.Client(c.endpoints, token=c.token, seed=0) as ps:
            return (await ps.pull(["join/w"], consistency="follower"))["join/w"]
    assert np.all(run(check()) == 1.0)


# ---- retention -------------------------------------------------------------------------------------------

def test_scheduled_snapshots_keep_the_newest(cluster_factory):
    c = cluster_factory(shards=1, server=ServerConfig(snapshot_every=1.0, snapshot_keep=2))
    c.start(timeout=90)
    first = wait_for(lambda: (lambda s: s if len(s) == 2 else None)(api(c, "GET", "/v1/snapshots")[1]["snapshots"]),
                     60, "two scheduled snapshots")
    assert all(s["label"] == "scheduled" for s in first)
    ids = {s["id"] for s in first}
    later = wait_for(lambda: (lambda s: s if len(s) == 2 and not ids & {x["id"] for x in s} else None)(
        api(c, "GET", "/v1/snapshots")[1]["snapshots"]), 60, "two newer ones, the old ones dropped")
    assert later[0]["time"] > first[-1]["time"]
    for s in first:  # dropped snapshots leave no files behind
        wait_for(lambda s=s: not snapshot_files(c, s["id"]), 20, "dropped files to go")

