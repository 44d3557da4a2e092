"""A node listens on ``bind`` while the others reach it at ``host`` (``kvps node --bind``).

In a container the node's DNS name resolves to the pod's address, and a hook inside the pod (the
Kubernetes preStop drain) asks 127.0.0.1. Here every node runs in its own network namespace with
its own address as ``host`` and ``bind = "0.0.0.0"`` (which reaches no other host: the namespace
has only its veth and loopback); the cluster works over the namespace addresses, and a process
inside a node's namespace reaches the admin API and a replica at 127.0.0.1. Skipped without root
+ iproute2 + nftables."""
from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys

import numpy as np
import pytest
from conftest import dump_logs

import kvps_client as kc
from kvps.node.local import LocalCluster
from kvps_chaos import netns

pytestmark = pytest.mark.cluster

SUPPORTED, WHY = netns.netns_support()


class NamespacedCluster(LocalCluster):
    def __init__(self, data_dir, topo: netns.Topology) -> None:
        self.topology = topo
        super().__init__(data_dir, nodes=3, shards=1, port=7100)
        nodes = tuple(dataclasses.replace(n, host=topo.address(n.id), bind="0.0.0.0") for n in self.cfg.nodes)
        self.cfg = dataclasses.replace(self.cfg, nodes=nodes).validate()
        self._write_files()

    def node_command(self, node_id: int, args: list[str]) -> list[str]:
        return self.topology.exec_args(node_id, args)


def _inside(topo: netns.Topology, node: int, url: str) -> int:
    """HTTP status of ``url`` fetched by a process in ``node``'s namespace."""
    code = ("import sys, urllib.request, urllib.error\n"
            "try:\n print(urllib.request.urlopen(sys.argv[1], timeout=5).status)\n"
            "except urllib.error.HTTPError as e:\n print(e.code)\n"
            "except OSError:\n print(0)\n")
    out = subprocess.run(topo.exec_args(node, [sys.executable, "-c", code, url]),
                         capture_output=True, text=True, timeout=30, check=True)
    return int(out.stdout.strip())


def test_nodes_listen_on_bind_and_are_reached_at_host(tmp_path):
    if not SUPPORTED:
        pytest.skip(f"network namespaces unavailable: {WHY}")
    netns.remove_stale()
    topo = netns.Topology(3).create()
    cluster = NamespacedCluster(tmp_path / "cluster", topo)
    try:
        with topo.entered():  # this test's client lives in the hub, as an outside host would
            cluster.start(timeout=120)

            async def train() -> float:
                async with kc.Client(cluster.endpoints, cluster.token, seed=0) as ps:
                    await ps.create("bind/w", np.zeros(4, np.float32), optimizer=kc.Add())
                    version = (await ps.push({"bind/w": np.ones(4, np.float32)}))["bind/w"]
                    pulled = await ps.pull(["bind/w"], consistency="follower", min_version=version)
                    return float(pulled["bind/w"][0])
            assert asyncio.run(train()) == 1.0
            assert {n["admin_url"] for n in cluster.cluster_map()["nodes"]} == \
                {f"http://{topo.address(n)}:{cluster.cfg.node(n).admin_port}" for n in range(3)}
        me = cluster.cfg.node(1)
        assert _inside(topo, 1, f"http://127.0.0.1:{me.admin_port}/healthz") == 200
        assert _inside(topo, 1, f"http://127.0.0.1:{me.data_port(0)}/healthz") == 200
    except BaseException:
        dump_logs(cluster)
        raise
    finally:
        cluster.stop()
        topo.destroy()
