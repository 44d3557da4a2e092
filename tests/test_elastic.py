"""Elastic membership on a real cluster: grow 3 -> 5 nodes and shrink 5 -> 3 while pushes stream
(loopback; ``test_elastic_netns.py`` runs the same scenario with every node in its own namespace)."""
from __future__ import annotations

import asyncio
import os

import pytest

from conftest import dump_logs
from kvps.config import RaftConfig, ServerConfig
from kvps_chaos.cluster import ChaosCluster
from kvps_chaos.elastic import GrowShrink, grow_and_shrink, print_logs

pytestmark = pytest.mark.cluster

SEED = int(os.environ.get("KVPS_ELASTIC_SEED", "1"))


def run_grow_and_shrink(cluster: ChaosCluster) -> GrowShrink:
    """Start ``cluster``, run the scenario, assert its verdicts; logs on failure, stopped always."""
    try:
        cluster.start(timeout=120)
        res = asyncio.run(grow_and_shrink(cluster, seed=SEED))
        print(f"elastic: seed {SEED}, {res.acked} pushes acknowledged, joined {res.joined}, {res.timings}")
        assert not res.failures(), res.explain()
        # the shared checks, spelled out: nothing lost or applied twice, even spread both ways
        assert all(v == (res.acked, res.acked) for v in res.values.values())
        assert res.grown and res.shrunk and res.agreed
        return res
    except BaseException:
        dump_logs(cluster)
        print_logs(cluster)
        raise
    finally:
        cluster.stop()


def test_grow_3_to_5_then_shrink_to_3_while_pushes_stream(tmp_path):
    run_grow_and_shrink(ChaosCluster(tmp_path / "cluster", nodes=3, shards=4, raft=RaftConfig(),
                                     server=ServerConfig(), seed=SEED))
