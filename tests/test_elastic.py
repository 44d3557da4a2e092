"""Elastic membership on a real cluster: grow 3 -> 5 nodes and shrink 5 -> 3 while pushes stream."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

import kvps_client as kc
from kvps.delta import frame
from kvps.local import free_port_base
from kvps.process import python_module_args, spawn, stop_process

from conftest import ROOT, wait_for

pytestmark = pytest.mark.cluster

KEYS = [f"c{i}" for i in range(8)]


def meta(cluster) -> dict | None:
    try:
        with urllib.request.urlopen(cluster.endpoints[0] + "/v1/meta", timeout=2) as r:
            return json.loads(r.read())
    except OSError:
        return None


def settled(cluster, active: int) -> dict | None:
    """The metadata state once ``active`` nodes are active, nothing moves, and loads are even."""
    m = meta(cluster)
    if m is None or m["rebalance"]["moving"] is not None:
        return None
    ids = [n["id"] for n in m["nodes"] if n["state"] == "active"]
    if len(ids) != active or any(n["state"] == "draining" for n in m["nodes"]):
        return None
    load = {n: 0 for n in ids}
    for s in m["assignment"]["shards"]:
        if len(s["nodes"]) != 3:
            return None
        for n in s["nodes"]:
            if n not in load:
                return None
            load[n] += 1
    return m if max(load.values()) - min(load.values()) <= 1 else None


def state_hash(url: str, token: str) -> tuple[str, int] | None:
    req = urllib.request.Request(url + "/v1/rpc/state_hash", data=frame.encode(frame.KIND_REQUEST, {}),
                                 method="POST", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=2) as resp:
            m = frame.decode(resp.read()).meta
            return m["hash"], m["applied_index"]
    except OSError:
        return None


def converged(cluster) -> bool:
    cmap = cluster.cluster_map()
    if cmap is None:
        return False
    for shard in cmap["shards"]:
        hashes = {state_hash(r["data_url"], cluster.token) for r in shard["replicas"]}
        if None in hashes or len(hashes) != 1 or len(shard["replicas"]) != 3:
            return False
    return True


async def count_pushes(ps, stop: asyncio.Event, acks: list[float]) -> None:
    one = np.ones(1, np.float32)
    while not stop.is_set():
        await ps.push({k: one for k in KEYS})
        acks.append(time.monotonic())


def test_grow_3_to_5_then_shrink_to_3_while_pushes_stream(cluster_factory, tmp_path):
    cluster = cluster_factory(nodes=3, shards=4).start()
    env = {"KVPS_TOKEN": cluster.token, "PYTHONPATH": str(ROOT)}
    joined: dict[int, subprocess.Popen] = {}
    try:
        async def main():
            async with kc.Client(cluster.endpoints, token=cluster.token, seed=1, timeout=60) as ps:
                for k in KEYS:
                    await ps.create(k, np.zeros(1, np.float32))
                stop, acks = asyncio.Event(), []
                workers = [asyncio.create_task(count_pushes(ps, stop, acks)) for _ in range(3)]
                try:
                    await asyncio.to_thread(wait_for, lambda: len(acks) >= 20, 30, "20 acks")
                    # grow: two nodes join (foreground `kvps node join` processes)
                    for i in range(2):
                        port = free_port_base(2 * cluster.cfg.shards + 2, seed=1000 + i)
                        args = python_module_args("kvps.cli", "node", "join", "--seed", cluster.endpoints[0],
                                                  "--port", str(port), "--data-dir", str(tmp_path / f"join{i}"))
                        proc = spawn(args, tmp_path / f"join{i}.log", new_session=True, env=env)
                        joined[3 + i] = proc
                        await asyncio.to_thread(wait_for, lambda: (meta(cluster) or {"nodes": []})
                                                and len(meta(cluster)["nodes"]) == 4 + i, 30, f"node {3 + i} to join")
                    grown = await asyncio.to_thread(wait_for, lambda: settled(cluster, 5), 180,
                                                    "replicas to spread over 5 nodes")
                    n = len(acks) + 20
                    await asyncio.to_thread(wait_for, lambda: len(acks) >= n, 30, "acks after growing")
                    # shrink: drain both joined nodes (one through the CLI, which waits)
                    drain = await asyncio.create_subprocess_exec(
                        *python_module_args("kvps.cli", "node", "drain", "4", "--endpoint", cluster.endpoints[1],
                                            "--timeout", "170"),
                        env={**os.environ, **env}, stdout=asyncio.subprocess.PIPE)
                    req = urllib.request.Request(cluster.endpoints[2] + "/v1/nodes/3/drain", data=b"{}",
                                                 method="POST", headers={"Authorization": f"Bearer {cluster.token}"})
                    await asyncio.to_thread(urllib.request.urlopen, req, timeout=10)
                    out, _ = await asyncio.wait_for(drain.communicate(), 180)
                    assert drain.returncode == 0, out
                    shrunk = await asyncio.to_thread(wait_for, lambda: settled(cluster, 3), 180,
                                                     "replicas back on 3 nodes")
                    n = len(acks) + 20
                    await asyncio.to_thread(wait_for, lambda: len(acks) >= n, 30, "acks after shrinking")
                finally:
                    stop.set()
                    await asyncio.gather(*workers, return_exceptions=True)
                values = {k: await ps.get(k) for k in KEYS}
                return len(acks), values, grown, shrunk, out.decode()

        acked, values, grown, shrunk, drain_out = asyncio.run(main())
        for k, (value, version) in values.items():
            assert value[0] == acked and version == acked, f"{k}: {acked} acked, {value[0]} v{version}"
        assert "node 4 removed" in drain_out
        assert {n["id"]: n["state"] for n in shrunk["nodes"]} == {
            0: "active", 1: "active", 2: "active", 3: "removed", 4: "removed"}
        assert grown["rebalance"]["moves_done"] >= 4
        for node_id, proc in joined.items():  # a removed node's process exits by itself
            wait_for(lambda: proc.poll() is not None, 30, f"node {node_id} to exit")
        wait_for(lambda: converged(cluster), 60, "every shard's replicas to agree")
    except BaseException:
        for i in range(2):
            log = tmp_path / f"join{i}.log"
            if log.exists():
                print(f"----- join{i}.log -----\n" + "\n".join(log.read_text().splitlines()[-60:]),
                      file=sys.stderr)
        raise
    finally:
        for proc in joined.values():
            stop_process(proc, timeout=10.0, group=True)
