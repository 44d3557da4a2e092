"""``kvps bench``: the pure pieces, and a tiny end-to-end run (seconds) of every section.

The end-to-end test runs kvps and the in-memory baseline always; the Redis peer only where
``redis-server`` and the ``redis`` client are installed (``make bench`` installs both), otherwise
it checks that the run says why Redis was skipped instead of failing.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from kvps.bench.cli import main as bench_main
from kvps.bench.failover import _summary
from kvps.bench.harness import steps_in_window
from kvps.bench.plan import PLANS
from kvps.bench.redis_peer import redis_missing_reason
from kvps.bench.report import derive, render_markdown


def test_steps_in_window_counts_straddling_steps_by_fraction():
    steps = [(0.0, 1.0), (1.0, 2.0), (2.0, 3.0), (3.0, 4.0)]
    assert steps_in_window(steps, 0.5, 3.5) == pytest.approx(3.0)
    assert steps_in_window(steps, 1.0, 2.0) == pytest.approx(1.0)
    assert steps_in_window(steps, 10.0, 11.0) == 0.0
    assert steps_in_window([(1.0, 1.0)], 0.0, 2.0) == 0.0  # zero-length steps are ignored


def test_the_header_says_how_contended_the_machine_was():
    from kvps.bench.report import _pressure_md
    line = _pressure_md({"pressure_start": {"io": 8.57, "memory": 0.0}, "pressure_end": {"io": 9.4}})
    assert line == "; tasks waiting on io 8.6 % → 9.4 %, memory 0.0 % (5-min averages, start → end)"
    assert _pressure_md({}) == "" and _pressure_md({"pressure_start": {}}) == ""


def test_derive_names_ratios_and_targets():
    results = {
        "meta": {"plan": "t", "started": "s", "cpus": 2, "python": "3", "load_avg_start": 1.0,
                 "workers": 4, "model": {"tensors": 64, "tensor_bytes": 1 << 20, "bytes": 64 << 20}},
        "b1": {"systems": {"kvps": {"steps_per_s": 3.0, "bytes_per_s": 3e8},
                           "redis": {"steps_per_s": 2.0, "bytes_per_s": 2e8}},
               "ratio_vs_redis": 1.5},
        "b3": {**_summary([{"shard": 0, "node": 0, "kill_t": 10.0, "kill_to_commit_s": 0.4},
                           {"shard": 1, "node": 1, "kill_t": 20.0, "kill_to_commit_s": 2.0}],
                          [(9.0, 9.1), (10.0, 10.5), (20.0, 20.1)], None),
               "model": {"tensors": 16, "tensor_bytes": 1 << 20}},
        "b5": {"loopback_bytes_per_s": 3e9, "memcpy_bytes_per_s": 6e9},
        "b0": {"procs_0": {"procs": 0, "cores": 0.3, "processes": 27},
               "procs_1": {"procs": 1, "cores": 0.04, "processes": 3}},
        "b7": {"systems": {"kvps": {"create_s": 1.5, "pull_s": 0.3, "push_s": 0.5, "round_s": 0.8, "rounds": 5},
                           "redis": {"create_s": 0.5, "pull_s": 0.1, "push_s": 0.1, "round_s": 0.2, "rounds": 5}},
               "ratio_vs_redis": 0.25, "workload": {"keys": 10_000, "key_bytes": 1024, "rounds": 5}},
    }
    derive(results)
    met = {t["name"]: t["met"] for t in results["targets"]}
    assert met == {"b1_vs_redis": True, "b1_vs_rpc": None, "b2_1mib_vs_redis": None, "b1_tcp_vs_redis": None,
                   "b1_vs_redis_half": True, "b1_server_cpu": None, "b1_server_faults": None,
                   "b1_page_cache": None, "b1_elections": None, "b1_retries": None,
                   "b0_idle": True, "b3_p50": False, "b3_max": False,  # median of (0.4, 2.0) is 1.2
                   "b7_vs_redis": False, "b7_create": True}
    # L: 4 models over loopback at 3 GB/s + 11.5 models through memory at 6 GB/s, on 2 cores
    model = 64 << 20
    limit = 2 / (4 * model / 3e9 + 11.5 * model / 6e9)
    assert results["b1"]["limit"]["steps_per_s"] == pytest.approx(limit)
    assert results["b1"]["systems"]["kvps"]["fraction_of_limit"] == pytest.approx(3.0 / limit)
    assert results["b3"]["stall_s"] == pytest.approx([0.4, 0.0])  # 0.5 s step vs 0.1 s median
    assert results["b5"]["kvps_fraction"]["b1_bytes_per_s_of_loopback"] == pytest.approx(0.1)
    md = render_markdown(results)
    assert "| B3 kill → first commit max ≤ 1.5 s | 2.00 | **no** |" in md
    assert "**Physical limit** L = " in md
    assert "| in the node's process (`procs = 1`) | 3 | 0.040 | – |" in md
    assert "| kvps | 1.50 | 0.300 | 0.500 | 0.800 | – | – |" in md and "| redis | 0.50 |" in md


def test_updates_lost_counts_the_pushes_missing_from_the_final_values():
    from kvps.bench.workload import LR, Model, updates_lost

    model = Model(tensors=2, tensor_bytes=64 << 10)
    grads = [model.grads(rank) for rank in range(3)]
    applied = [5, 7, 3]  # pushes that took effect, per worker
    final = []
    for t, value in enumerate(model.values()):
        for rank, n in enumerate(applied):
            for _ in range(n):
                value -= np.float32(LR) * grads[rank][t]
        final.append(value)
    assert updates_lost(model, final, applied) == {"updates_pushed": 30, "updates_lost": 0}
    # worker 1 pushed 9 times but two of them were overwritten, on each of the 2 tensors
    assert updates_lost(model, final, [5, 9, 3]) == {"updates_pushed": 34, "updates_lost": 4}


@pytest.mark.cluster
def test_tiny_bench_runs_every_section(tmp_path, capsys):
    out = tmp_path / "bench"
    # --no-install: a test must not apt-get; RPC is covered by the quick/full runs (torch RPC
    # start-up alone takes longer than this whole test).
    assert bench_main(["--plan", "tiny", "--out", str(out), "--skip", "rpc", "--no-install",
                       "--quiet"]) == 0
    results = json.loads((out / "results.json").read_text())
    md = (out / "results.md").read_text()

    b1 = results["b1"]["systems"]
    assert b1["kvps"]["steps_per_s"] > 0 and b1["inmem"]["steps_per_s"] > 0
    # exactly-once: every push the workers made is in the final values
    assert b1["kvps"]["updates_lost"] == 0 and b1["kvps"]["updates_pushed"] > 0
    assert b1["kvps"]["server_minflt_per_step"] > 0 and "page_cache_mib_per_step" in b1["kvps"]
    assert b1["kvps"]["role_changes"] >= 0 and b1["kvps"]["role_changes_warmup"] >= 0  # both sampled
    assert 0 < b1["kvps"]["fraction_of_limit"] < 1
    assert results["b1"]["ratio_vs_inmem"] > 0
    assert results["b3"]["kills"] == 1 and 0 < results["b3"]["p50_s"] < 30
    assert results["b4"]["cases"]["unchanged"]["bytes"] < results["b4"]["cases"]["full"]["bytes"] / 100
    cases = results["b4"]["cases"]
    # every changed block ships something (whole, or as a delta once those exist), never more than full
    assert cases["unchanged"]["bytes"] < cases["dense"]["bytes"] <= cases["full"]["bytes"] * 1.01
    assert results["b5"]["memcpy_bytes_per_s"] > 0 and results["b5"]["loopback_bytes_per_s"] > 0
    assert {t["name"] for t in results["targets"]} >= {"b1_vs_redis", "b3_p50"}
    b6 = results["b6"]["systems"]
    assert b6["kvps"]["rows_per_s"] > 0 and results["b6"]["workload"]["rows_per_step"] > 1
    b0 = results["b0"]
    assert b0["procs_0"]["cores"] > 0 and b0["procs_1"]["cores"] > 0
    assert b0["procs_0"]["ready_s"] > 0 and b0["procs_1"]["ready_s"] > 0
    # every replica a process of its own (3 nodes + 3 x 2 replicas), or only the 3 nodes
    assert b0["procs_0"]["processes"] == 3 + 3 * 2 and b0["procs_1"]["processes"] == 3
    assert results["meta"]["kvps_cluster"]["procs"] == 1
    if Path("/proc/pressure/io").exists():  # Linux with PSI: the run says how contended it was
        assert set(results["meta"]["pressure_start"]) >= {"io"} and "tasks waiting on io" in md
    b7 = results["b7"]["systems"]  # the run itself checks every key's value after the pushes
    assert b7["kvps"]["rounds"] == 2 and 0 < b7["kvps"]["pull_s"] and 0 < b7["kvps"]["create_s"]
    assert (out / "b7_small_keys.png").stat().st_size > 0
    for section in ("## B0", "## B1", "## B2", "## B3", "## B4", "## B5", "## B6", "## B7", "## Targets"):
        assert section in md

    reason = redis_missing_reason(install=False)
    if reason is None:
        assert b1["redis"]["steps_per_s"] > 0
        assert 0 <= b1["redis"]["updates_lost"] <= b1["redis"]["updates_pushed"]
        row = results["b2"]["batched"][str(64 << 10)]
        assert row["redis"]["bytes_per_s"] > 0 and row["kvps"]["bytes_per_s"] > 0
        assert math.isfinite(row["ratio_vs_redis"])
        assert b6["redis"]["rows_per_s"] > 0 and math.isfinite(results["b6"]["ratio_vs_redis"])
        assert b7["redis"]["round_s"] > 0 and results["b7"]["ratio_vs_redis"] > 0
    else:
        assert "redis" in results["skipped"] and "redis" not in b1 and "redis" not in b6
        assert "redis" not in b7
        assert "redis" in md  # the skip is stated in the report


def test_plans_are_ordered_by_cost():
    assert PLANS["tiny"].b1_seconds < PLANS["quick"].b1_seconds < PLANS["full"].b1_seconds
    assert PLANS["full"].b3_kills >= 10 and PLANS["full"].workers == 4
    assert PLANS["full"].model.nbytes == 64 << 20


def test_missing_redis_is_skipped_with_a_reason(tmp_path, monkeypatch, capsys):
    from kvps.bench import redis_peer

    monkeypatch.setattr(redis_peer, "ensure_redis_server", lambda install=False: None)
    out = tmp_path / "bench"
    assert bench_main(["--plan", "tiny", "--only", "b1", "--skip", "kvps,rpc", "--out", str(out),
                       "--quiet"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert "redis-server" in results["skipped"]["redis"]
    assert "skipping redis" in capsys.readouterr().err
    assert results["b1"]["systems"]["inmem"]["steps_per_s"] > 0
