"""Leaders spread over the nodes (kvps.node.leaders): every node leads shards / nodes ±1 once the
cluster has settled, also after every leader was pushed onto one node."""
from __future__ import annotations

import pytest
from conftest import wait_for

from kvps.service.http import rpc

pytestmark = pytest.mark.cluster

SHARDS = 6


def leader_counts(c) -> dict[int, int] | None:
    cmap = c.cluster_map()
    if cmap is None or any(s["leader"] is None for s in cmap["shards"]):
        return None
    out = {n: 0 for n in range(3)}
    for s in cmap["shards"]:
        out[s["leader"]] += 1
    return out


def test_leaders_are_spread_after_all_of_them_moved_to_one_node(cluster_factory):
    c = cluster_factory(nodes=3, shards=SHARDS).start(timeout=90)
    c.admin("POST", "/v1/rebalance", {"auto": False})  # hold still while the leaders gather
    # every leader onto node 0 (what a burst of elections can leave behind)
    def on_node_0(shard: int) -> bool:
        cmap = c.cluster_map()
        s = cmap["shards"][shard] if cmap else None
        if s is None or s["leader"] is None:
            return False
        if s["leader"] == 0:
            return True
        try:
            rpc(c.cfg.node(s["leader"]).data_url(shard), "membership",
                {"op": "transfer", "address": c.cfg.node(0).raft_address(shard)}, token=c.token)
        except Exception:  # noqa: BLE001 - not caught up yet: asked again on the next poll
            pass
        return False
    for shard in range(SHARDS):
        wait_for(lambda shard=shard: on_node_0(shard), 30, f"shard {shard}'s leader to move to node 0")
    # all of them there at once, in one view (a leader that moved meanwhile is moved back)
    wait_for(lambda: all([on_node_0(shard) for shard in range(SHARDS)])
             and leader_counts(c) == {0: SHARDS, 1: 0, 2: 0}, 30, "every leader on node 0 at once")
    c.admin("POST", "/v1/rebalance", {"auto": True})
    counts = wait_for(lambda: (lambda n: n if n and max(n.values()) - min(n.values()) <= 1 else None)(
        leader_counts(c)), 60, "the leaders to spread over the three nodes")
    assert sorted(counts.values()) == [2, 2, 2], counts
