"""Row lifecycle and memory limits of tables (kvps.lifecycle, kvps.rows, kvps.capacity): the hash
index against a dict, capacity refusals that change nothing, snapshots that keep the lifecycle
state, a stream of many distinct ids that keeps a table at its cap, and the options' checks."""
from __future__ import annotations

import numpy as np
import pytest

import kvps_client as kc
from kvps.command import CreateTable, Push, PushId, RowDelta, SetRows, decode_command
from kvps.errors import CapacityExceeded, InvalidRequest, Unavailable
from kvps.lifecycle import Scratch, least, lifecycle_from_dict
from kvps.machine import RowsChurned
from kvps.rows import RowIndex
from kvps.shard import ShardState

ADD = {"name": "add"}
ZEROS = {"name": "zeros"}
# accounted bytes of a row of dim 2 float64 under Add (no state, no steps): 16 of values, a uint32
# id and version, an 8-byte index entry; a capped table adds its float64 last-push time
ROW = 16 + 4 + 4 + 8
CAPPED_ROW = ROW + 8


def _push(s: ShardState, seq: int, ids, now: float = 1.0, key: str = "e", dim: int = 2, client: str = "c"):
    ids = np.asarray(ids, np.int64)
    cmd = Push(now, (PushId(client, seq, seq, (key,)),), (),
               (RowDelta(key, ids, np.ones((len(ids), dim)), np.ones(len(ids), np.int64)),))
    return s.apply(decode_command(cmd.to_bytes())).result["results"][(client, seq)]


def _table(life: dict | None, memory_limit: int | None = None, dim: int = 2) -> ShardState:
    s = ShardState(0, memory_limit=memory_limit)
    assert s.apply(CreateTable("e", dim, "float64", ADD, ZEROS, "sum", life)).result == {"created": True}
    return s


def test_row_index_agrees_with_a_dict_through_inserts_removals_and_moves():
    rng = np.random.default_rng(0)
    keys = np.zeros(5000, np.int64)
    index, model, n = RowIndex(), {}, 0
    for _ in range(60):
        fresh = np.unique(rng.integers(-10**12, 10**12, int(rng.integers(1, 120))))
        fresh = fresh[[int(i) not in model for i in fresh]]
        slots = np.arange(n, n + len(fresh))
        keys[slots] = fresh
        index.insert(fresh, slots, keys)
        model.update(zip(fresh.tolist(), slots.tolist()))
        n += len(fresh)
        if model and rng.random() < 0.5:  # remove some, moving the last slot into each hole
            for i in rng.choice(list(model), size=min(len(model), 5), replace=False).tolist():
                slot = model.pop(i)
                _, where = index.find(np.array([i]), keys)
                index.remove(where)
                n -= 1
                if slot != n:
                    moved = int(keys[n])
                    _, at = index.find(np.array([moved]), keys)
                    keys[slot] = moved
                    index.move(at, np.array([slot]))
                    model[moved] = slot
        probe = np.concatenate([np.array(list(model), np.int64), rng.integers(-10**12, 10**12, 50)])
        got, _ = index.find(probe, keys)
        assert got.tolist() == [model.get(i, -1) for i in probe.tolist()]
    assert index.live == len(model)


def test_row_index_places_a_batch_in_runs_and_finds_every_id(monkeypatch):
    import kvps.rows
    monkeypatch.setattr(kvps.rows, "PLACE_RUN", 7)  # many runs, ids of a run colliding with earlier runs'
    rng = np.random.default_rng(3)
    keys = rng.choice(10**9, 500, replace=False).astype(np.int64)
    index = RowIndex()
    index.insert(keys[:300], np.arange(300, dtype=np.int64), keys)
    index.rebuild(keys, 300)  # the rebuild places every live id again, in runs
    index.insert(keys[300:], np.arange(300, 500, dtype=np.int64), keys)
    got, _ = index.find(np.concatenate([keys, keys + 1]), keys)
    assert got.tolist() == list(range(500)) + [-1] * 500


def test_least_is_the_lexicographic_order():
    rng = np.random.default_rng(1)
    for _ in range(50):
        n = int(rng.integers(1, 40))
        a, b, ids = rng.integers(0, 3, n), rng.integers(0, 3, n).astype(float), rng.permutation(n) - 5
        k = int(rng.integers(0, n + 1))
        want = sorted(sorted(range(n), key=lambda i: (a[i], b[i], ids[i]))[:k])
        assert least([a, b, ids], k).tolist() == want
        after = rng.random(n) < 0.3  # flagged entries (rows of the push) go last, in their own order
        want = sorted(sorted(range(n), key=lambda i: (after[i], a[i], b[i], ids[i]))[:k])
        assert least([a, b, ids], k, after).tolist() == want


def test_least_with_kept_work_arrays_matches_fresh_ones_and_reads_columns_only():
    rng = np.random.default_rng(2)
    scratch = Scratch()
    for _ in range(60):  # sizes up and down: buffers are reused, grown, and sliced
        n = int(rng.integers(1, 300))
        cols = [rng.integers(0, 4, n), rng.integers(0, 3, n).astype(float), rng.permutation(n)]
        before = [c.copy() for c in cols]
        k = int(rng.integers(0, n + 1))
        after = rng.random(n) < 0.3
        assert least(cols, k, after, scratch).tolist() == least(cols, k, after).tolist()
        assert least(cols, k, None, scratch).tolist() == least(cols, k).tolist()
        assert all((c == b).all() for c, b in zip(cols, before))  # columns are never written
    assert 0 < scratch.nbytes < 10 * 300 * 8  # a few row-sized buffers, not one per call


def test_a_capped_table_that_grows_or_evicts_says_so_and_others_do_not():
    capped, free = _table({"max_rows": 300, "shards": 1, "evict": "lru"}), _table(None)
    cmd = lambda seq, ids: decode_command(Push(float(seq), (PushId("c", seq, seq, ("e",)),), (), (  # noqa: E731
        RowDelta("e", np.asarray(ids, np.int64), np.ones((len(ids), 2)), np.ones(len(ids), np.int64)),)).to_bytes())
    churn = lambda applied: [e.rows for e in applied.effects if isinstance(e, RowsChurned)]  # noqa: E731
    assert churn(capped.apply(cmd(1, range(200)))) == [200]  # 200 rows added
    assert churn(capped.apply(cmd(2, range(200)))) == []  # the same rows again: nothing added
    assert churn(capped.apply(cmd(3, range(200, 400)))) == [300]  # 200 added, 100 evicted
    assert churn(free.apply(cmd(1, range(200)))) == []  # no cap: no reason to trim
    set_rows = lambda ids: SetRows("e", np.asarray(ids, np.int64), np.zeros((len(ids), 2)))  # noqa: E731
    assert churn(capped.apply(set_rows(range(400, 450)))) == [100]  # rows set past the cap: 50 in, 50 out
    assert churn(free.apply(set_rows(range(400, 450)))) == []


def test_a_capped_table_takes_its_cap_once_halfway_there():
    """Growing 1.25x at a time to the cap held old and new arrays together five more times; the
    cap at once costs nothing for the pages not written yet."""
    s = _table({"max_rows": 1000, "shards": 1, "evict": "lru"})
    capacities = []
    for q in range(12):  # 100 new rows per push
        _push(s, q + 1, np.arange(q * 100, (q + 1) * 100))
        capacities.append(len(s._keys["e"].ids))
    assert capacities == [100, 200, 300, 400] + [1000] * 8


def test_capacity_exceeded_changes_nothing_and_is_typed():
    s = _table(None, memory_limit=10 * ROW)
    assert "versions" in _push(s, 1, range(10))
    before = s.state_hash()
    err = _push(s, 2, [5, 10, 11])  # two new rows: past the limit
    assert isinstance(err, CapacityExceeded) and isinstance(err, kc.RejectedError)
    assert err.key == "e" and err.limit == 10 * ROW and err.needed == 12 * ROW
    assert s.state_hash() == before and s.describe("e")["rows"] == 10
    assert "versions" in _push(s, 3, [0, 9])  # existing rows still train
    assert kc.CapacityExceeded is CapacityExceeded


def test_capacity_exceeded_blames_the_growing_push_of_a_merged_entry():
    s = _table(None, memory_limit=3 * ROW)
    s.apply(CreateTable("f", 2, "float64", ADD, ZEROS, "sum"))
    assert "versions" in _push(s, 1, [1, 2])
    cmd = Push(1.0, (PushId("a", 1, 1, ("e",)), PushId("b", 1, 1, ("f",))), (),
               (RowDelta("e", np.array([1], np.int64), np.ones((1, 2)), np.ones(1, np.int64)),
                RowDelta("f", np.array([7, 8], np.int64), np.ones((2, 2)), np.ones(2, np.int64))))
    before = s.state_hash()
    got = s.apply(cmd).result["results"]
    assert isinstance(got[("b", 1)], CapacityExceeded) and isinstance(got[("a", 1)], Unavailable)
    assert s.state_hash() == before


def test_a_capped_table_under_a_limit_never_refuses():
    s = _table({"max_rows": 8, "shards": 2}, memory_limit=4 * CAPPED_ROW)  # 4 rows per shard fit exactly
    for q in range(1, 30):
        assert "versions" in _push(s, q, [3 * q, 3 * q + 1], now=float(q))
    assert s.describe("e")["rows"] == 4 and s.describe("e")["bytes"] == 4 * CAPPED_ROW


def test_snapshot_restore_keeps_counts_times_pending_and_floor():
    life = {"max_rows": 3, "evict": "lfu", "ttl_s": 5.0, "admit": {"name": "count", "min_count": 2}}
    s = _table(life)
    for q, (ids, now) in enumerate([([1, 2, 3], 1.0), ([1, 2, 3, 4], 2.0), ([1, 5], 3.0), ([4, 6, 7], 4.0),
                                    ([4, 6], 4.5)], 1):
        _push(s, q, ids, now=now)
    info = s.describe("e")
    assert info["rows"] == 3 and info["pending"] >= 1 and info["floor"] > 0
    c = ShardState.restore(s.snapshot())
    assert c.snapshot() == s.snapshot() and c.describe("e") == info
    t, u = s._keys["e"], c._keys["e"]
    for name in ("ids", "count", "last", "versions"):
        assert getattr(t, name)[:t.n].tolist() == getattr(u, name)[:u.n].tolist()
    for q, ids in enumerate([[5], [5, 8], [1, 9], [2, 3, 4]], 10):  # both go on identically
        assert repr(_push(s, q, ids, now=float(q))) == repr(_push(c, q, ids, now=float(q)))
        assert s.snapshot() == c.snapshot()


def test_ten_times_max_rows_distinct_ids_keep_the_table_at_its_cap():
    cap = 1000
    s = _table({"max_rows": cap, "shards": 1, "evict": "lru"}, dim=4)
    versions_seen: dict[int, int] = {}
    for q in range(100):  # 10 x cap distinct ids, 100 per push
        ids = np.arange(q * 100, (q + 1) * 100)
        _push(s, q + 1, ids, now=float(q), dim=4)
        assert s.describe("e")["rows"] == min(cap, (q + 1) * 100)
        _, v = s.read_rows("e", np.array([0]))
        versions_seen[q] = int(v[0])
    values, versions = s.read_rows("e", np.array([0, 8999, 9000, 9999]))
    assert values[:2].tolist() == [[0.0] * 4] * 2 and values[2:].tolist() == [[1.0] * 4] * 2  # LRU kept the newest
    vs = list(versions_seen.values())
    assert vs == sorted(vs) and vs[-1] > vs[0]  # the evicted row 0 reads at a version that moved forward
    assert len(s._keys["e"].ids) <= cap + cap // 4  # arrays never grew far past the cap


def test_probability_admission_is_a_pure_function_of_seed_and_id():
    life = {"admit": {"name": "probability", "p": 0.25, "seed": 9}}
    a, b = _table(life), _table(life)
    _push(a, 1, range(400))
    _push(b, 1, range(200))
    _push(b, 2, range(200, 400))  # other batches, same ids admitted
    ids = np.arange(400)
    assert 60 < a.describe("e")["rows"] < 140 and a.describe("e")["rows"] == b.describe("e")["rows"]
    assert np.array_equal(a.read_rows("e", ids)[0], b.read_rows("e", ids)[0])
    assert np.array_equal(a.read_rows("e", ids)[0][:, 0] == 1.0, kc.ProbabilityAdmission(0.25, 9).admitted(ids))


def test_options_are_checked():
    assert lifecycle_from_dict(None) is None
    assert lifecycle_from_dict({"max_rows": 10, "shards": 3}).cap == 4
    for bad in ({"max_rows": 0}, {"evict": "fifo"}, {"ttl_s": -1.0}, {"admit": {"name": "never"}},
                {"admit": {"name": "count", "min_count": 0}}, {"admit": {"name": "probability", "p": 2}},
                {"other": 1}):
        with pytest.raises(InvalidRequest):
            lifecycle_from_dict(bad)
    with pytest.raises(InvalidRequest):
        kc.CountAdmission(0)
    with pytest.raises(InvalidRequest):
        kc.ProbabilityAdmission(1.5, 0)
    old = CreateTable("e", 2, "float64", ADD, ZEROS, "sum")
    assert b"lifecycle" not in old.to_bytes()  # tables without one keep their log bytes
    new = CreateTable("e", 2, "float64", ADD, ZEROS, "sum", {"max_rows": 5})
    assert decode_command(new.to_bytes()) == new


def test_same_definition_again_is_a_noop_and_another_lifecycle_is_key_exists():
    s = _table({"max_rows": 5})
    assert s.apply(CreateTable("e", 2, "float64", ADD, ZEROS, "sum", {"max_rows": 5})).result == {"created": False}
    err = s.apply(CreateTable("e", 2, "float64", ADD, ZEROS, "sum", {"max_rows": 6})).result
    assert type(err).__name__ == "KeyExists"
