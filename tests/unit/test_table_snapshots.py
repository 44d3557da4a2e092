"""Table snapshots across layouts: a snapshot written by an older layout (a golden file, never
regenerated) restores to the state a replay of the same log builds now, and goes on identically.

The log covers what a table's layout depends on: optimizers with and without state and step counts
(Add, SGD, Adagrad, Adam, row-wise Adagrad, FTRL), every lifecycle column (TTL, LRU and LFU caps,
count admission), set rows, schedule overrides, ids in [0, 2**32) only or also negative or past it,
and dense keys with a row-wise accumulator.

Regenerate the golden file of the current layout (only after a deliberate layout change, with a
new layout number; older files stay):
    KVPS_REGEN_GOLDEN=1 .venv/bin/pytest tests/unit/test_table_snapshots.py -k current
"""
from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest

from kvps.command import CreateKey, CreateTable, Hyperparams, SetRows
from kvps.merge import PushRequest, merge
from kvps.shard import ShardState
from kvps.table import LAYOUT

GOLDEN = pathlib.Path(__file__).parent / "golden"
NORMAL = {"name": "normal", "seed": 7, "std": 0.5}
TABLES = {  # key -> (dim, optimizer, lifecycle)
    "add": (3, {"name": "add"}, None),
    "sgd": (2, {"name": "sgd", "lr": 0.1, "momentum": 0.9, "dampening": 0.1}, None),
    "adagrad": (2, {"name": "adagrad", "lr": 0.1, "lr_decay": 0.01}, {"ttl_s": 4.0}),
    "adam": (4, {"name": "adam", "lr": 0.01}, {"max_rows": 6, "evict": "lru"}),
    "rowwise": (5, {"name": "rowwise_adagrad", "lr": 0.1, "initial_accumulator": 0.25},
                {"max_rows": 5, "evict": "lfu", "ttl_s": 6.0, "admit": {"name": "count", "min_count": 2}}),
    "ftrl": (3, {"name": "ftrl", "alpha": 0.1, "l1": 0.01}, {"admit": {"name": "probability", "p": 0.6}}),
}
BIG = 2**40  # ids past 2**32 (hashed features)
NEGATIVE = ("add", "adagrad", "rowwise")  # tables pushed negative ids too; the others only ids >= 0


def _log() -> list:
    rng = np.random.default_rng(11)
    cmds: list = [CreateTable(k, dim, "float32", opt, NORMAL, "sum", life)
                  for k, (dim, opt, life) in TABLES.items()]
    cmds.append(CreateKey("dense_rw", (4, 3), "float32", 2, {"name": "rowwise_adagrad", "lr": 0.2}, "sum",
                          tuple((b, rng.standard_normal((2, 3)).astype(np.float32)) for b in range(2))))
    for seq in range(1, 13):
        rows = []
        for key, (dim, _, _) in TABLES.items():
            ids = np.unique(rng.integers(-3 if key in NEGATIVE else 0, 12, size=6)).astype(np.int64)
            if key in ("add", "rowwise") and seq % 3 == 0:
                ids = np.concatenate([ids, [BIG + seq]]).astype(np.int64)
            rows.append((key, ids, rng.standard_normal((len(ids), dim)).astype(np.float32)))
        dense = tuple(("dense_rw", b, rng.standard_normal((2, 3)).astype(np.float32)) for b in range(2))
        reqs = [PushRequest("c", seq, seq, dense, tuple(rows))]
        if seq % 4 == 0:  # a second client: merged rows count 2
            reqs.append(PushRequest("d", seq, seq, (), tuple(rows[:3])))
        cmds.append(merge(reqs, {}, now=float(seq)))
        if seq == 5:
            cmds.append(SetRows("add", np.int64([1, 50]), np.float32([[1, 2, 3], [4, 5, 6]])))
            cmds.append(SetRows("adam", np.int64([2]), np.float32([[1, 1, 1, 1]])))
            cmds.append(Hyperparams("adagrad", 5, {"lr": 0.05}))
    return cmds


def _replayed() -> ShardState:
    s = ShardState(0)
    for cmd in _log():
        result = s.apply(cmd).result
        assert not isinstance(result, Exception), result
    return s


def _reads(s: ShardState) -> dict:
    probe = np.concatenate([np.arange(-4, 14), BIG + np.arange(13), [10**6]]).astype(np.int64)
    out: dict = {}
    for key in TABLES:
        values, versions = s.read_rows(key, probe)
        info = dict(s.describe(key))
        info.pop("bytes")  # accounting may change with the layout; what is stored may not
        out[key] = (values.tobytes(), versions.tolist(), info)
    out["dense_rw"] = [(v, a.tobytes()) for v, a in s.read_blocks("dense_rw", [0, 1])]
    return out


def _go_on(s: ShardState) -> ShardState:
    """More pushes on every table, a row of each optimizer's state in use."""
    rng = np.random.default_rng(12)
    for seq in range(20, 26):
        rows = tuple((key, np.unique(rng.integers(-3, 14, size=5)).astype(np.int64),
                      rng.standard_normal((5, dim)).astype(np.float32)) for key, (dim, _, _) in TABLES.items())
        rows = tuple((k, ids, g[:len(ids)]) for k, ids, g in rows)
        dense = (("dense_rw", 1, np.ones((2, 3), np.float32)),)
        assert not isinstance(s.apply(merge([PushRequest("c", seq, seq, dense, rows)], {}, now=float(seq))).result,
                              Exception)
    return s


@pytest.mark.parametrize("layout", range(1, LAYOUT + 1))
def test_snapshot_of_every_table_layout_restores_as_a_replay(layout):
    """1: every row with int64 id, version, step, push count and float64 last push, row-wise
    accumulators per element. 2: only the columns the table reads (kvps.record)."""
    old = ShardState.restore((GOLDEN / f"snapshot_tables_v{layout}.bin").read_bytes())
    now = _replayed()
    assert _reads(old) == _reads(now)
    assert _go_on(old).snapshot() == _go_on(now).snapshot()


def test_snapshot_of_the_current_table_layout_is_pinned():
    path = GOLDEN / f"snapshot_tables_v{LAYOUT}.bin"
    data = _replayed().snapshot()
    if os.environ.get("KVPS_REGEN_GOLDEN") == "1":
        path.write_bytes(data)
    assert data == path.read_bytes()
    assert ShardState.restore(data).snapshot() == data
    assert LAYOUT == 1 or b'"layout":%d' % LAYOUT in data
