"""`kvps demo --task ctr` end to end in its quick configuration (~60 steps, 2 shards): embedding
tables and an MLP trained by 3 workers while every shard's leader is killed; exactly-once checks,
the AUC against the one-process baseline, and nothing left running afterwards."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
from pathlib import Path

import pytest

from kvps.demo import ctr_run
from kvps.demo.ctr import QUICK

pytestmark = pytest.mark.cluster


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if text.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            continue  # gone meanwhile
    return found


@pytest.mark.timeout(240)  # the demo bounds its own training at 60 s in quick mode
def test_quick_ctr_demo_trains_through_leader_kills_and_cleans_up(tmp_path, capsys):
    rc = ctr_run.main(out=tmp_path, seed=0, quick=True)
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert rc == 0 and summary["ok"], out
    steps = summary["acknowledged"]
    assert steps == QUICK.total_steps() and summary["counter"] == steps
    assert summary["lost"] == 0 and summary["applied_twice"] == 0
    assert set(summary["param_versions"].values()) == {steps}
    assert sorted(k["shard"] for k in summary["kills"]) == [0, 1]
    assert summary["auc"] >= summary["baseline_auc"] - summary["tolerance"]
    assert 0.5 < summary["baseline_auc"] < summary["truth_auc"]
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "result: OK" in out and "test AUC:" in out
    data_dir = re.search(r"data in (\S+)", out).group(1)
    assert not Path(data_dir).exists() and _processes_mentioning(data_dir) == []
    assert mp.active_children() == []
