"""Which nodes host each shard's replicas, with a version: the placement that moves.

Pure (no I/O). The initial assignment is the config's deterministic placement
(``ClusterConfig.replica_nodes``); every change of one shard's replicas makes a new assignment with
``version + 1`` and that shard's ``epoch + 1``. A replica started for a shard whose epoch is above
0 joins an existing Raft group (it was placed there by a move), so it must not bootstrap one.

During a move the shard lists the target as well (4 nodes for a 3-replica shard), so the target's
node starts its replica before the leader adds it to the Raft group, and the source stays listed
until the leader has removed it (``kvps/rebalance.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvps.errors import InvalidRequest

__all__ = ["Assignment"]


@dataclass(frozen=True)
class Assignment:
    version: int
    shards: tuple[tuple[int, ...], ...]  # shard -> node ids hosting a replica (the first is preferred)
    epochs: tuple[int, ...]  # shard -> number of changes of its replica list

    @classmethod
    def initial(cls, cfg: Any) -> "Assignment":
        """The config's placement (``cfg`` is a ``ClusterConfig``)."""
        return cls(0, tuple(tuple(cfg.replica_nodes(s)) for s in range(cfg.shards)),
                   (0,) * cfg.shards)

    def nodes_of(self, shard: int) -> tuple[int, ...]:
        return self.shards[shard]

    def shards_of(self, node_id: int) -> list[int]:
        return [s for s, nodes in enumerate(self.shards) if node_id in nodes]

    def with_shard(self, shard: int, nodes: list[int] | tuple[int, ...]) -> "Assignment":
        nodes = tuple(nodes)
        if len(set(nodes)) != len(nodes) or not nodes:
            raise InvalidRequest(f"shard {shard}: bad replica nodes {list(nodes)}", field="nodes")
        shards = list(self.shards)
        epochs = list(self.epochs)
        shards[shard] = nodes
        epochs[shard] += 1
        return Assignment(self.version + 1, tuple(shards), tuple(epochs))

    def load(self, node_ids: list[int] | tuple[int, ...]) -> dict[int, int]:
        """Replicas per node, for every node in ``node_ids`` (0 for a node hosting none)."""
        counts = {n: 0 for n in node_ids}
        for nodes in self.shards:
            for n in nodes:
                counts[n] = counts.get(n, 0) + 1
        return counts

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version,
                "shards": [{"id": s, "nodes": list(nodes), "epoch": self.epochs[s]}
                           for s, nodes in enumerate(self.shards)]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Assignment":
        try:
            shards = sorted(data["shards"], key=lambda s: int(s["id"]))
            if [int(s["id"]) for s in shards] != list(range(len(shards))):
                raise ValueError("shard ids must be 0..n-1")
            out = cls(int(data["version"]), tuple(tuple(int(n) for n in s["nodes"]) for s in shards),
                      tuple(int(s.get("epoch", 0)) for s in shards))
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRequest(f"malformed assignment: {exc}", field="assignment") from exc
        if any(not nodes or len(set(nodes)) != len(nodes) for nodes in out.shards):
            raise InvalidRequest("malformed assignment: a shard needs distinct nodes", field="assignment")
        return out
