"""The command line against a real cluster: status table and --json, exit codes."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvps.cli import format_status

pytestmark = pytest.mark.cluster


def kvps(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvps.cli", *args], capture_output=True, text=True,
                          timeout=60)


def test_status_table_json_and_unreachable_endpoint(cluster_factory):
    c = cluster_factory(shards=2).start()
    out = kvps("status", "--endpoint", c.endpoints[0])
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:5] == ["shard", "leader", "term", "lag", "health"]
    assert len(lines) == 2 + 2 and "2/2 shards healthy" in lines[-1]
    js = kvps("status", "--endpoint", c.endpoints[1], "--json")
    cmap = json.loads(js.stdout)
    assert [s["id"] for s in cmap["shards"]] == [0, 1]
    assert all(len(s["replicas"]) == 3 for s in cmap["shards"])
    c.stop()
    down = kvps("status", "--endpoint", c.endpoints[0])
    assert down.returncode != 0 and down.stderr.count("\n") == 1 and "cannot reach" in down.stderr


def test_status_marks_a_shard_without_leader():
    cmap = {"nodes": [{"id": 0, "reachable": True}],
            "shards": [{"id": 0, "leader": None, "term": 3, "replicas": [
                {"node": 0, "role": "follower", "alive": True, "applied_index": 5}]}]}
    text = format_status(cmap)
    assert "NO LEADER" in text and "0/1 shards healthy" in text
