"""The binary data plane in a real cluster: every node serves its replicas on one wire port, the
client uses it where the cluster map names it, and hostile bytes there change nothing."""
from __future__ import annotations

import asyncio
import json
import urllib.request

import numpy as np
import pytest

import kvps_client as kc
from conftest import module_cluster, wait_for
from kvps.delta import frame, wire
from kvps.placement import block_shard

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from module_cluster(tmp_path_factory, "wire", shards=2)


def _cluster_map(cluster) -> dict:
    req = urllib.request.Request(cluster.endpoints[0] + "/v1/cluster",
                                 headers={"Authorization": f"Bearer {cluster.token}"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return json.loads(resp.read())


def test_the_map_names_every_nodes_wire_port(cluster):
    view = _cluster_map(cluster)
    for shard in view["shards"]:
        for rep in shard["replicas"]:
            assert rep["wire"] == f"127.0.0.1:{cluster.cfg.wire_port(rep['node'])}"


def test_calls_go_over_the_wire_and_agree_with_http(cluster):
    async def main():
        out = {}
        for use_wire in (True, False):
            async with kc.Client(cluster.endpoints, token=cluster.token, seed=1, wire=use_wire) as ps:
                key = f"wire/w{int(use_wire)}"
                await ps.create(key, np.zeros((600, 1024), np.float32), optimizer=kc.SGD(lr=0.5))
                grads = [np.random.default_rng(s).standard_normal((600, 1024)).astype(np.float32)
                         for s in range(3)]
                for g in grads:
                    await ps.push({key: g})
                out[use_wire] = (await ps.pull(key))[key], ps.stats.wire_requests, ps.stats.requests
        return out

    out = asyncio.run(main())
    (on, wire_n, total), (off, wire_off, _) = out[True], out[False]
    assert np.array_equal(on, off)  # same pushes, same optimizer: bit-identical either way
    assert wire_n == total > 0 and wire_off == 0


def _raw_call(port: int, token: str, shard: int, op: str, body: bytes) -> tuple[int, bytes]:
    async def main():
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(wire.encode_hello(token) + wire.request_head(len(body), 1, shard, op, "raw") + body)
        answers = []
        try:
            for _ in range(2):
                length, rid, status = wire.RESPONSE.unpack(await reader.readexactly(wire.RESPONSE.size))
                answers.append((status, await reader.readexactly(length)))
        except asyncio.IncompleteReadError:
            pass
        writer.close()
        return answers
    return asyncio.run(main())


def test_hostile_requests_on_the_wire_port_change_nothing(cluster):
    async def setup():
        async with kc.Client(cluster.endpoints, token=cluster.token, seed=2) as ps:
            await ps.create("wire/h", np.arange(8, dtype=np.float32))
            return (await ps.pull("wire/h"))["wire/h"]
    before = asyncio.run(setup())
    shard = block_shard("wire/h", 0, cluster.cfg.shards)
    leader = next(n for n in cluster.cfg.replica_nodes(shard))  # any replica: refusals come first
    port = cluster.cfg.wire_port(leader)
    ok = frame.encode(frame.KIND_REQUEST, {"client": "x", "seq": 1, "floor": 0,
                                           "dense": [{"key": "wire/h", "block": 0, "array": 0}]},
                      [np.full(8, np.nan, np.float32)])
    cases = [
        ("push", b"\x00garbage", 400),                     # not a frame
        ("push", ok[:-5], 400),                            # a truncated frame
        ("no_such_op", frame.encode(frame.KIND_REQUEST, {}), 400),
    ]
    for op, body, status in cases:
        answers = _raw_call(port, cluster.token, shard, op, body)
        assert answers[0][0] == 200 and answers[1][0] == status, (op, answers)
        assert "error" in json.loads(answers[1][1])
    assert _raw_call(port, "wrong-token", shard, "keys", b"")[0][0] == 401
    nan = _raw_call(port, cluster.token, shard, "push", ok)  # NaN gradients (leader or not)
    assert nan[1][0] in (400, 421)

    async def after():
        async with kc.Client(cluster.endpoints, token=cluster.token, seed=3) as ps:
            return (await ps.pull("wire/h"))["wire/h"]
    assert np.array_equal(asyncio.run(after()), before)  # state untouched, nodes still serving


def _open_wire_connections(cluster) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    total = 0.0
    for url in cluster.endpoints:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
        total += sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                     if s.name == "kvps_connections_open" and s.labels.get("server") == "wire")
    return total


def test_wire_connections_show_in_the_nodes_metrics(cluster):
    before = _open_wire_connections(cluster)

    async def main():
        async with kc.Client(cluster.endpoints, token=cluster.token, seed=4) as ps:
            await ps.keys()  # every shard's leader: one wire connection per node that leads one
            return _open_wire_connections(cluster), len({ps.cluster_map.wire[ps.cluster_map.leaders[s]][:2]
                                                         for s in range(cluster.cfg.shards)})
    during, nodes = asyncio.run(main())
    assert during == before + nodes
    wait_for(lambda: _open_wire_connections(cluster) == before, 10, "the nodes to count the client's close")
