"""The command line against a real cluster: status table (with the wire ports) and --json, exit codes."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvps.cli.status import format_status

pytestmark = pytest.mark.cluster


def kvps(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvps.cli", *args], capture_output=True, text=True,
                          timeout=60)


def test_status_table_json_and_unreachable_endpoint(cluster_factory):
    c = cluster_factory(shards=2)
    with open(c.data_dir / "token", "a") as f:
        f.write("status-reader read\n")  # status needs no more than a read token
    c.start()
    out = kvps("status", "--endpoint", c.endpoints[0], "--token", "status-reader")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:5] == ["shard", "leader", "term", "lag", "health"]
    assert len(lines) == 1 + 2 + 2 and "2/2 shards healthy" in lines[-1]
    assert lines[-2] == "wire: " + ", ".join(f"node {n.id} {n.host}:{c.cfg.wire_port(n.id)}" for n in c.cfg.nodes)
    js = kvps("status", "--endpoint", c.endpoints[1], "--json", "--token", "status-reader")
    cmap = json.loads(js.stdout)
    assert [s["id"] for s in cmap["shards"]] == [0, 1]
    assert all(len(s["replicas"]) == 3 for s in cmap["shards"])
    c.stop()
    down = kvps("status", "--endpoint", c.endpoints[0])
    assert down.returncode != 0 and down.stderr.count("\n") == 1 and "cannot reach" in down.stderr


def test_status_marks_a_shard_without_leader():
    cmap = {"nodes": [{"id": 0, "reachable": True}],
            "shards": [{"id": 0, "leader": None, "term": 3, "replicas": [
                {"node": 0, "role": "follower", "alive": True, "applied_index": 5}]}]}
    text = format_status(cmap)
    assert "NO LEADER" in text and "0/1 shards healthy" in text


def test_export_to_torch_file_and_import_into_another_cluster(cluster_factory, tmp_path):
    import asyncio

    import numpy as np
    import torch

    import kvps_client as kc

    src = cluster_factory(shards=2).start()
    rng = np.random.default_rng(5)
    w = rng.standard_normal((300, 700)).astype(np.float32)

    async def fill():
        async with kc.Client(src.endpoints, token=src.token, seed=0) as ps:
            await ps.create("w", w, optimizer=kc.SGD(lr=0.5))
            await ps.push({"w": np.ones_like(w)})
            await ps.create_table("emb", dim=4)
            await ps.push_rows("emb", np.array([3, 1_000_000_007]), np.ones((2, 4), np.float32))
    asyncio.run(fill())
    path = tmp_path / "model.pt"
    out = kvps("export", str(path), "--endpoint", src.endpoints[0], "--token", src.token)
    assert out.returncode == 0, out.stderr
    state = torch.load(path, weights_only=True)
    assert set(state) == {"w", "emb", "emb.ids"}
    np.testing.assert_array_equal(state["w"].numpy(), w - 0.5)
    assert state["emb.ids"].tolist() == [3, 1_000_000_007] and torch.all(state["emb"] == 1)
    src.stop()

    dst = cluster_factory(shards=3).start()
    out = kvps("import", str(path), "--endpoint", dst.endpoints[0], "--token", dst.token,
               "--optimizer", '{"name": "sgd", "lr": 0.1}')
    assert out.returncode == 0, out.stderr

    async def read():
        async with kc.Client(dst.endpoints, token=dst.token, seed=0) as ps:
            info = await ps.describe("w")
            return (await ps.pull("w"))["w"], await ps.pull_rows("emb", [3, 1_000_000_007, 5]), info
    got, rows, info = asyncio.run(read())
    np.testing.assert_array_equal(got, w - 0.5)
    assert info["optimizer"]["name"] == "sgd"
    np.testing.assert_array_equal(rows, [[1] * 4, [1] * 4, [0] * 4])
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a torch file")
    out = kvps("import", str(bad), "--endpoint", dst.endpoints[0], "--token", dst.token)
    assert out.returncode != 0 and out.stderr.count("\n") == 1
