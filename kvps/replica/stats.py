"""What a replica counts about itself: request counters, hot keys, follower lag, and its metrics.

Counters and hot keys feed ``/v1/status`` (``GET /v1/shards/{id}`` on a node shows them); the same
numbers, and the Raft state's, feed the Prometheus series (``kvps.replica.metrics``). Hot keys are
not labels (unbounded cardinality): they are push bytes per key, the heaviest kept.
"""
from __future__ import annotations

import time
from collections import Counter, deque
from typing import Any

from kvps.merge import PushRequest, request_bytes
from kvps.replica.metrics import ReplicaMetrics

__all__ = ["ReplicaStats"]

_HOT_KEYS_KEPT = 100  # of at most 1,000 tracked: hot keys stay, one-off keys go


class ReplicaStats:
    def __init__(self, shard: int, node_id: int) -> None:
        self.counters = {"pushes": 0, "pulls": 0, "batches": 0, "batched_pushes": 0,
                         "leader_changes": 0, "rejected": 0}
        self.metrics = ReplicaMetrics(shard, node_id)
        self._hot: Counter[str] = Counter()
        # (log index, monotonic time) of recent applies: a follower's lag in seconds is the age
        # of the first entry it has not acknowledged
        self._applied_at: deque[tuple[int, float]] = deque(maxlen=20000)
        self._activity = (0, 0.0)  # (entries applied + pulls served, when that last moved)

    # ---- counting -------------------------------------------------------------------------------

    def applied(self, index: int) -> None:
        """Entry ``index`` was applied now (tick thread)."""
        self._applied_at.append((index, time.monotonic()))

    def committed(self, seconds: float) -> None:
        self.metrics.child(self.metrics.commit_seconds).observe(seconds)

    def count_batch(self, pushes: int, nbytes: int) -> None:
        self.counters["batches"] += 1
        self.counters["batched_pushes"] += pushes
        self.metrics.child(self.metrics.batch_pushes).observe(pushes)

    def count_push(self, req: PushRequest) -> None:
        self.counters["pushes"] += 1
        self.metrics.child(self.metrics.pushes).inc()
        self.metrics.child(self.metrics.push_bytes).inc(request_bytes(req))
        for key, _, grad in req.dense:
            self._hot[key] += grad.nbytes
        for key, ids, grads in req.rows:
            self._hot[key] += grads.nbytes + ids.nbytes
        if len(self._hot) > 10 * _HOT_KEYS_KEPT:
            self._hot = Counter(dict(self._hot.most_common(_HOT_KEYS_KEPT)))

    def count_pull(self, nbytes: int) -> None:
        self.counters["pulls"] += 1
        self.metrics.child(self.metrics.pulls).inc()
        self.metrics.child(self.metrics.pull_bytes).inc(nbytes)

    def rejected(self, reason: str) -> None:
        self.counters["rejected"] += 1
        self.metrics.child(self.metrics.rejected, reason=reason).inc()

    def nonfinite(self, action: str) -> None:
        self.metrics.child(self.metrics.nonfinite, action=action).inc()

    def leader_changed(self) -> None:
        self.counters["leader_changes"] += 1
        self.metrics.child(self.metrics.leader_changes).inc()

    # ---- views ----------------------------------------------------------------------------------

    def serving_recently(self, applied_index: int) -> bool:
        """Did this replica apply an entry or serve a pull in the last 0.2 s? (writer threads)"""
        count = self.counters["pulls"] + applied_index
        seen, at = self._activity
        now = time.monotonic()
        if count != seen:
            self._activity = (count, now)
            return True
        return now - at < 0.2

    def view(self) -> dict[str, Any]:
        return {"counters": dict(self.counters),
                "hot_keys": [{"key": k, "push_bytes": v} for k, v in self._hot.most_common(10)]}

    def peer_lag(self, group: Any) -> dict[str, dict]:
        """The leader's view of each follower: acknowledged index, lag in entries and seconds."""
        last = group.status()["applied_index"]
        now = time.monotonic()
        out = {}
        for addr, p in group.peer_progress().items():
            match = p["match_index"]
            lag = None if match is None else max(0, last - match)
            seconds: float | None = 0.0
            if lag:
                # list(): the tick thread appends meanwhile (a deque refuses mutation mid-iteration)
                first_missing = next((t for i, t in list(self._applied_at) if i > match), None)
                seconds = round(now - first_missing, 3) if first_missing is not None else None
            out[addr] = {"connected": p["connected"], "match_index": match, "lag_entries": lag,
                         "lag_seconds": seconds}
        return out

    def expose(self, group: Any, st: dict[str, Any], *, serving: bool, in_flight_bytes: int,
               tables: list[tuple[str, int, int]] | tuple = ()) -> bytes:
        """The replica's Prometheus exposition, with the Raft state ``st`` of ``group`` and the
        ``(key, rows, bytes)`` of each table on this replica."""
        m = self.metrics
        m.table_rows.clear()  # a deleted table's series go away
        m.table_bytes.clear()
        for key, rows, nbytes in tables:
            m.child(m.table_rows, table=key).set(rows)
            m.child(m.table_bytes, table=key).set(nbytes)
        m.child(m.term).set(st["term"])
        m.child(m.is_leader).set(1 if serving else 0)
        m.child(m.commit_index).set(st["commit_index"])
        m.child(m.applied_index).set(st["applied_index"])
        m.child(m.recovering).set(1 if st["recovering"] else 0)
        m.child(m.in_flight_bytes).set(in_flight_bytes)
        if st.get("log_memory"):
            m.child(m.log_held_bytes).set(st["log_memory"]["held_bytes"])
            m.child(m.log_read_back_bytes).set(st["log_memory"]["read_back_bytes"])
        if st["role"] == "leader":
            for addr, p in self.peer_lag(group).items():
                if p["lag_entries"] is not None:
                    m.child(m.lag_entries, peer=addr).set(p["lag_entries"])
        return m.expose()
