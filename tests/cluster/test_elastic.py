"""Elastic membership on a real cluster: grow 3 -> 5 nodes and shrink 5 -> 3 while pushes stream
(loopback; ``test_elastic_netns.py`` runs the same scenario with every node in its own namespace).

The two scenarios that have a namespaced twin run here only where namespaces cannot be made: the
twin runs the same code with the same seed and asserts everything these assert and more, and the
suite has a 15-minute budget on two cores."""
from __future__ import annotations

import asyncio
import http.client
import json
import os
import subprocess
import urllib.error
import urllib.request

import pytest

from conftest import dump_logs, wait_for
from kvps.config import RaftConfig, ServerConfig
from kvps.node.process import python_module_args
from kvps_chaos.cluster import ChaosCluster
from kvps_chaos.elastic import GrowShrink, grow_and_shrink, meta, print_logs, replicas_agree, settled

pytestmark = pytest.mark.cluster

SEED = int(os.environ.get("KVPS_ELASTIC_SEED", "1"))


def _needs_loopback() -> None:
    from kvps_chaos import netns
    if netns.netns_support()[0] and not os.environ.get("KVPS_ELASTIC_LOOPBACK"):
        pytest.skip("its twin in test_elastic_netns.py runs it in namespaces "
                    "(KVPS_ELASTIC_LOOPBACK=1 runs it here too)")


def run_grow_and_shrink(cluster: ChaosCluster, then=None, **kwargs) -> GrowShrink:
    """Start ``cluster``, run the scenario, assert its verdicts, then ``then(cluster, result)``;
    logs on failure, stopped always."""
    try:
        cluster.start(timeout=120)
        res = asyncio.run(grow_and_shrink(cluster, seed=SEED, **kwargs))
        print(f"elastic: seed {SEED}, {res.acked} pushes acknowledged, joined {res.joined}, "
              f"drained {res.drained}, {res.timings}")
        assert not res.failures(), res.explain()
        # the shared checks, spelled out: nothing lost or applied twice, even spread both ways
        assert all(v == (res.acked, res.acked) for v in res.values.values())
        assert res.grown and res.shrunk and res.agreed
        if then is not None:
            then(cluster, res)
        return res
    except BaseException:
        dump_logs(cluster)
        print_logs(cluster)
        raise
    finally:
        cluster.stop()


def test_grow_3_to_5_then_shrink_to_3_while_pushes_stream(tmp_path):
    _needs_loopback()
    run_grow_and_shrink(ChaosCluster(tmp_path / "cluster", nodes=3, shards=4, raft=RaftConfig(),
                                     server=ServerConfig(), seed=SEED))


def test_draining_node_0_moves_its_metadata_replica_too_while_pushes_stream(tmp_path):
    """Node 0 runs a metadata replica: draining it moves its shard replicas away, then its
    metadata replica to the joined node (one change at a time), then removes it; the metadata
    group goes on with nodes 1-3 and nothing acknowledged is lost or applied twice."""
    _needs_loopback()
    res = run_grow_and_shrink(ChaosCluster(tmp_path / "cluster", nodes=3, shards=4, raft=RaftConfig(),
                                           server=ServerConfig(), seed=SEED), joins=1, drain=[0])
    assert res.shrunk["meta_members"] == [1, 2, 3]
    assert res.shrunk["rebalance"]["last"].get("meta") is True  # the metadata replica moved last


def _own_view(cluster: ChaosCluster, node_id: int) -> dict | None:
    """Node ``node_id``'s ``/v1/meta`` if it comes from its own metadata replica hearing a leader."""
    m = meta(cluster) or {"nodes": []}
    node = next((n for n in m["nodes"] if n["id"] == node_id), None)
    if node is None:
        return None
    try:
        req = urllib.request.Request(f"http://{node['host']}:{node['admin_port']}/v1/meta",
                                     headers={"Authorization": f"Bearer {cluster.token}"})
        with urllib.request.urlopen(req, timeout=2) as r:
            view = json.loads(r.read())
    except (OSError, ValueError, http.client.HTTPException):  # it may be restarting
        return None
    mine = view["raft"]["address"] == f"{node['host']}:{node['port_base'] + 2 * cluster.cfg.shards}"
    return view if mine and view["raft"]["leader"] else None


def test_moved_metadata_replicas_restart_from_their_journals_and_the_group_goes_on(tmp_path):
    """After node 0's metadata replica moved to node 3 (whose process the scenario stopped), node 3
    restarts by the same ``kvps node join`` and node 1 is killed with -9 and restarted: both run
    their metadata replicas again from ``meta_members.json`` and their journals; then the group
    still takes a join and the replicas spread onto the new node."""
    def restart_members(cluster: ChaosCluster, res: GrowShrink) -> None:
        assert 3 not in cluster.joined  # the scenario stopped node 3's process
        cluster.join_node(3)
        wait_for(lambda: _own_view(cluster, 3), 120, "node 3's metadata replica to hear a leader again")
        cluster.kill_node(1)
        cluster.start_node(1)
        views = wait_for(lambda: (lambda v: all(v) and v)([_own_view(cluster, n) for n in (1, 2, 3)]), 120,
                         "nodes 1-3 to run their metadata replicas again, hearing a leader")
        assert all(v["meta_members"] == [1, 2, 3] for v in views)
        cluster.join_node(4)
        wait_for(lambda: settled(cluster, [1, 2, 3, 4]), 180, "replicas to spread onto node 4")
        wait_for(lambda: replicas_agree(cluster), 60, "every shard's replicas to agree")

    run_grow_and_shrink(ChaosCluster(tmp_path / "cluster", nodes=3, shards=4, raft=RaftConfig(),
                                     server=ServerConfig(), seed=SEED),
                        then=restart_members, joins=1, drain=[0])


def test_draining_a_metadata_node_without_a_node_to_take_its_replica_is_refused(cluster_factory):
    """With only the three metadata nodes, none can be drained: the drain is refused up front
    (``NotDrainable``, HTTP 409) and nothing changes, instead of a drain that never finishes."""
    cluster = cluster_factory(nodes=3, shards=1).start(timeout=120)
    cli = subprocess.run(python_module_args("kvps.cli", "node", "drain", "0", "--endpoint", cluster.endpoints[2],
                                            "--timeout", "30"),
                         env={**os.environ, "KVPS_TOKEN": cluster.token}, capture_output=True, text=True,
                         timeout=120, check=False)
    assert cli.returncode == 1, cli
    assert "kvps node drain: NotDrainable:" in cli.stderr and "metadata Raft group" in cli.stderr, cli.stderr
    assert "Join a node first" in cli.stderr
    req = urllib.request.Request(cluster.endpoints[0] + "/v1/nodes/1/drain", data=b"{}", method="POST",
                                 headers={"Authorization": f"Bearer {cluster.token}"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(req, timeout=10)
    assert refused.value.code == 409
    body = json.loads(refused.value.read())
    assert body["error"] == "NotDrainable" and body["fields"] == {"node": 1, "meta_nodes": [0, 1, 2]}
    m = meta(cluster)
    assert [n["state"] for n in m["nodes"]] == ["active"] * 3 and m["rebalance"]["moving"] is None
