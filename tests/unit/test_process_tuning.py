"""The tuning of a process that hosts replicas (kvps.service.lifecycle): the collector's thresholds,
its clock as Prometheus counters, the start-up heap frozen, and freed heap given back past a
budget after a capped table churned. Each check runs in a child
interpreter: the settings are process-wide and must not leak into the test process."""
from __future__ import annotations

import json
import subprocess
import sys

from prometheus_client.parser import text_string_to_metric_families

from kvps.service.lifecycle import GC_THRESHOLDS

_CHILD = """
import gc, json
from prometheus_client import CollectorRegistry, generate_latest
from kvps.service.lifecycle import GcCollector, freeze_heap, gc_clock, tune_for_replicas
tune_for_replicas()
tune_for_replicas()  # twice: one clock, not two
garbage = []
garbage.append(garbage)  # a cycle only the collector frees
del garbage
freeze_heap()
registry = CollectorRegistry()
registry.register(GcCollector({"node": "7", "process": "node"}))
print(json.dumps({"threshold": gc.get_threshold(), "frozen": gc.get_freeze_count(),
                  "clocks": gc.callbacks.count(gc_clock), "collections": gc_clock.collections,
                  "seconds": gc_clock.seconds, "text": generate_latest(registry).decode()}))
"""


def _child() -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def test_a_replica_process_raises_the_collector_thresholds_and_freezes_start_up():
    got = _child()
    assert tuple(got["threshold"]) == GC_THRESHOLDS != (700, 10, 10)
    assert got["clocks"] == 1
    assert got["frozen"] > 1000  # the modules, classes and functions start-up made
    assert got["collections"][2] >= 1 and got["seconds"][2] > 0  # freeze_heap's full collection, timed


def test_the_collector_clock_is_exposed_per_generation():
    got = _child()
    samples = {(s.name, s.labels["generation"]): s for f in text_string_to_metric_families(got["text"])
               for s in f.samples}
    for generation in ("0", "1", "2"):
        runs = samples["kvps_gc_collections_total", generation]
        assert runs.labels == {"node": "7", "process": "node", "generation": generation}
        assert runs.value == got["collections"][int(generation)]
        assert samples["kvps_gc_seconds_total", generation].value == got["seconds"][int(generation)]


_TRIM_CHILD = """
import json, os, sys
import numpy as np
from kvps.service.lifecycle import HeapTrimmer, tune_for_replicas
tune_for_replicas()  # the replica's settings: freed heap up to 128 MiB is kept
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) // 1024 for l in f if l.startswith("VmRSS:"))
held = [np.ones(1 << 20, np.uint8) for _ in range(96)]  # 96 MiB in the heap (under the mmap threshold)
full = rss()
del held
kept = rss()
calm = HeapTrimmer(budget=256 << 20, period=0.0)
trimmer = HeapTrimmer(budget=32 << 20, period=3600.0)
print(json.dumps({"full": full, "kept": kept, "calm": calm.maybe_trim(), "after_calm": rss(),
                  "first": trimmer.maybe_trim(), "after": rss(), "again": trimmer.maybe_trim()}))
"""


def test_the_heap_trimmer_gives_freed_heap_back_past_its_budget_at_most_once_a_period():
    out = json.loads(subprocess.run([sys.executable, "-c", _TRIM_CHILD], capture_output=True, text=True,
                                    timeout=60, check=True).stdout)
    assert out["kept"] > out["full"] - 16, out  # the settings keep freed heap: the reason for the trimmer
    assert not out["calm"] and out["after_calm"] > out["full"] - 16, out  # under budget: nothing given back
    assert out["first"] and out["after"] < out["kept"] - 48, out  # past it: given back
    assert not out["again"], out  # once per period


def test_the_replica_host_trims_after_a_capped_table_churned_and_not_otherwise():
    import numpy as np

    from kvps.command import CreateTable, Push, PushId, RowDelta
    from kvps.replica.history import BlockHistory
    from kvps.replica.host import StateHost
    from kvps.shard import ShardState

    class Counting:
        calls = 0

        def maybe_trim(self) -> bool:
            self.calls += 1
            return False

    def push(host: StateHost, key: str, seq: int, ids: range) -> None:
        ids = np.asarray(ids, np.int64)
        host.apply(Push(1.0, (PushId("c", seq, seq, (key,)),), (),
                        (RowDelta(key, ids, np.ones((len(ids), 2)), np.ones(len(ids), np.int64)),)))

    heap = Counting()
    host = StateHost(ShardState(0), history=BlockHistory, perform=lambda e: None, heap=heap)
    host.apply(CreateTable("capped", 2, "float64", {"name": "add"}, {"name": "zeros"}, "sum",
                           {"max_rows": 10, "shards": 1}))
    host.apply(CreateTable("free", 2, "float64", {"name": "add"}, {"name": "zeros"}, "sum", None))
    push(host, "free", 1, range(50))
    assert heap.calls == 0
    push(host, "capped", 2, range(50))
    assert heap.calls == 1
