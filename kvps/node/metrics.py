"""The node's own Prometheus series, and one exposition merged from its replicas' and its own.

A scraper needs one target per node: the node's ``/metrics`` fetches its replicas' texts and serves
them together with its own series (``kvps_replica_up``, ``kvps_replica_restarts_total``).
"""
from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvps.service.lifecycle import GcCollector

__all__ = ["NodeMetrics", "merge_expositions"]


class NodeMetrics:
    def __init__(self, node: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.node = str(node)
        self.replica_up = Gauge("kvps_replica_up", "1 if the replica process is running",
                                ("shard", "node"), registry=self.registry)
        self.replica_restarts = Counter("kvps_replica_restarts", "Replica processes restarted by the node",
                                        ("shard", "node"), registry=self.registry)
        self.registry.register(GcCollector({"node": self.node, "process": "node"}))

    def expose(self) -> str:
        return generate_latest(self.registry).decode()


def merge_expositions(texts: Iterable[str]) -> str:
    """One valid exposition from several (a family's samples gathered under one HELP/TYPE)."""
    families: dict[str, object] = {}
    for text in texts:
        for fam in text_string_to_metric_families(text):
            have = families.get(fam.name)
            if have is None:
                families[fam.name] = fam
            else:
                have.samples.extend(fam.samples)

    class _Merged:
        def collect(self):
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged())
    return generate_latest(registry).decode()
