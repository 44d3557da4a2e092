"""The tuning of a process that hosts replicas (kvps.service.lifecycle): the collector's thresholds,
its clock as Prometheus counters, and the start-up heap frozen. Each check runs in a child
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
