"""Runs the sections of one ``kvps bench`` and collects every figure into one results dict.

Order: the machine's limits first (B5, on a machine as quiet as it will get), then B1's
in-process baseline and the RPC peer (B1, B6), then Redis (B1, B2, B6) with no kvps process
running, then one kvps cluster for B1, B2, B4, B6, B7 and last B3 (it kills leaders). Each peer runs
alone, so none pays for
another's idle processes; ``load_avg`` is recorded with every measurement because the machine is
shared and drift between measurements is the main source of error.
"""
from __future__ import annotations

import dataclasses

import os
import platform
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvps.bench import limits, raw
from kvps.bench.harness import process_usage, run_workers, summarize
from kvps.bench.plan import Plan
from kvps.bench.progress import Progress, say

__all__ = ["run_suite"]


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def _pressure() -> dict[str, float]:
    """The share of time (%) some task waited on I/O and on memory over the last 5 minutes
    (``/proc/pressure``, Linux 4.20+; empty where absent). A contended disk or a host reclaiming
    the VM's page cache moved B1 by 3x between runs of the same code here; this says so in the
    results instead of leaving it to be guessed."""
    out: dict[str, float] = {}
    for resource in ("io", "memory"):
        try:
            with open(f"/proc/pressure/{resource}") as f:
                some = f.readline().split()
        except OSError:
            continue
        fields = dict(kv.split("=", 1) for kv in some[1:] if "=" in kv)
        if "avg300" in fields:
            out[resource] = float(fields["avg300"])
    return out


def run_suite(plan: Plan, sections: tuple[str, ...], systems: tuple[str, ...],
              progress: Progress, skipped: dict[str, str]) -> dict[str, Any]:
    results: dict[str, Any] = {
        "meta": {"plan": plan.name, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                 "cpus": os.cpu_count(), "python": platform.python_version(),
                 "machine": platform.machine(), "workers": plan.workers,
                 "model": {"tensors": plan.model.tensors, "tensor_bytes": plan.model.tensor_bytes,
                           "bytes": plan.model.nbytes},
                 "kvps_cluster": {"nodes": plan.nodes, "shards": plan.shards, "replicas": 3,
                                  "fsync": plan.kvps_fsync, "spread_wait_s": plan.spread_wait},
                 "load_avg_start": _load(), "pressure_start": _pressure()},
        "skipped": dict(skipped),
    }
    b1: dict[str, Any] = {}
    b2: dict[str, Any] = {}
    b6: dict[str, Any] = {}
    b7: dict[str, Any] = {}
    results["meta"]["kvps_cluster"]["procs"] = plan.kvps_procs
    if "b5" in sections:
        with progress.phase("B5 limits"):
            results["b5"] = {"loopback_bytes_per_s": limits.loopback_bytes_per_s(plan.b5_seconds),
                             "memcpy_bytes_per_s": limits.memcpy_bytes_per_s(plan.b5_seconds),
                             "load_avg": _load()}
    if "b0" in sections and "kvps" in systems:
        results["b0"] = _b0(plan, progress)
    if "b1" in sections and "inmem" in systems:
        with progress.phase("B1 inmem"):
            from kvps.bench.workload import inmem_baseline
            b1["inmem"] = {**inmem_baseline(plan.model, plan.workers, plan.b1_warmup, plan.b1_seconds),
                           "load_avg": _load()}
    if "b1" in sections and "rpc" in systems:
        with progress.phase("B1 rpc"):
            b1["rpc"] = _b1_rpc(plan)
    if "b6" in sections and "rpc" in systems:
        with progress.phase("B6 rpc"):
            b6["rpc"] = _b6_rpc(plan)
    if "redis" in systems and {"b1", "b2", "b6", "b7"} & set(sections):
        _redis(plan, sections, progress, b1, b2, b6, b7)
    if "kvps" in systems and {"b1", "b2", "b3", "b4", "b6", "b7"} & set(sections):
        _kvps(plan, sections, progress, b1, b2, b6, b7, results)
    if b1:
        results["b1"] = {"systems": b1, **_ratios(b1, "steps_per_s")}
        tcp, redis = b1.get("kvps_tcp", {}).get("steps_per_s"), b1.get("redis", {}).get("steps_per_s")
        if tcp and redis:  # the TCP-only row against Redis (workers on other hosts)
            results["b1"]["tcp_ratio_vs_redis"] = tcp / redis
    if b2:
        results["b2"] = _b2_table(b2)
    if b6:
        w = plan.b6_work
        results["b6"] = {"systems": b6, **_ratios(b6, "rows_per_s"),
                         "workload": {"rows": w.rows, "dim": w.dim, "lookups": w.lookups, "zipf_s": w.zipf_s,
                                      "workers": plan.workers, "rows_per_step": w.mean_rows(plan.workers)}}
    if b7:
        w = plan.b7_work
        results["b7"] = {"systems": b7, "workload": {"keys": w.keys, "key_bytes": w.key_bytes, "rounds": w.rounds}}
        if "kvps" in b7 and "redis" in b7:  # round time: lower is better, so the peer's over kvps's
            results["b7"]["ratio_vs_redis"] = b7["redis"]["round_s"] / b7["kvps"]["round_s"]
    results["meta"]["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    results["meta"]["pressure_end"] = _pressure()
    return results


# ---- peers ---------------------------------------------------------------------------------------

def _b1_rpc(plan: Plan) -> dict:
    from kvps.bench.rpc_peer import rpc_worker, start_rpc_server
    from kvps.node.local import free_port_base

    port = free_port_base(1)
    server = start_rpc_server(port, plan.workers, plan.model)
    try:
        reports = run_workers(rpc_worker, (port, plan.workers, plan.model), plan.workers,
                              warmup=plan.b1_warmup, seconds=plan.b1_seconds,
                              server=lambda: process_usage(lambda pid, _pp, _s: pid == server.pid))
        return {**summarize(reports, 2 * plan.model.nbytes), "load_avg": _load()}
    finally:
        server.join(timeout=30)
        if server.is_alive():
            server.kill()
            server.join()


def _b6_rpc(plan: Plan) -> dict:
    from kvps.bench.sparse import rpc_sparse_worker, start_rpc_table
    from kvps.node.local import free_port_base

    port = free_port_base(1)
    server = start_rpc_table(port, plan.workers, plan.b6_work)
    try:
        reports = run_workers(rpc_sparse_worker, (port, plan.workers, plan.b6_work), plan.workers,
                              warmup=plan.b6_warmup, seconds=plan.b6_seconds,
                              server=lambda: process_usage(lambda pid, _pp, _s: pid == server.pid))
        return _b6_figures(plan, reports)
    finally:
        server.join(timeout=30)
        if server.is_alive():
            server.kill()
            server.join()


def _b6_figures(plan: Plan, reports: list) -> dict:
    """Steps/s, and rows/s: the mean deduplicated rows per step times steps/s."""
    rows = plan.b6_work.mean_rows(plan.workers)
    figures = summarize(reports, int(rows * plan.b6_work.dim * 4 * 2))
    return {**figures, "rows_per_s": figures["steps_per_s"] * rows, "load_avg": _load()}


def _redis(plan: Plan, sections, progress: Progress, b1: dict, b2: dict, b6: dict, b7: dict) -> None:
    with _redis_group(False, progress, "start redis") as (group, usage):
        if "b1" in sections:
            with progress.phase("B1 redis"):
                b1["redis"] = _b1_redis(plan, group, usage)
        if "b2" in sections:
            with progress.phase("B2 redis"):
                b2["redis"] = {}
                for size in plan.b2_sizes:
                    for batched in (True, False):
                        progress.detail(f"{_size(size)} {'batched' if batched else 'one at a time'}")
                        b2["redis"][(size, batched)] = {
                            **raw.redis_raw(group.primary_port, group.replicas, size, batched,
                                            plan.b2_seconds, "r"), "load_avg": _load()}
        if "b6" in sections:
            from kvps.bench.sparse import load_redis_rows, redis_sparse_worker
            with progress.phase("B6 redis"):
                load_redis_rows(group.primary_port, group.replicas, plan.b6_work, plan.workers)
                reports = run_workers(redis_sparse_worker, (group.primary_port, group.replicas, plan.b6_work),
                                      plan.workers, warmup=plan.b6_warmup, seconds=plan.b6_seconds,
                                      server=usage)
                b6["redis"] = {**_b6_figures(plan, reports),
                               "wait_short": sum(r.counters.get("wait_short", 0) for r in reports),
                               "semantics": "last-writer-wins per row"}
        if "b7" in sections:
            from kvps.bench.small_keys import redis_small_keys
            with progress.phase("B7 redis"):
                b7["redis"] = {**redis_small_keys(group.primary_port, group.replicas, plan.b7_work,
                                                  progress.detail), "load_avg": _load()}
    if "b1" in sections and plan.b1_fairness:
        # the fairness row: Redis persisting its writes as kvps's journal does (fsync every second)
        with _redis_group(True, progress, "start redis (aof)") as (group, usage):
            with progress.phase("B1 redis (aof)"):
                b1["redis_aof"] = _b1_redis(plan, group, usage)


@contextmanager
def _redis_group(appendonly: bool, progress: Progress, phase: str) -> Iterator[tuple[Any, Callable]]:
    """A started Redis primary + 2 replicas and the ``process_usage`` sampler of its servers."""
    from kvps.bench.redis_peer import RedisGroup

    with tempfile.TemporaryDirectory(prefix="kvps-bench-redis-") as tmp, \
            RedisGroup(Path(tmp), appendonly=appendonly) as group:
        with progress.phase(phase):
            group.start()
        pids = {p.pid for p in group.procs}
        yield group, lambda: process_usage(lambda pid, _pp, _s: pid in pids)


def _b1_redis(plan: Plan, group: Any, usage: Callable) -> dict[str, Any]:
    from kvps.bench.redis_peer import redis_worker
    from kvps.bench.workload import updates_lost

    group.load(plan.model.names(), plan.model.values())
    reports = run_workers(redis_worker, (group.primary_port, group.replicas, plan.model),
                          plan.workers, warmup=plan.b1_warmup, seconds=plan.b1_seconds, server=usage)
    return {**summarize(reports, 2 * plan.model.nbytes), "load_avg": _load(),
            "wait_short": sum(r.counters.get("wait_short", 0) for r in reports),
            **updates_lost(plan.model, group.read(plan.model.names()), [len(r.steps) for r in reports]),
            "semantics": "last-writer-wins: concurrent workers overwrite each other"}


def _kvps(plan: Plan, sections, progress: Progress, b1: dict, b2: dict, b6: dict, b7: dict,
          results: dict) -> None:
    from kvps.bench.failover import failover
    from kvps.bench.pulls import pulls

    with _kvps_cluster(plan, plan.kvps_fsync, progress, "start kvps") as (cluster, usage):
        if "b1" in sections:
            with progress.phase("B1 kvps"):
                b1["kvps"] = _b1_kvps(plan, cluster, usage)
            if plan.b1_tcp_row:
                # what workers on other hosts get: no shared-memory pulls (its own keys)
                with progress.phase("B1 kvps (TCP only)"):
                    b1["kvps_tcp"] = {**_b1_kvps(plan, cluster, usage, {"shm": False}, prefix="b1t"),
                                      "shm": False}
        if "b2" in sections:
            with progress.phase("B2 kvps"):
                b2["kvps"] = {}
                for size in plan.b2_sizes:
                    for batched in (True, False):
                        progress.detail(f"{_size(size)} {'batched' if batched else 'one at a time'}")
                        b2["kvps"][(size, batched)] = {
                            **raw.kvps_raw(cluster.endpoints, cluster.token, size, batched,
                                           plan.b2_seconds, "k"), "load_avg": _load()}
        if "b4" in sections:
            with progress.phase("B4 kvps"):
                results["b4"] = {**pulls(cluster.endpoints, cluster.token, plan.model, plan.b4_repeats),
                                 "load_avg": _load()}
        if "b6" in sections:
            from kvps.bench.sparse import create_table, kvps_sparse_worker
            with progress.phase("B6 kvps"):
                create_table(cluster.endpoints, cluster.token, plan.b6_work)
                reports = run_workers(kvps_sparse_worker, (cluster.endpoints, cluster.token, plan.b6_work),
                                      plan.workers, warmup=plan.b6_warmup, seconds=plan.b6_seconds,
                                      server=lambda: {**usage(), **_replica_counters(cluster)})
                b6["kvps"] = {**_b6_figures(plan, reports), **_b1_server_counters(reports[0].counters),
                              "semantics": "every row push applied exactly once"}
        if "b7" in sections:
            from kvps.bench.small_keys import kvps_small_keys
            with progress.phase("B7 kvps"):
                b7["kvps"] = {**kvps_small_keys(cluster.endpoints, cluster.token, plan.b7_work,
                                                progress.detail), "load_avg": _load()}
        if "b3" in sections:  # last: it kills leaders
            with progress.phase("B3 kvps"):
                results["b3"] = {**failover(cluster, plan.b3_model, plan.b3_kills, progress.detail),
                                 "load_avg": _load(),
                                 "model": {"tensors": plan.b3_model.tensors,
                                           "tensor_bytes": plan.b3_model.tensor_bytes}}
    if "b1" in sections and plan.b1_procs_row:
        # the other process model (ServerConfig.procs), same semantics, same window
        other = 1 - plan.kvps_procs
        with _kvps_cluster(plan, plan.kvps_fsync, progress, f"start kvps (procs {other})",
                           procs=other) as (cluster, usage):
            with progress.phase(f"B1 kvps (procs {other})"):
                b1[f"kvps_procs{other}"] = {**_b1_kvps(plan, cluster, usage), "procs": other}
    if "b1" in sections and plan.b1_fairness and plan.kvps_fsync != "never":
        # the fairness row: Redis persists nothing; this is kvps without fsync
        with _kvps_cluster(plan, "never", progress, "start kvps (fsync never)") as (cluster, usage):
            with progress.phase("B1 kvps (fsync never)"):
                b1["kvps_fsync_never"] = {**_b1_kvps(plan, cluster, usage),
                                          "semantics": "as kvps; acknowledged pushes survive kill -9, "
                                                       "not a power loss of a majority"}


def _b0(plan: Plan, progress: Progress) -> dict[str, Any]:
    """B0: the CPU an idle, settled cluster burns, per process model (ServerConfig.procs)."""
    out: dict[str, Any] = {}
    for procs in (0, 1):
        phase = f"B0 kvps (procs {procs})"
        timing: dict[str, float] = {}
        with _kvps_cluster(plan, plan.kvps_fsync, progress, phase, procs=procs,
                           timing=timing) as (cluster, usage):
            with progress.phase(phase):
                time.sleep(plan.b0_settle)  # nothing is measured yet: the cluster settles
                before, t0 = usage(), time.monotonic()
                time.sleep(plan.b0_seconds)
                after, t1 = usage(), time.monotonic()
                # the live threads' nanoseconds: clock ticks (10 ms) can read 0 for an idle
                # cluster over a short window; B0's threads live as long as the cluster
                cpu = "cpu_live_s" if after["cpu_live_s"] > 0 else "cpu_s"
                out[f"procs_{procs}"] = {
                    "procs": procs, "cores": max(0.0, after[cpu] - before[cpu]) / (t1 - t0),
                    "processes": after.get("processes"), "seconds": round(t1 - t0, 2),
                    # from starting the node processes to a serving leader on every shard
                    "ready_s": timing.get("ready_s"),
                    "load_avg": _load()}
    return out


@contextmanager
def _kvps_cluster(plan: Plan, fsync: str, progress: Progress, phase: str, procs: int | None = None,
                  timing: dict[str, float] | None = None) -> Iterator[tuple[Any, Callable]]:
    """A started ``LocalCluster`` of the plan's size with its leaders spread, and the
    ``process_usage`` sampler of its processes. ``procs``: ServerConfig.procs (None: the plan's);
    ``timing["ready_s"]``: seconds from starting the nodes to a serving leader on every shard."""
    from kvps.config import RaftConfig, ServerConfig
    from kvps.node.local import LocalCluster

    procs = plan.kvps_procs if procs is None else procs
    with tempfile.TemporaryDirectory(prefix="kvps-bench-") as tmp, \
            LocalCluster(Path(tmp), nodes=plan.nodes, shards=plan.shards,
                         raft=RaftConfig(fsync=fsync), server=ServerConfig(procs=procs)) as cluster:
        with progress.phase(phase):
            started = time.monotonic()
            cluster.start(wait=False)
            cluster.wait_ready(120)
            if timing is not None:
                timing["ready_s"] = time.monotonic() - started
            cluster.start(timeout=120)  # the rest of start(): every replica up, identities recorded
            # the leaders first spread over the nodes (transfers: not elections under load)
            if plan.spread_wait > 0 and not cluster.wait_leaders_spread(plan.spread_wait):
                say(f"kvps: leaders not spread within {plan.spread_wait:g} s; measuring anyway")
        sessions = lambda: {p.pid for p in cluster.procs.values()}  # noqa: E731
        yield cluster, lambda: process_usage(lambda pid, _pp, sid: sid in sessions())


def _b1_kvps(plan: Plan, cluster: Any, usage: Callable, client_options: dict | None = None,
             prefix: str = "b1") -> dict[str, Any]:
    from kvps.bench.workload import create_model, kvps_worker, read_model, updates_lost

    model = dataclasses.replace(plan.model, prefix=prefix)
    create_model(cluster.endpoints, cluster.token, model)
    # the replicas' counters are sampled with the processes' usage, at the window's edges
    reports = run_workers(kvps_worker, (cluster.endpoints, cluster.token, model, client_options or {}),
                          plan.workers, warmup=plan.b1_warmup, seconds=plan.b1_seconds,
                          server=lambda: {**usage(), **_replica_counters(cluster)})
    return {**summarize(reports, 2 * plan.model.nbytes), "load_avg": _load(),
            "wire_bytes": sum(r.counters.get("wire_bytes", 0) for r in reports),
            "client_retries": sum(r.counters.get("retries", 0) for r in reports),
            # blocks pulls read from the leaders' shared-memory mirrors, and shard pulls they
            # could not serve (sent over TCP)
            "mirror_blocks": sum(r.counters.get("mirror_blocks", 0) for r in reports),
            "mirror_fallbacks": sum(r.counters.get("mirror_fallbacks", 0) for r in reports),
            "mirror_fallback_reasons": _summed(reports, "mirror_fallback_"),
            # request bodies written into the workers' push rings instead of sent (kvps.delta.ring)
            "ring_requests": sum(r.counters.get("ring_requests", 0) for r in reports),
            "ring_bytes": sum(r.counters.get("ring_bytes", 0) for r in reports),
            **_b1_server_counters(reports[0].counters),
            **updates_lost(model, read_model(cluster.endpoints, cluster.token, model),
                           [len(r.steps) for r in reports]),
            "semantics": "every push applied exactly once (merged on the leader)"}


def _summed(reports: list, prefix: str) -> dict[str, float]:
    """The workers' counters named ``prefix<x>``, summed: ``{x: total}``."""
    out: dict[str, float] = {}
    for r in reports:
        for name, value in r.counters.items():
            if name.startswith(prefix):
                out[name[len(prefix):]] = out.get(name[len(prefix):], 0) + value
    return out


def _replica_counters(cluster) -> dict[str, int]:
    """Every replica's ``/v1/status`` counters, summed over the cluster."""
    from kvps.bench.failover import replica_status

    total: dict[str, int] = {}
    for shard in range(cluster.cfg.shards):
        for node in cluster.cfg.replica_nodes(shard):
            for name, value in ((replica_status(cluster, shard, node) or {}).get("counters") or {}).items():
                total[name] = total.get(name, 0) + int(value)
    return total


def _b1_server_counters(counters: dict[str, float]) -> dict[str, float]:
    """From the replicas' counters' growth over the window (``server_<name>`` in a report)."""
    batches = counters.get("server_batches", 0)
    return {
        # elections with no fault injected: each one stalls a shard's pushes
        "role_changes": int(counters.get("server_leader_changes", 0)),
        # the same in the warm-up before it (start-up load: compactions begin, pages first touched)
        "role_changes_warmup": (int(counters["warmup_server_leader_changes"])
                                if "warmup_server_leader_changes" in counters else None),
        # client push requests per Raft entry: how much the leaders' merging saved
        "pushes_per_entry": counters.get("server_batched_pushes", 0) / batches if batches else float("nan"),
    }


# ---- derived figures ----------------------------------------------------------------------------

def _ratios(systems: dict[str, dict], metric: str) -> dict[str, float]:
    """kvps's ``metric`` divided by each peer's, under ``ratio_vs_<peer>``."""
    out = {}
    mine = systems.get("kvps", {}).get(metric)
    for peer, figures in systems.items():
        if peer != "kvps" and mine is not None and figures.get(metric):
            out[f"ratio_vs_{peer}"] = mine / figures[metric]
    return out


def _b2_table(b2: dict[str, dict]) -> dict[str, Any]:
    """{"batched": {"4096": {"kvps": {...}, "redis": {...}, "ratio_vs_redis": r}}, "single": ...}"""
    out: dict[str, Any] = {"batched": {}, "single": {}}
    for system, by in b2.items():
        for (size, batched), figures in by.items():
            row = out["batched" if batched else "single"].setdefault(str(size), {})
            row[system] = figures
    for mode in out.values():
        for row in mode.values():
            row.update(_ratios(row, "bytes_per_s"))
    return out


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"
