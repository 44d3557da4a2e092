"""`kvps demo` end to end in its quick configuration (3 epochs, 2 shards): real workers, every
shard's leader killed, exactly-once checks, the plot, and nothing left running afterwards."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
from pathlib import Path

import pytest

from kvps.demo import run as demo

pytestmark = pytest.mark.cluster


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue  # gone meanwhile
        if text.encode() in cmdline:
            found.append(int(pid))
    return found


@pytest.mark.timeout(240)  # the demo bounds its own training at 60 s in quick mode
def test_quick_demo_trains_through_leader_kills_and_cleans_up(tmp_path, capsys):
    rc = demo.main(out=tmp_path, seed=0, quick=True)
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert rc == 0 and summary["ok"], out
    steps = summary["acknowledged"]
    assert steps == 135 and summary["counter"] == steps  # 3 workers x 3 epochs x 15 batches
    assert summary["lost"] == 0 and summary["applied_twice"] == 0
    assert set(summary["param_versions"].values()) == {steps}  # every gradient applied once
    kills = summary["kills"]
    assert sorted(k["shard"] for k in kills) == [0, 1]  # every shard's leader, once
    assert all(k["serving_after"] is not None and k["next_step_after"] is not None for k in kills)
    assert summary["accuracy"] >= summary["baseline_accuracy"] - summary["tolerance"]
    png = (tmp_path / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert "result: OK" in out and "lost: 0   applied twice: 0" in out
    data_dir = re.search(r"data in (\S+)", out).group(1)
    assert not Path(data_dir).exists()
    assert _processes_mentioning(data_dir) == []  # no node or replica process survived
    assert mp.active_children() == []  # nor any worker
