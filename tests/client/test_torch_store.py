"""KvpsStore against a real cluster: the semantics torch's own store tests check (set, get, add,
compare_set, wait, check, delete_key, num_keys, timeouts), gloo rendezvous through it, values that
survive a shard leader's death, and ``torchrun --nproc-per-node 3`` training with its rendezvous
and process group on kvps while a shard leader is killed."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist

import kvps_client as kc
from conftest import ROOT, module_cluster, wait_for
from kvps.placement import block_shard
from kvps_chaos.elastic import replicas_agree
from kvps_client.torch import KvpsStore, StoreTimeout

pytestmark = pytest.mark.cluster
SHARDS = 2


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from module_cluster(tmp_path_factory, "torch-store", shards=SHARDS)


def store(cluster, prefix: str, **kw) -> KvpsStore:
    return KvpsStore(cluster.endpoints, token=cluster.token, prefix=prefix, **kw)


def test_set_get_check_add_delete_and_num_keys(cluster):
    """torch's test_store ``_test_set_get_check``, on kvps keys."""
    with store(cluster, "sgc/") as fs:
        fs.add("key", 1)
        fs.add("key", 2)
        fs.add("key", 3)
        fs.set("key0", "value0")
        fs.add("key3", 1)
        fs.set("key1", "value1")
        fs.add("key3", 2)
        fs.set("key2", "value2")
        for i in (3, 4, 5, 6):
            fs.add("key3", i)
        assert fs.num_keys() == 5
        assert fs.get("key") == b"6"
        assert fs.get("key0") == b"value0"
        assert fs.get("key1") == b"value1"
        assert fs.get("key2") == b"value2"
        assert fs.get("key3") == b"21"
        assert fs.check(["key3"]) and not fs.check(["Randomkey3"])
        fs.set("-key3", "7")
        assert fs.get("-key3") == b"7"
        assert fs.delete_key("-key3") and not fs.delete_key("-key3")
        assert fs.num_keys() == 5 and not fs.check(["-key3"])
        fs.set("bin", bytes(range(256)) * 3)  # any bytes, any length up to the cap
        assert fs.get("bin") == bytes(range(256)) * 3
        with pytest.raises(kc.InvalidRequest):
            fs.set("huge", b"x" * (fs.max_value_bytes + 1))


def test_compare_set(cluster):
    """torch's test_store ``_test_compare_set``."""
    with store(cluster, "cs/") as s:
        assert s.compare_set("cs_key0", "wrong_old_value", "new_value0") == b"wrong_old_value"
        s.set("cs_key0", "value0")
        assert s.get("cs_key0") == b"value0"
        assert s.compare_set("cs_key0", "wrong_old_value", "new_value0") == b"value0"
        assert s.get("cs_key0") == b"value0"
        assert s.compare_set("cs_key0", "value0", "new_value0") == b"new_value0"
        assert s.get("cs_key0") == b"new_value0"
        assert s.compare_set("cs_key1", "", "new_value1") == b"new_value1"
        assert s.get("cs_key1") == b"new_value1"


def test_wait_and_get_time_out_and_a_later_set_wakes_a_waiter(cluster):
    with store(cluster, "wait/", timeout=timedelta(seconds=30)) as s:
        assert s.timeout == timedelta(seconds=30)
        start = time.monotonic()
        with pytest.raises(dist.DistStoreError):  # what torch's callers catch ...
            s.wait(["nothing"], timedelta(seconds=0.3))
        with pytest.raises(kc.Timeout):  # ... and a kvps Timeout
            s.wait(["nothing"], timedelta(seconds=0.3))
        s.set_timeout(timedelta(seconds=0.3))
        with pytest.raises(StoreTimeout):
            s.get("nothing")
        assert time.monotonic() - start < 10
        s.set_timeout(timedelta(seconds=30))
        got = []
        waiter = threading.Thread(target=lambda: got.append(s.get("later")))
        waiter.start()
        with store(cluster, "wait/") as other:
            other.set("later", "here")
        waiter.join(30)
        assert got == [b"here"]
        with store(cluster, "elsewhere/") as elsewhere:
            assert not elsewhere.check(["later"])  # prefixes keep stores apart


def test_concurrent_adds_from_many_threads_count_exactly(cluster):
    with store(cluster, "adds/") as s:
        threads = [threading.Thread(target=lambda: [s.add("n", 1) for _ in range(10)]) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert s.get("n") == b"40"  # compare-and-set: no lost increment


def test_gloo_process_groups_rendezvous_through_the_store(cluster):
    """Three gloo ranks (threads here) connect through a KvpsStore and all-reduce."""
    results: dict[int, list[float]] = {}
    errors: list[BaseException] = []

    def rank(r: int, s: KvpsStore) -> None:
        try:
            pg = dist.ProcessGroupGloo(dist.PrefixStore("pg/", s), r, 3, timedelta(seconds=60))
            t = torch.full((2,), float(r + 1))
            pg.allreduce([t]).wait()
            results[r] = t.tolist()
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    stores = [store(cluster, "gloo/") for _ in range(3)]
    threads = [threading.Thread(target=rank, args=(r, stores[r])) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for s in stores:
        s.close()
    assert not errors, errors
    assert results == {r: [6.0, 6.0] for r in range(3)}


def _kill_leader_of(cluster, key: str) -> tuple[int, dict]:
    shard = block_shard(key, 0, SHARDS)
    leader = wait_for(lambda: cluster.leader(shard), 30, f"a leader of shard {shard}")
    cluster.kill_replica(leader)  # its process: with procs = 1 its whole node, started again
    return shard, leader


def _wait_restarted(cluster, shard: int, leader: dict) -> None:
    wait_for(lambda: (cluster.replica(shard, leader["node"]) or {}).get("pid") not in (None, leader["pid"]),
             60, "the killed replica to be restarted")
    wait_for(cluster.ready, 60, "every shard to serve again")
    wait_for(lambda: replicas_agree(cluster), 60, "every shard's replicas to hold identical state")


def test_values_survive_a_leader_kill_and_writes_go_on(cluster):
    with store(cluster, "kill/") as s:
        s.set("v", "before")
        s.add("n", 5)
        shard, leader = _kill_leader_of(cluster, "kill/v")
        assert s.get("v") == b"before"  # read from the new leader
        assert s.add("n", 1) == 6
        assert s.compare_set("v", "before", "after") == b"after"
        _wait_restarted(cluster, shard, leader)


def test_torchrun_trains_with_rendezvous_and_process_group_on_kvps_while_a_leader_dies(cluster, tmp_path):
    """``torchrun --nproc-per-node 3 --rdzv-backend kvps`` runs examples/torchrun_train.py; the
    workers stop before step 10 until the test has killed the leader of the shard holding the
    job's step counter, then train on through the failover. The counter ends at exactly 3 x 30:
    no push lost or applied twice."""
    steps, prefix = 30, "trun/"
    admin = cluster.endpoints[0].removeprefix("http://")
    env = {**os.environ, "KVPS_TOKEN": cluster.token, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3",
           "--rdzv-backend", "kvps", "--rdzv-endpoint", admin, "--rdzv-id", "job1",
           str(ROOT / "examples" / "torchrun_train.py"), "--endpoint", cluster.endpoints[0],
           "--steps", str(steps), "--prefix", prefix, "--hold-at", "10", "--hold-key", "go"]
    log = tmp_path / "torchrun.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        with store(cluster, "pg/job1/") as s:
            wait_for(lambda: proc.poll() is not None or s.check([f"held/{r}" for r in range(3)]), 60,
                     "all three workers at step 10")
            assert proc.poll() is None, log.read_text()
            shard, leader = _kill_leader_of(cluster, prefix + "steps")
            s.set("go", "1")
            assert proc.wait(timeout=60) == 0, log.read_text()
        _wait_restarted(cluster, shard, leader)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    assert sorted(x["rank"] for x in lines) == [0, 1, 2], log.read_text()
    assert all(x["same_params"] and x["world_size"] == 3 for x in lines)
    with kc.SyncClient(cluster.endpoints, token=cluster.token) as ps:
        assert ps.pull(prefix + "steps")[prefix + "steps"].tolist() == [3 * steps]
        rdzv = [k["key"] for k in ps.keys() if k["key"].startswith("rdzv/job1/")]
    assert rdzv  # torchrun's rendezvous state lived on kvps
    assert np.isfinite([x["loss"] for x in lines]).all()
