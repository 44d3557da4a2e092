"""Memory of a table's rows: bytes per row at 10 M rows, and the RSS of a shard state fed 10x its
row cap of distinct ids.

    .venv/bin/python benchmarks/table_memory.py [--rows 10000000] [--dim 16] [--cap 1000000]
        [--table add|adam|lfu] [--ids spread|uint32]

Part 1 fills one float32 ``Table`` with ``--rows`` rows through plan/commit, as apply does, and
prints the bytes every array holds per row, split into values + optimizer state (the row's
payload), the per-row record (``kvps.record``: the id and version, and the columns the table's
definition reads), the hash index, and slack (capacity not used yet); ``overhead_per_row`` is
record + index, ``accounted_overhead_per_row`` what the memory limit counts for them. ``--table``:
``add`` (Add, no lifecycle: id and version only), ``adam`` (+ step count), ``lfu`` (Adagrad with a
cap above ``--rows``, LFU and a TTL: + step, last push, push count). ``--ids``: ``spread`` ids
(``i * 7919 + 13``: past 2**32 from 542 k rows on, so int64 ids, as hashed features) or ``uint32``
(``i * 419 + 13``: below 2**32 up to 10 M rows). Part 2, in a fresh process, streams ``10 * --cap``
distinct ids (10 k per push) through ``StateHost.apply`` (as a replica applies: evictions let it
give free heap back) into a table with ``max_rows=--cap`` and
prints the peak RSS against the cap's accounted bytes + 64 MiB; with ``--part both`` (the default)
that process runs with the malloc settings of a replica process (``REPLICA_ENV``), as
``env MALLOC_MMAP_THRESHOLD_=... benchmarks/table_memory.py --part stream`` does by hand.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np


def _rss_mib(field: str = "VmRSS") -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


TABLES = {  # --table -> (optimizer, lifecycle)
    "add": ({"name": "add"}, None),
    "adam": ({"name": "adam"}, None),
    "lfu": ({"name": "adagrad"}, {"max_rows": 2**62, "evict": "lfu", "ttl_s": 1e9}),
}
SPREAD = {"spread": 7919, "uint32": 419}


def bytes_per_row(rows: int, dim: int, table: str = "add", spread: str = "spread") -> dict:
    from kvps.table import Table
    optimizer, life = TABLES[table]
    t = Table("emb", dim, "float32", optimizer, {"name": "zeros"}, "sum", life)
    step = SPREAD[spread]
    batch = 1_000_000
    start = time.perf_counter()
    for lo in range(0, rows, batch):
        ids = np.arange(lo, min(rows, lo + batch), dtype=np.int64) * step + 13  # sorted, unique, spread
        t.commit(t.plan(ids, np.ones((len(ids), dim), np.float32), np.ones(len(ids), np.int64), 1.0))
    fill_s = time.perf_counter() - start
    probe = np.arange(0, rows, 97, dtype=np.int64) * step + 13
    start = time.perf_counter()
    found = t.slots_of(probe)
    lookup_s = time.perf_counter() - start
    assert (found >= 0).all()
    missing = probe + 1  # never stored: the probe runs to an empty entry
    start = time.perf_counter()
    assert (t.slots_of(missing) < 0).all()
    miss_s = time.perf_counter() - start
    n, cap = t.n, len(t.ids)
    payload = t.values.itemsize * (dim + sum(a[0].size for a in t.state.values()))
    record = sum(a.itemsize for a in (t.ids, t.versions, t.steps, t.count, t.last) if a is not None)
    slack = (cap - n) * (payload + record)
    total = sum(a.nbytes for a in t._columns()) + t.index.nbytes
    return {"rows": n, "dim": dim, "table": table, "ids": spread, "payload_bytes_per_row": payload,
            "record_bytes_per_row": record, "index_bytes_per_row": round(t.index.nbytes / n, 2),
            "overhead_per_row": round(record + t.index.nbytes / n, 2),
            "accounted_overhead_per_row": t.row_bytes - payload,
            "slack_bytes_per_row": round(slack / n, 2),
            "overhead_beyond_payload": round((total - n * payload) / n, 2),
            "fill_s": round(fill_s, 1), "lookup_ns_per_id": round(lookup_s / len(probe) * 1e9, 1),
            "miss_ns_per_id": round(miss_s / len(missing) * 1e9, 1),
            "peak_rss_mib": round(_rss_mib("VmHWM"), 1)}


def stream_rss(cap: int, dim: int) -> dict:
    from kvps.command import CreateTable, Push, PushId, RowDelta
    from kvps.replica.history import BlockHistory
    from kvps.replica.host import StateHost
    from kvps.service.lifecycle import heap_trimmer
    from kvps.shard import ShardState
    base = _rss_mib()
    s = ShardState(0)
    host = StateHost(s, history=BlockHistory, perform=lambda effect: None)  # as a replica applies
    host.apply(CreateTable("emb", dim, "float32", {"name": "adagrad", "lr": 0.1}, {"name": "normal", "seed": 1},
                        "sum", {"max_rows": cap, "evict": "lru"}))
    per_push = max(1, min(10_000, cap // 10))  # a push far smaller than the cap, as in training
    grads = np.ones((per_push, dim), np.float32)
    counts = np.ones(per_push, np.int64)
    peak = base
    start = time.perf_counter()
    for q in range(10 * cap // per_push):
        ids = np.arange(q * per_push, (q + 1) * per_push, dtype=np.int64)
        res = host.apply(Push(float(q), (PushId("c", q + 1, q + 1, ("emb",)),), (),
                              (RowDelta("emb", ids, grads, counts),)))
        assert "versions" in res["results"][("c", q + 1)], res
        peak = max(peak, _rss_mib())
    elapsed = time.perf_counter() - start
    info = s.describe("emb")
    cap_mib = info["bytes"] / 2**20
    return {"cap_rows": cap, "dim": dim, "rows_at_end": info["rows"], "ids_pushed": 10 * cap,
            "rss_before_table_mib": round(base, 1), "peak_rss_mib": round(peak, 1),
            "peak_hwm_mib": round(_rss_mib("VmHWM"), 1), "cap_accounted_mib": round(cap_mib, 1),
            "peak_growth_mib": round(peak - base, 1), "bound_mib (cap + 64)": round(cap_mib + 64, 1),
            "within_bound": peak - base <= cap_mib + 64, "pushes_per_s": round(10 * cap / per_push / elapsed, 1),
            "heap_trims": heap_trimmer.trims}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--cap", type=int, default=1_000_000)
    p.add_argument("--part", choices=["both", "rows", "stream"], default="both")
    p.add_argument("--table", choices=sorted(TABLES), default="add")
    p.add_argument("--ids", choices=sorted(SPREAD), default="spread")
    a = p.parse_args()
    if a.part in ("both", "rows"):
        print("bytes per row:", json.dumps(bytes_per_row(a.rows, a.dim, a.table, a.ids)), flush=True)
    if a.part == "both":  # a fresh process, so part 1's arrays do not count in its RSS, with the
        # malloc settings a node gives its replica processes (kvps.node.node.REPLICA_ENV)
        from kvps.node.node import REPLICA_ENV
        subprocess.run([sys.executable, __file__, "--part", "stream", "--dim", str(a.dim),
                        "--cap", str(a.cap)], check=True, env={**os.environ, **REPLICA_ENV})
    if a.part == "stream":
        print("stream at the cap:", json.dumps(stream_rss(a.cap, a.dim)), flush=True)


if __name__ == "__main__":
    main()
