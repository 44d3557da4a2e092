"""Chaos runs against real clusters: the CI scenario (every fault kind this machine can inject,
about two minutes) must pass, and the same harness must fail against a deliberately broken build.

The seed is fixed so CI is reproducible; set KVPS_CHAOS_SEED to explore others. Every failure
message carries the seed and the command that replays the run.
"""
from __future__ import annotations

import json
import os

import pytest

from kvps_chaos.faults import ALL_FAULTS, NETNS_ONLY
from kvps_chaos.runner import ChaosOptions, run_chaos

pytestmark = pytest.mark.cluster

SEED = int(os.environ.get("KVPS_CHAOS_SEED", "2026"))


def _explain(report: dict) -> str:
    return (f"seed {report['seed']}: {report['failures']}\nreplay: {report['replay']}\n"
            f"faults: {json.dumps(report['faults'], indent=1)}")


def test_chaos_ci_scenario_every_fault_kind_nothing_lost(tmp_path):
    # Every kind once, however long that takes on a loaded machine (~70 s quiet), then what is
    # left of the 60 s: the run's length no longer decides whether each kind gets its turn.
    opts = ChaosOptions(duration=60, seed=SEED, out=tmp_path / "chaos", hold=(1.5, 3.0),
                        quiet=(0.5, 1.5), progress=False, every_kind=True)
    report = run_chaos(opts)
    print(f"chaos CI scenario: seed {SEED}, mode {report['mode']}, faults {report['faults_by_kind']}")
    assert report["ok"], _explain(report)
    # Every fault kind the environment allows ran at least once; only packet-level faults may be
    # missing, and only when network namespaces are unavailable.
    assert set(report["faults_by_kind"]) == set(report["faults_requested"]), _explain(report)
    assert set(report["faults_not_run"]) <= (set() if report["mode"] == "netns" else NETNS_ONLY)
    assert set(report["faults_requested"]) | set(report["faults_not_run"]) == set(ALL_FAULTS)
    assert report["counter"]["acked"] > 100 and report["linearizability"]["ops"] > 100
    # the default process model: a replica's process is its node's (a leader kill kills the node)
    assert all(f["detail"].get("whole_node") for f in report["faults"] if f["kind"] == "kill-leader")
    assert report["counter"]["lost"] == 0 and report["counter"]["applied_twice"] == 0
    assert report["linearizability"]["ok"] is True
    assert report["convergence"]["ok"] and report["training"]["ok"]
    for name in ("report.json", "report.md", "timeline.png"):
        assert (opts.out / name).stat().st_size > 0


def test_chaos_catches_double_applies_in_a_build_without_the_duplicate_table(tmp_path):
    """The harness's self-test: with ``unsafe_disable_dedup`` every retried push is applied again.
    Lost replies and leader kills force retries, so the counter check must fail. Loopback mode:
    these faults need no namespaces, and it keeps that mode covered when CI has them."""
    # each kind once (every_kind), then the run ends: both kinds force retries, one of each is enough
    opts = ChaosOptions(duration=10, seed=SEED, out=tmp_path / "broken", shards=2, train_workers=1,
                        mode="loopback",
                        register_clients=2, faults=("reply-loss", "kill-leader"), every_kind=True,
                        unsafe_disable_dedup=True, hold=(3.0, 4.0), quiet=(0.5, 1.0), progress=False)
    report = run_chaos(opts)
    assert report["replies_lost_on_purpose"] > 0, _explain(report)
    assert not report["ok"], "the harness did not notice a server without a duplicate table"
    assert report["counter"]["applied_twice"] > 0, _explain(report)
    assert any("APPLIED TWICE" in f for f in report["failures"])
    assert "--unsafe-disable-dedup" in report["replay"]


def test_chaos_membership_a_node_joins_and_leaves_and_one_is_lost_under_training_nothing_lost(tmp_path):
    """The membership fault (a node joins, replicas spread onto it, it is drained and removed) and
    the lose-node fault (a node joins, then is killed and wiped for good: declared dead, its
    replicas re-created on the others, removed) between leader kills, in loopback mode, while the
    training and counter workloads run. Here every replica is a process of its own
    (``server.procs = 0``, the other process model; the CI scenario above runs the default)."""
    opts = ChaosOptions(duration=55, seed=SEED, out=tmp_path / "membership", shards=4, mode="loopback",
                        faults=("membership", "lose-node", "kill-leader"), hold=(1.5, 3.0), quiet=(0.5, 1.0),
                        progress=False, procs=0, every_kind=True)
    report = run_chaos(opts)
    print(f"chaos membership: seed {SEED}, faults {report['faults_by_kind']}")
    assert report["ok"], _explain(report)
    assert report["faults_by_kind"].get("membership", 0) >= 1, _explain(report)
    lost = [f for f in report["faults"] if f["kind"] == "lose-node"]
    assert lost and all(f["error"] is None for f in lost), _explain(report)
    # declared dead no sooner than node_dead_after (6 s in chaos runs), re-created, removed
    assert all(f["detail"]["declared_dead_s"] >= 5.0 and f["detail"]["replaced_s"] > 0 for f in lost)
    assert not any(f["detail"].get("whole_node") for f in report["faults"])  # replica processes
    assert report["counter"]["lost"] == 0 and report["counter"]["applied_twice"] == 0
    assert report["convergence"]["ok"] and report["linearizability"]["ok"] is True
