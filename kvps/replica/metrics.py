"""Prometheus metrics (``kvps_`` prefix), one registry per replica process, merged by the node.

Each replica serves its own ``/metrics`` (every series labelled with ``shard`` and ``node``); the
node's ``/metrics`` fetches its replicas' texts and serves them as one exposition together with its
own series, so a scraper needs only one target per node. Hot keys are not labels (unbounded
cardinality): they are in ``/v1/shards/{id}``.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["CONTENT_TYPE", "ReplicaMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class ReplicaMetrics:
    def __init__(self, shard: int, node: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ("shard", "node")
        self._values = {"shard": str(shard), "node": str(node)}
        r = self.registry
        self.pushes = Counter("kvps_pushes", "Pushes accepted by this replica as leader", labels, registry=r)
        self.push_bytes = Counter("kvps_push_bytes", "Gradient bytes in accepted pushes", labels, registry=r)
        self.pulls = Counter("kvps_pulls", "Pull requests served", labels, registry=r)
        self.pull_bytes = Counter("kvps_pull_bytes", "Value bytes returned by pulls", labels, registry=r)
        self.rejected = Counter("kvps_rejected_requests", "Requests refused, by error class",
                                (*labels, "reason"), registry=r)
        self.nonfinite = Counter("kvps_nonfinite_pushes", "Pushes with NaN/Inf gradients, by action",
                                 (*labels, "action"), registry=r)
        self.leader_changes = Counter("kvps_leader_changes", "Role changes seen by this replica",
                                      labels, registry=r)
        self.commit_seconds = Histogram("kvps_commit_seconds", "Proposal to applied-on-leader latency",
                                        labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.batch_pushes = Histogram("kvps_batch_pushes", "Pushes merged into one log entry", labels,
                                      buckets=_BATCH_BUCKETS, registry=r)
        self.term = Gauge("kvps_term", "Current Raft term", labels, registry=r)
        self.is_leader = Gauge("kvps_is_leader", "1 if this replica is the serving leader", labels, registry=r)
        self.commit_index = Gauge("kvps_commit_index", "Raft commit index", labels, registry=r)
        self.applied_index = Gauge("kvps_applied_index", "Raft applied index", labels, registry=r)
        self.lag_entries = Gauge("kvps_replication_lag_entries", "Entries a follower is behind (leader's view)",
                                 (*labels, "peer"), registry=r)
        self.recovering = Gauge("kvps_recovering", "1 while this replica withholds its vote until it "
                                "has caught up (its data was lost or its journal damaged)",
                                labels, registry=r)
        self.log_held_bytes = Gauge("kvps_log_held_bytes", "Command bytes of the Raft log held in "
                                    "memory (the rest is released to the journal)", labels, registry=r)
        self.log_read_back_bytes = Gauge("kvps_log_read_back_bytes", "Released command bytes read "
                                         "back from the journal since the replica started (a "
                                         "lagging follower served, a compaction's boundary)",
                                         labels, registry=r)
        self.in_flight_bytes = Gauge("kvps_in_flight_bytes", "Push bytes accepted but not yet committed",
                                     labels, registry=r)
        # tables are few (created by hand), so their names may be labels, unlike hot keys
        self.table_rows = Gauge("kvps_table_rows", "Rows a table stores on this replica",
                                (*labels, "table"), registry=r)
        self.table_bytes = Gauge("kvps_table_bytes", "Accounted bytes of a table's rows on this replica "
                                 "(what server.memory_limit bounds)", (*labels, "table"), registry=r)

    def child(self, metric, **extra: str):
        return metric.labels(**self._values, **extra)

    def expose(self) -> bytes:
        return generate_latest(self.registry)
