"""Elastic membership with every node in its own network namespace and address, the joining
nodes too (their namespaces are added mid-run and removed after their drain): grow 3 -> 5 and
shrink back to 3 while pushes stream. Skipped without root + iproute2 + nftables."""
from __future__ import annotations

import subprocess

import pytest

from kvps.config import RaftConfig, ServerConfig
from kvps_chaos import netns
from kvps_chaos.cluster import ChaosCluster

from test_elastic import SEED, run_grow_and_shrink

pytestmark = pytest.mark.cluster

SUPPORTED, WHY = netns.netns_support()


def _namespaces(topo: netns.Topology) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"{netns.PREFIX}{topo.run_id}-")]


@pytest.fixture
def topo():
    if not SUPPORTED:
        pytest.skip(f"network namespaces unavailable: {WHY}")
    netns.remove_stale()
    t = netns.Topology(3).create()
    try:
        yield t
    finally:
        t.destroy()
    assert not _namespaces(t), "namespaces left behind"


def test_grow_3_to_5_then_shrink_to_3_every_node_in_its_own_namespace(topo, tmp_path):
    cluster = ChaosCluster(tmp_path / "cluster", nodes=3, shards=4, raft=RaftConfig(),
                           server=ServerConfig(), topology=topo, seed=SEED)
    with topo.entered():  # the harness, its client and the drain command live in the hub
        res = run_grow_and_shrink(cluster)
    # the joined nodes ran at their own namespaces' addresses
    assert {n["id"]: n["host"] for n in res.grown["nodes"]} == {n: topo.address(n) for n in range(5)}
    assert sorted(_namespaces(topo)) == sorted([topo.hub, *(topo.ns(n) for n in range(3))]), \
        "a joined node's namespace was not removed"
    assert [n.host for n in cluster.cfg.nodes] == [topo.address(n) for n in range(3)]


def test_draining_node_0_moves_its_metadata_replica_across_namespaces(topo, tmp_path):
    cluster = ChaosCluster(tmp_path / "cluster", nodes=3, shards=4, raft=RaftConfig(),
                           server=ServerConfig(), topology=topo, seed=SEED)
    with topo.entered():
        res = run_grow_and_shrink(cluster, joins=1, drain=[0])
    assert res.shrunk["meta_members"] == [1, 2, 3]
    assert {n["id"]: n["host"] for n in res.shrunk["nodes"]} == {n: topo.address(n) for n in range(4)}
