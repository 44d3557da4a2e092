"""The shard state machine: create/push/set/delete semantics, exactly-once, errors as values,
snapshots and determinism."""
from __future__ import annotations

import json

import numpy as np
import pytest

from kvps.applied import AppliedTable
from kvps.command import (
    Barrier, CreateKey, CreateKeys, CreateTable, DeleteKey, DenseDelta, Hyperparams, Push, PushId, Set, decode_command,
)
from kvps.errors import (
    CodecError, InvalidRequest, KeyExists, KeyNotFound, PushExpired, ShapeMismatch, Unavailable,
    VersionConflict,
)
from kvps.merge import PushRequest, merge
from kvps.shard import ShardState

ADD = {"name": "add"}
ZEROS = {"name": "zeros"}
NORMAL = {"name": "normal", "std": 0.1, "seed": 3}


def _state(**kw) -> ShardState:
    """Dense 'w' (5, 2) float32 in blocks of 2 (this shard owns 0 and 2) and table 'e' (dim 3)."""
    s = ShardState(0, **kw)
    w = np.arange(10, dtype=np.float32).reshape(5, 2)
    assert s.apply(CreateKey("w", (5, 2), "float32", 2, ADD, "sum", ((0, w[0:2]), (2, w[4:5])))).result == {"created": True}
    assert s.apply(CreateTable("e", 3, "float32", ADD, NORMAL, "sum")).result == {"created": True}
    return s


def _push(client, seq, floor=None, w=None, rows=None, now=1.0):
    """A one-request Push: w = {block: grad}, rows = (ids, grads) for table 'e'."""
    dense = tuple(("w", b, np.asarray(g, np.float32)) for b, g in (w or {}).items())
    row = (("e", np.asarray(rows[0], np.int64), np.asarray(rows[1], np.float32)),) if rows else ()
    return PushRequest(client, seq, seq if floor is None else floor, dense, row)


def _apply_push(s, reqs, now=1.0, modes=None):
    return s.apply(merge(reqs, modes or {}, now=now)).result["results"]


def test_create_same_definition_is_a_noop_and_different_is_key_exists():
    s = _state()
    before = s.state_hash()
    same = CreateKey("w", (5, 2), "float32", 2, ADD, "sum", ((0, np.zeros((2, 2), np.float32)),))
    assert s.apply(same).result == {"created": False}
    assert s.apply(CreateTable("e", 3, "float32", ADD, NORMAL, "sum")).result == {"created": False}
    assert isinstance(s.apply(CreateKey("w", (5, 2), "float32", 2, ADD, "mean", ())).result, KeyExists)
    assert isinstance(s.apply(CreateTable("w", 3, "float32", ADD, NORMAL, "sum")).result, KeyExists)
    assert isinstance(s.apply(CreateTable("e", 4, "float32", ADD, NORMAL, "sum")).result, KeyExists)
    assert s.state_hash() == before


def test_create_keys_is_each_create_key_in_order_and_a_refusal_stops_nothing():
    """A batch ends in the state its creates applied one by one reach (the same hash), answers
    per key, and a key refused (another definition) changes nothing and stops no other key."""
    creates = (CreateKey("a", (3,), "float32", 2, ADD, "sum", ((0, np.ones(2, np.float32)),)),
               CreateKey("e", (5, 2), "float32", 2, ADD, "sum", ()),  # 'e' is a table
               CreateKey("w2", (), "float64", 1, ADD, "sum", ((0, np.array(2.5)),)),
               CreateKey("w", (5, 2), "float32", 2, ADD, "sum", ((1, np.full((2, 2), 7, np.float32)),)))
    batched, one_by_one = _state(), _state()
    out = batched.apply(CreateKeys(creates))
    singles = [one_by_one.apply(c) for c in creates]
    assert [r.get("created") for r in out.result["results"]] == [True, None, True, True]
    assert out.result["results"][1]["error"] == "KeyExists" and isinstance(singles[1].result, KeyExists)
    assert [r.result for i, r in enumerate(singles) if i != 1] == [r for i, r in enumerate(out.result["results"]) if i != 1]
    assert batched.state_hash() == one_by_one.state_hash()
    remembered = lambda effects: [(k, b, v, val.tobytes()) for e in effects for k, b, v, val in e.blocks]  # noqa: E731
    assert remembered(out.effects) == remembered(e for r in singles for e in r.effects) != []  # for deltas
    assert batched.describe("w")["blocks"] == [0, 1, 2] and batched.describe("w2")["shape"] == []
    assert batched.snapshot() == ShardState.restore(batched.snapshot()).snapshot()


def test_create_in_parts_adds_missing_blocks_and_keeps_existing_ones():
    s = _state()
    _apply_push(s, [_push("a", 1, w={0: np.ones((2, 2))})])
    part = CreateKey("w", (5, 2), "float32", 2, ADD, "sum",
                     ((0, np.zeros((2, 2), np.float32)), (1, np.full((2, 2), 5, np.float32))))
    assert s.apply(part).result == {"created": True}
    assert s.describe("w")["blocks"] == [0, 1, 2]
    (v0, b0), (v1, b1) = s.read_blocks("w", [0, 1])
    assert (v0, b0.tolist()) == (1, [[1, 2], [3, 4]])  # kept, not re-initialised
    assert (v1, b1.tolist()) == (0, [[5, 5], [5, 5]])
    before = s.state_hash()
    assert s.apply(part).result == {"created": False} and s.state_hash() == before


def test_push_updates_versions_values_and_reports_max_version():
    s = _state()
    res = _apply_push(s, [_push("a", 1, w={0: [[1, 1], [1, 1]], 2: [[2, 2]]}),
                          _push("b", 5, w={0: [[10, 10], [10, 10]]}, rows=([7, 3], [[1, 1, 1], [2, 2, 2]]))])
    assert res == {("a", 1): {"versions": {"w": 2}}, ("b", 5): {"versions": {"e": 1, "w": 2}}}
    (v0, b0), (v2, b2) = s.read_blocks("w", [0, 2])
    assert (v0, v2) == (2, 1)  # a merged entry of k pushes advances a block by k
    assert b0.tolist() == [[11, 12], [13, 14]] and b2.tolist() == [[10, 11]]
    assert s.block_versions("w", [2, 0]) == [1, 2]
    init = s.read_rows("e", np.array([99], np.int64))[0][0]
    values, versions = s.read_rows("e", np.array([3, 99, 7], np.int64))
    assert versions.tolist() == [1, 0, 1]
    assert values[1].tolist() == init.tolist()  # untouched: the initializer's value
    assert s.describe("e")["rows"] == 2  # reading does not create rows


def test_read_values_are_immutable_snapshots():
    s = _state()
    (_, before), = s.read_blocks("w", [0])
    _apply_push(s, [_push("a", 1, w={0: np.ones((2, 2))})])
    (_, after), = s.read_blocks("w", [0])
    assert before.tolist() == [[0, 1], [2, 3]] and after.tolist() == [[1, 2], [3, 4]]
    assert not before.flags.writeable and not after.flags.writeable


def test_mean_merge_divides_by_count():
    s = ShardState(1)
    s.apply(CreateKey("m", (2,), "float64", 2, ADD, "mean", ((0, np.zeros(2)),))).result
    s.apply(CreateTable("t", 1, "float64", ADD, ZEROS, "mean")).result
    reqs = [PushRequest(c, 1, 1, (("m", 0, np.array([x, 0.0])),), (("t", np.int64([4]), np.array([[x]])),))
            for c, x in (("a", 1.0), ("b", 2.0), ("c", 6.0))]
    s.apply(merge(reqs, {"m": "mean", "t": "mean"}, now=0.0)).result
    assert s.read_blocks("m", [0])[0][0] == 3 and s.read_blocks("m", [0])[0][1].tolist() == [3.0, 0.0]
    values, versions = s.read_rows("t", np.int64([4]))
    assert values.tolist() == [[3.0]] and versions.tolist() == [3]


def test_retried_push_is_answered_with_its_result_and_applied_once():
    s = _state()
    first = _apply_push(s, [_push("a", 1, w={0: np.ones((2, 2))}, rows=([1], [[1, 1, 1]]))])
    after_first = s.state_hash()
    again = _apply_push(s, [_push("a", 1, w={0: np.ones((2, 2))}, rows=([1], [[1, 1, 1]]))], now=2.0)
    assert again == first and s.state_hash() == after_first
    assert s.lookup_push("a", 1) == first[("a", 1)]
    assert s.lookup_push("a", 2) is None and s.lookup_push("z", 1) is None


def test_duplicate_inside_a_merged_entry_applies_nothing():
    s = _state()
    first = _apply_push(s, [_push("a", 1, w={0: np.ones((2, 2))})])
    before = s.state_hash()
    res = _apply_push(s, [_push("a", 1, w={0: np.ones((2, 2))}), _push("b", 1, w={0: np.ones((2, 2))})])
    assert res[("a", 1)] == first[("a", 1)]
    assert isinstance(res[("b", 1)], Unavailable)  # honest: retried later
    assert s.state_hash() == before and s.lookup_push("b", 1) is None
    assert _apply_push(s, [_push("b", 1, w={0: np.ones((2, 2))})])[("b", 1)] == {"versions": {"w": 2}}


def test_floors_drop_results_and_expired_ids_are_not_reapplied():
    s = _state()
    for seq in (1, 2, 3):
        _apply_push(s, [_push("a", seq, floor=1, w={0: np.ones((2, 2))})])
    assert all(s.lookup_push("a", q) is not None for q in (1, 2, 3))
    _apply_push(s, [_push("a", 4, floor=3, w={0: np.ones((2, 2))})])
    assert isinstance(s.lookup_push("a", 2), PushExpired) and s.lookup_push("a", 3) is not None
    before = s.state_hash()
    res = _apply_push(s, [_push("a", 1, w={0: np.ones((2, 2))})])
    assert isinstance(res[("a", 1)], PushExpired) and s.state_hash() == before
    _apply_push(s, [_push("a", 5, floor=2, w={0: np.ones((2, 2))})])  # a floor never goes down
    assert isinstance(s.lookup_push("a", 2), PushExpired)


def test_results_per_client_are_capped():
    s = _state()
    n = 10001
    cmd = Push(1.0, tuple(PushId("a", q, 0, ("w",)) for q in range(n)),
               (DenseDelta("w", 0, np.ones((2, 2), np.float32), n),), ())
    s.apply(cmd).result
    assert isinstance(s.lookup_push("a", 0), PushExpired)
    assert s.lookup_push("a", 1) == {"versions": {"w": n}}
    assert s.read_blocks("w", [0])[0][0] == n


def test_idle_sessions_expire_by_command_time():
    s = _state(session_ttl=100.0)
    _apply_push(s, [_push("old", 1, w={0: np.ones((2, 2))})], now=1000.0)
    _apply_push(s, [_push("new", 1, w={0: np.ones((2, 2))})], now=1050.0)
    assert s.lookup_push("old", 1) is not None
    _apply_push(s, [_push("new", 2, w={0: np.ones((2, 2))})], now=1100.5)
    assert s.lookup_push("old", 1) is None and s.lookup_push("new", 1) is not None


def test_dedup_false_double_applies():
    s = _state(dedup=False)
    req = _push("a", 1, w={0: np.ones((2, 2))})
    _apply_push(s, [req])
    _apply_push(s, [req])
    assert s.read_blocks("w", [0])[0][0] == 2 and s.lookup_push("a", 1) is None


REJECTED = [
    ("unknown key", _push("a", 1, w=None, rows=None), "x-missing", KeyNotFound),
    ("wrong shape", _push("a", 1, w={0: np.ones((2, 3))}), None, ShapeMismatch),
    ("wrong block", _push("a", 1, w={1: np.ones((2, 2))}), None, InvalidRequest),
    ("wrong dim", _push("a", 1, rows=([1], [[1, 1]])), None, ShapeMismatch),
]


@pytest.mark.parametrize("name,req,missing,error", REJECTED, ids=[r[0] for r in REJECTED])
def test_bad_pushes_are_values_and_change_nothing(name, req, missing, error):
    s = _state()
    if missing:
        req = PushRequest("a", 1, 1, ((missing, 0, np.ones(1, np.float32)),))
    assert isinstance(s.check_push(req), error)
    before = s.state_hash()
    res = _apply_push(s, [req])
    assert isinstance(res[("a", 1)], error) and s.state_hash() == before
    assert s.lookup_push("a", 1) is None  # a rejection is not recorded: nothing was applied


def test_bad_key_in_a_merged_entry_blames_only_its_pushes():
    s = _state()
    before = s.state_hash()
    good = _push("good", 1, w={0: np.ones((2, 2))})
    bad = PushRequest("bad", 1, 1, (("w", 0, np.ones((2, 2), np.float32)), ("gone", 0, np.ones(1, np.float32))))
    res = _apply_push(s, [good, bad])
    assert isinstance(res[("bad", 1)], KeyNotFound) and isinstance(res[("good", 1)], Unavailable)
    assert s.state_hash() == before


def test_check_push_rejections():
    s = _state()
    ok = _push("a", 1, w={0: np.ones((2, 2))}, rows=([4], [[1, 2, 3]]))
    assert s.check_push(ok) is None
    nan = _push("a", 1, w={0: [[np.nan, 0], [0, 0]]})
    assert isinstance(s.check_push(nan), InvalidRequest)
    assert s.check_push(nan, nonfinite="skip") is None
    assert isinstance(s.check_push(_push("a", 1, rows=([4], [[np.inf, 0, 0]]))), InvalidRequest)
    for bad in [
        PushRequest("a", 1, 1),  # empty
        PushRequest("a", 1, 2, (("w", 0, np.ones((2, 2), np.float32)),)),  # floor above seq
        PushRequest("", 1, 1, (("w", 0, np.ones((2, 2), np.float32)),)),
        PushRequest("a", 1, 1, (("w", 0, np.ones((2, 2), np.float64)),)),  # dtype
        PushRequest("a", 1, 1, (("w", 0, np.ones((2, 2), np.float32)),) * 2),  # block twice
        PushRequest("a", 1, 1, (("e", 0, np.ones((2, 2), np.float32)),)),  # a table as dense
        PushRequest("a", 1, 1, rows=(("w", np.int64([1]), np.ones((1, 2), np.float32)),)),
        PushRequest("a", 1, 1, rows=(("e", np.int32([1]), np.ones((1, 3), np.float32)),)),
        PushRequest("a", 1, 1, rows=(("e", np.int64([[1]]), np.ones((1, 3), np.float32)),)),
        PushRequest("a", 1, 1, rows=(("e", np.int64([1, 2]), np.ones((1, 3), np.float32)),)),
    ]:
        assert isinstance(s.check_push(bad), (InvalidRequest, ShapeMismatch, KeyNotFound)), bad


def test_set_compare_and_set():
    s = _state()
    two = np.full((2, 2), 7, np.float32)
    res = s.apply(Set(1.0, "c", 1, 1, "w", ((0, two),), expected_version=0)).result
    assert res == {"versions": {"w": 1}} and s.read_blocks("w", [0])[0][1].tolist() == two.tolist()
    assert s.apply(Set(2.0, "c", 1, 1, "w", ((0, two),), expected_version=0)).result == res  # retried: same answer
    before = s.state_hash()
    conflict = s.apply(Set(2.0, "c", 2, 2, "w", ((0, two),), expected_version=0)).result
    assert isinstance(conflict, VersionConflict) and (conflict.expected, conflict.actual) == (0, 1)
    assert isinstance(s.apply(Set(2.0, "c", 3, 3, "nope", ((0, two),), None)).result, KeyNotFound)
    assert isinstance(s.apply(Set(2.0, "c", 4, 4, "w", ((0, np.ones((1, 2), np.float32)),), None)).result, ShapeMismatch)
    assert isinstance(s.apply(Set(2.0, "c", 5, 5, "e", ((0, two),), None)).result, InvalidRequest)
    assert isinstance(s.apply(Set(2.0, "c", 6, 6, "w", ((1, two),), None)).result, InvalidRequest)
    assert isinstance(s.apply(Set(2.0, "c", 7, 7, "w", (), None)).result, InvalidRequest)
    assert s.state_hash() == before
    assert s.apply(Set(3.0, "c", 8, 8, "w", ((0, two), (2, np.ones((1, 2), np.float32))), None)).result == \
        {"versions": {"w": 2}}
    assert s.block_versions("w", [0, 2]) == [2, 1]
    nan = Set(3.0, "c", 9, 9, "w", ((0, np.full((2, 2), np.nan, np.float32)),), None)
    assert isinstance(s.check_set(nan), InvalidRequest) and s.check_set(nan, nonfinite="skip") is None


def test_set_keeps_optimizer_state():
    s = ShardState(0)
    s.apply(CreateKey("w", (1,), "float64", 1, {"name": "sgd", "lr": 1.0, "momentum": 0.5}, "sum",
                      ((0, np.zeros(1)),))).result
    _ = s.apply(merge([PushRequest("a", 1, 1, (("w", 0, np.ones(1)),))], {}, now=0.0)).result  # buf = 1
    s.apply(Set(0.0, "a", 2, 2, "w", ((0, np.zeros(1)),), None)).result
    s.apply(merge([PushRequest("a", 3, 3, (("w", 0, np.ones(1)),))], {}, now=0.0)).result  # buf = 1.5
    assert s.read_blocks("w", [0])[0][1].tolist() == [-1.5]


def test_delete_then_push_and_recreate():
    s = _state()
    _apply_push(s, [_push("a", 1, w={0: np.ones((2, 2))})])
    assert s.apply(DeleteKey("w")).result == {"deleted": True} and s.apply(DeleteKey("w")).result == {"deleted": False}
    assert s.describe("w") is None
    assert isinstance(_apply_push(s, [_push("a", 2, w={0: np.ones((2, 2))})])[("a", 2)], KeyNotFound)
    s.apply(CreateKey("w", (5, 2), "float32", 2, ADD, "sum", ((0, np.zeros((2, 2), np.float32)),))).result
    assert s.read_blocks("w", [0])[0][0] == 0


def test_reads_raise_typed_errors():
    s = _state()
    with pytest.raises(KeyNotFound):
        s.read_blocks("nope", [0])
    with pytest.raises(InvalidRequest):
        s.read_blocks("w", [1])
    with pytest.raises(InvalidRequest):
        s.read_rows("w", np.int64([1]))
    with pytest.raises(InvalidRequest):
        s.read_rows("e", np.float32([1]))
    with pytest.raises(KeyNotFound):
        s.merge_mode("nope")
    assert s.merge_mode("w") == "sum"


def test_describe_and_keys():
    s = _state()
    assert s.describe("w") == {"key": "w", "kind": "dense", "dtype": "float32", "shape": [5, 2], "block_rows": 2,
                               "blocks": [0, 2], "merge": "sum", "optimizer": ADD, "version": 0}
    assert s.describe("e") == {"key": "e", "kind": "table", "dtype": "float32", "dim": 3, "rows": 0, "bytes": 0,
                               "merge": "sum", "optimizer": ADD, "version": 0,
                               "init": {"name": "normal", "mean": 0.0, "std": 0.1, "seed": 3}}
    assert [k["key"] for k in s.keys()] == ["e", "w"] and s.describe("x") is None


def test_apply_never_raises():
    s = _state()
    before = s.state_hash()
    assert isinstance(s.apply("not a command").result, InvalidRequest)
    assert s.apply(Barrier(7, "r")).result == {"barrier": 7}
    # An optimizer blowing up mid-apply (here: a grad array that cannot broadcast, smuggled past
    # validation) must come back as a value and leave no trace.
    bad = Push(1.0, (PushId("a", 1, 1, ("w",)),), (DenseDelta("w", 0, np.ones((2, 2), np.float32), 1),), ())
    object.__setattr__(bad.dense[0], "grad", np.ones((3, 3), np.float32))
    s._keys["w"].check_block = lambda b, a: None  # disable validation to reach the optimizer
    assert isinstance(s.apply(bad).result, InvalidRequest)
    assert s.state_hash() == before


def test_zero_d_and_empty_keys():
    s = ShardState(0)
    s.apply(CreateKey("s", (), "float32", 1, {"name": "sgd", "lr": 0.5}, "sum", ((0, np.float32(2.0)),))).result
    s.apply(CreateKey("z", (0, 3), "float32", 4, ADD, "sum", ((0, np.zeros((0, 3), np.float32)),))).result
    req = PushRequest("a", 1, 1, (("s", 0, np.array(1.0, np.float32)), ("z", 0, np.zeros((0, 3), np.float32))))
    assert s.check_push(req) is None
    assert s.apply(merge([req], {}, now=0.0)).result["results"][("a", 1)] == {"versions": {"s": 1, "z": 1}}
    (version, value), = s.read_blocks("s", [0])
    assert value.shape == () and float(value) == 1.5
    assert ShardState.restore(s.snapshot()).snapshot() == s.snapshot()


def test_table_grows_and_keeps_rows():
    s = ShardState(0)
    s.apply(CreateTable("e", 2, "float64", ADD, ZEROS, "sum")).result
    rng = np.random.default_rng(0)
    want = np.zeros((300, 2))
    for seq in range(1, 30):
        ids = np.unique(rng.integers(0, 300, 40))
        g = rng.integers(-5, 5, (len(ids), 2)).astype(np.float64)
        want[ids] += g
        s.apply(merge([PushRequest("a", seq, seq, rows=(("e", ids, g),))], {}, now=0.0)).result
    values, _ = s.read_rows("e", np.arange(300, dtype=np.int64))
    assert values.tolist() == want.tolist()


def test_snapshot_round_trip_and_junk():
    s = _state()
    _apply_push(s, [_push("a", 1, w={0: np.ones((2, 2))}, rows=([9, -4], np.ones((2, 3))))])
    s.apply(Set(5.0, "b", 3, 1, "w", ((2, np.zeros((1, 2), np.float32)),), None)).result
    data = s.snapshot()
    t = ShardState.restore(data)
    assert t.snapshot() == data and t.state_hash() == s.state_hash()
    assert t.lookup_push("a", 1) == s.lookup_push("a", 1) and t.lookup_push("b", 3) == {"versions": {"w": 1}}
    assert t.read_rows("e", np.int64([9, -4, 0]))[1].tolist() == [1, 1, 0]
    assert ShardState.restore(data, dedup=False).dedup is False
    for junk in (b"", b"junk", data[:-3], data[:40] + bytes([data[40] ^ 1]) + data[41:],
                 decode_command_bytes()):
        with pytest.raises(CodecError):
            ShardState.restore(junk)


def decode_command_bytes():
    return DeleteKey("w").to_bytes()  # a valid frame of the wrong kind


# ---- determinism: same log => same bytes ----------------------------------------------------------

# lifecycles for e0..e3 in the eviction variant: caps with LRU and LFU, a time-to-live, admissions
LIFECYCLES = ({"max_rows": 9, "shards": 2, "evict": "lru", "ttl_s": 40.0},
              {"max_rows": 6, "evict": "lfu", "admit": {"name": "count", "min_count": 2}},
              {"ttl_s": 15.0, "admit": {"name": "probability", "p": 0.6, "seed": 5}},
              {"max_rows": 8, "evict": "lru"})


def _random_log(seed: int, n: int = 300, lifecycles: tuple = (None,) * 4) -> list[bytes]:
    rng = np.random.default_rng(seed)
    opts = [{"name": "sgd", "lr": 0.1, "momentum": 0.9, "nesterov": True}, {"name": "adam", "lr": 0.01},
            {"name": "adagrad", "lr_decay": 0.01}, ADD]
    log = []
    for i, opt in enumerate(opts):
        value = rng.standard_normal((7, 3)).astype(np.float32)
        log.append(CreateKey(f"w{i}", (7, 3), "float32", 3, opt, "sum" if i % 2 else "mean",
                             ((0, value[0:3]), (2, value[6:7]))).to_bytes())
        log.append(CreateTable(f"e{i}", 4, "float32", opt, {"name": "normal", "seed": i}, "mean",
                               lifecycles[i]).to_bytes())
    seqs = {c: 0 for c in "abcd"}
    for _ in range(n):
        roll = rng.random()
        if roll < 0.85:
            reqs = []
            for c in rng.choice(list("abcd"), size=int(rng.integers(1, 4)), replace=False):
                retry = seqs[c] > 0 and rng.random() < 0.15
                seqs[c] += 0 if retry else 1
                k = int(rng.integers(0, 4))
                ids = rng.integers(-20, 20, int(rng.integers(1, 6))).astype(np.int64)
                reqs.append(PushRequest(str(c), seqs[c], max(1, seqs[c] - 3),
                                        ((f"w{k}", 0, rng.standard_normal((3, 3)).astype(np.float32)),),
                                        ((f"e{k}", ids, rng.standard_normal((len(ids), 4)).astype(np.float32)),)))
            log.append(merge(reqs, {}, now=float(len(log))).to_bytes())
        elif roll < 0.95:
            seqs["d"] += 1
            log.append(Set(float(len(log)), "d", seqs["d"], seqs["d"], f"w{int(rng.integers(0, 4))}",
                           ((2, rng.standard_normal((1, 3)).astype(np.float32)),),
                           None if rng.random() < 0.5 else int(rng.integers(0, 30))).to_bytes())
        elif roll < 0.97:
            log.append(Barrier(int(rng.integers(0, 5)), "r").to_bytes())
        else:  # a schedule step, on a dense key or a table (on Add's keys: an error value)
            k = int(rng.integers(0, 4))
            log.append(Hyperparams(f"{'we'[int(rng.integers(0, 2))]}{k}", int(rng.integers(0, 40)),
                                   {"lr": float(rng.uniform(0.001, 0.1))}).to_bytes())
    return log


@pytest.mark.parametrize("evicting", [False, True], ids=["rows-kept", "rows-evicted"])
def test_same_log_gives_identical_snapshots_also_after_restore(evicting):
    log = _random_log(seed=42, lifecycles=LIFECYCLES if evicting else (None,) * 4)
    a, b = ShardState(3), ShardState(3)
    half = len(log) // 2
    for data in log[:half]:
        a.apply(decode_command(data)).result
        b.apply(decode_command(data)).result
    assert a.snapshot() == b.snapshot()
    c = ShardState.restore(a.snapshot())
    for data in log[half:]:
        ra, rc = a.apply(decode_command(data)).result, c.apply(decode_command(data)).result
        b.apply(decode_command(data)).result
        assert repr(ra) == repr(rc)
    assert a.snapshot() == b.snapshot() == c.snapshot()
    assert a.state_hash() == c.state_hash()
    assert a.describe("e1" if evicting else "e0")["rows"] > 5 and a.describe("w0")["version"] > 50  # real work
    if evicting:  # rows were evicted (floors moved), some ids still wait for admission
        assert all(a.describe(f"e{i}")["floor"] > 0 for i in range(4)) and a.describe("e1")["pending"] > 0
    assert any("hyperparams" in a.describe(k) for k in ("w0", "w1", "w2", "e0", "e1", "e2"))


def test_applied_table_trims_caps_expires_and_round_trips():
    t = AppliedTable(ttl=10.0, cap=3)
    t.record([("a", q, 0, {"versions": {"w": q}}) for q in range(1, 6)], now=0.0)
    assert sorted(t.sessions["a"].results) == [3, 4, 5] and t.sessions["a"].floor == 3  # capped
    t.record([("a", 6, 5, {"versions": {}}), ("b", 1, 1, VersionConflict("x", 1, 2))], now=1.0)
    assert sorted(t.sessions["a"].results) == [5, 6]  # below the floor: forgotten, not kept
    assert isinstance(t.lookup("a", 4), PushExpired) and t.lookup("a", 5) == {"versions": {"w": 5}}
    t.lookup("a", 5)["versions"]["w"] = 99  # callers get copies
    assert t.lookup("a", 5) == {"versions": {"w": 5}}
    copy = AppliedTable(ttl=10.0)
    copy.load_json(json.loads(json.dumps(t.to_json())))
    assert copy.to_json() == t.to_json() and isinstance(copy.lookup("b", 1), VersionConflict)
    t.record([("c", 1, 1, {"versions": {}})], now=11.5)  # a and b were last seen at 1.0
    assert sorted(t.sessions) == ["c"]



# ---- pinned snapshot format: snapshots on disk must keep restoring -----------------------------

GOLDEN_SNAPSHOT = bytes.fromhex(
    "4b56504601040000ac0100000700000053bc72157b226465647570223a747275652c22666f726d6174223a312c226b65"
    "7973223a5b7b2264696d223a322c226474797065223a22666c6f61743332222c22696e6974223a7b226d65616e223a30"
    "2e302c226e616d65223a226e6f726d616c222c2273656564223a352c22737464223a312e307d2c226b6579223a226522"
    "2c226b696e64223a227461626c65222c226d65726765223a2273756d222c226f7074696d697a6572223a7b226e616d65"
    "223a22616464227d7d2c7b22626c6f636b5f726f7773223a322c22626c6f636b73223a5b5b312c312c315d5d2c226474"
    "797065223a22666c6f61743332222c226b6579223a2277222c226b696e64223a2264656e7365222c226d65726765223a"
    "2273756d222c226f7074696d697a6572223a7b2264616d70656e696e67223a302e302c226c72223a302e352c226d6f6d"
    "656e74756d223a302e392c226e616d65223a22736764222c226e65737465726f76223a66616c73652c22776569676874"
    "5f6465636179223a302e307d2c227368617065223a5b335d7d5d2c2273657373696f6e5f74746c223a333630302e302c"
    "227368617264223a327d2020202020200600010044dd9a64100000000000000010000000000000000200000000000000"
    "0100020052a34fdb1000000000000000100000000000000002000000000000000200000000000000060001005ada798e"
    "100000000000000010000000000000000200000000000000060001005ada798e10000000000000001000000000000000"
    "0200000000000000010001001cdf4421040000000000000004000000000000000100000000000000010001008c9e9857"
    "04000000000000000400000000000000010000000000000007000100eaa79cec30000000000000003000000000000000"
    "3000000000000000ffffffffffffffff09000000000000004c6a863f8c28a73f38e1903da677e23e0100000000000000"
    "01000000000000000100000000000000010000000000000000000000000000405b5b2263222c312c3130302e302c5b5b"
    "312c7b2276657273696f6e73223a7b2265223a312c2277223a317d7d5d5d5d5d"
)

GOLDEN_SNAPSHOT_XXH3 = bytes.fromhex(
    "4b56504601040100ac0100000700000082897f5b7b226465647570223a747275652c22666f726d6174223a312c226b65"
    "7973223a5b7b2264696d223a322c226474797065223a22666c6f61743332222c22696e6974223a7b226d65616e223a30"
    "2e302c226e616d65223a226e6f726d616c222c2273656564223a352c22737464223a312e307d2c226b6579223a226522"
    "2c226b696e64223a227461626c65222c226d65726765223a2273756d222c226f7074696d697a6572223a7b226e616d65"
    "223a22616464227d7d2c7b22626c6f636b5f726f7773223a322c22626c6f636b73223a5b5b312c312c315d5d2c226474"
    "797065223a22666c6f61743332222c226b6579223a2277222c226b696e64223a2264656e7365222c226d65726765223a"
    "2273756d222c226f7074696d697a6572223a7b2264616d70656e696e67223a302e302c226c72223a302e352c226d6f6d"
    "656e74756d223a302e392c226e616d65223a22736764222c226e65737465726f76223a66616c73652c22776569676874"
    "5f6465636179223a302e307d2c227368617065223a5b335d7d5d2c2273657373696f6e5f74746c223a333630302e302c"
    "227368617264223a327d20202020202006000100478ab68c100000000000000010000000000000000200000000000000"
    "01000200b92a1761100000000000000010000000000000000200000000000000020000000000000006000100a62858e1"
    "10000000000000001000000000000000020000000000000006000100a62858e110000000000000001000000000000000"
    "0200000000000000010001003d19fc16040000000000000004000000000000000100000000000000010001009aa1ca66"
    "0400000000000000040000000000000001000000000000000700010032f5b22f30000000000000003000000000000000"
    "3000000000000000ffffffffffffffff09000000000000004c6a863f8c28a73f38e1903da677e23e0100000000000000"
    "01000000000000000100000000000000010000000000000000000000000000405b5b2263222c312c3130302e302c5b5b"
    "312c7b2276657273696f6e73223a7b2265223a312c2277223a317d7d5d5d5d5d"
)

GOLDEN_SNAPSHOT_TIME = bytes.fromhex(
    "4b56504601040100b401000007000000a2b539a37b226465647570223a747275652c22666f726d6174223a312c226b65"
    "7973223a5b7b2264696d223a322c226474797065223a22666c6f61743332222c22696e6974223a7b226d65616e223a30"
    "2e302c226e616d65223a226e6f726d616c222c2273656564223a352c22737464223a312e307d2c226b6579223a226522"
    "2c226b696e64223a227461626c65222c226d65726765223a2273756d222c226f7074696d697a6572223a7b226e616d65"
    "223a22616464227d7d2c7b22626c6f636b5f726f7773223a322c22626c6f636b73223a5b5b312c312c315d5d2c226474"
    "797065223a22666c6f61743332222c226b6579223a2277222c226b696e64223a2264656e7365222c226d65726765223a"
    "2273756d222c226f7074696d697a6572223a7b2264616d70656e696e67223a302e302c226c72223a302e352c226d6f6d"
    "656e74756d223a302e392c226e616d65223a22736764222c226e65737465726f76223a66616c73652c22776569676874"
    "5f6465636179223a302e307d2c227368617065223a5b335d7d5d2c2273657373696f6e5f74746c223a333630302e302c"
    "227368617264223a322c2274696d65223a3130302e307d2006000100478ab68c10000000000000001000000000000000"
    "020000000000000001000200b92a17611000000000000000100000000000000002000000000000000200000000000000"
    "06000100a62858e110000000000000001000000000000000020000000000000006000100a62858e11000000000000000"
    "10000000000000000200000000000000010001003d19fc16040000000000000004000000000000000100000000000000"
    "010001009aa1ca660400000000000000040000000000000001000000000000000700010032f5b22f3000000000000000"
    "30000000000000003000000000000000ffffffffffffffff09000000000000004c6a863f8c28a73f38e1903da677e23e"
    "010000000000000001000000000000000100000000000000010000000000000000000000000000405b5b2263222c312c"
    "3130302e302c5b5b312c7b2276657273696f6e73223a7b2265223a312c2277223a317d7d5d5d5d5d"
)

# the same state with table layout 2 (kvps.table): an Add table keeps no step counts
GOLDEN_SNAPSHOT_LAYOUT2 = bytes.fromhex(
    "4b56504601040100c4010000060000008bbe58737b226465647570223a747275652c22666f726d6174223a312c226b65"
    "7973223a5b7b2264696d223a322c226474797065223a22666c6f61743332222c22696e6974223a7b226d65616e223a30"
    "2e302c226e616d65223a226e6f726d616c222c2273656564223a352c22737464223a312e307d2c226b6579223a226522"
    "2c226b696e64223a227461626c65222c226c61796f7574223a322c226d65726765223a2273756d222c226f7074696d69"
    "7a6572223a7b226e616d65223a22616464227d7d2c7b22626c6f636b5f726f7773223a322c22626c6f636b73223a5b5b"
    "312c312c315d5d2c226474797065223a22666c6f61743332222c226b6579223a2277222c226b696e64223a2264656e73"
    "65222c226d65726765223a2273756d222c226f7074696d697a6572223a7b2264616d70656e696e67223a302e302c226c"
    "72223a302e352c226d6f6d656e74756d223a302e392c226e616d65223a22736764222c226e65737465726f76223a6661"
    "6c73652c227765696768745f6465636179223a302e307d2c227368617065223a5b335d7d5d2c2273657373696f6e5f74"
    "746c223a333630302e302c227368617264223a322c2274696d65223a3130302e307d20202020202006000100478ab68c"
    "10000000000000001000000000000000020000000000000001000200b92a176110000000000000001000000000000000"
    "0200000000000000020000000000000006000100a62858e1100000000000000010000000000000000200000000000000"
    "010001003d19fc16040000000000000004000000000000000100000000000000010001009aa1ca660400000000000000"
    "040000000000000001000000000000000700010032f5b22f300000000000000030000000000000003000000000000000"
    "ffffffffffffffff09000000000000004c6a863f8c28a73f38e1903da677e23e01000000000000000100000000000000"
    "00000000000000405b5b2263222c312c3130302e302c5b5b312c7b2276657273696f6e73223a7b2265223a312c227722"
    "3a317d7d5d5d5d5d"
)


def _golden_state() -> ShardState:
    s = ShardState(2)
    s.apply(CreateKey("w", (3,), "float32", 2, {"name": "sgd", "lr": 0.5, "momentum": 0.9}, "sum",
                      ((1, np.float32([1.0])),))).result
    s.apply(CreateTable("e", 2, "float32", ADD, {"name": "normal", "seed": 5}, "sum")).result
    s.apply(merge([PushRequest("c", 1, 1, (("w", 1, np.float32([2.0])),),
                               (("e", np.int64([9, -1]), np.float32([[1, 1], [2, 2]])),))], {}, now=100.0)).result
    return s


def test_golden_snapshot():
    """Snapshots written before FLAG_XXH3 (CRC-32 sums), before the cluster time and before table
    layout 2 restore to the same state; what we write now is pinned byte for byte."""
    assert _golden_state().snapshot() == GOLDEN_SNAPSHOT_LAYOUT2
    for golden in (GOLDEN_SNAPSHOT_LAYOUT2, GOLDEN_SNAPSHOT_TIME):
        restored = ShardState.restore(golden)
        assert restored.time == 100.0 and restored.snapshot() == GOLDEN_SNAPSHOT_LAYOUT2
    for golden in (GOLDEN_SNAPSHOT, GOLDEN_SNAPSHOT_XXH3):
        s = ShardState.restore(golden)
        assert s.shard == 2 and s.read_blocks("w", [1])[0][0] == 1
        assert s.read_blocks("w", [1])[0][1].tolist() == [0.0]  # 1 - 0.5 * 2
        assert s.read_rows("e", np.int64([-1, 9]))[1].tolist() == [1, 1]
        assert s.lookup_push("c", 1) == {"versions": {"e": 1, "w": 1}}
        assert s.state_hash() == "c058ceda9865cda22ea2e707dc968fdbc7fd99302c5bb92ca022719589ba2794"


@pytest.mark.parametrize("optimizer", [ADD, {"name": "sgd", "lr": 0.1}, {"name": "sgd", "lr": 0.1, "momentum": 0.9},
                                       {"name": "adagrad", "lr": 0.1}, {"name": "adam", "lr": 0.1}])
def test_updates_write_into_unreferenced_block_values_and_never_into_one_being_read(optimizer):
    """A replaced block value is reused for a later update only once nothing refers to it: a
    reader's array never changes under it, and the bits are those of a shard that never reuses."""
    rng = np.random.default_rng(7)
    shape = (2 * 128, 128)  # two blocks of 64 KiB (float32): the smallest values worth reusing
    recycling, fresh = ShardState(0), ShardState(0)
    fresh._slots = None  # never reuses
    for s in (recycling, fresh):
        value = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
        blocks = ((0, value[:128]), (1, value[128:]))
        assert s.apply(CreateKey("v", shape, "float32", 128, optimizer, "sum", blocks)).result == {"created": True}

    def push(seq):
        grads = [rng.standard_normal((128, 128)).astype(np.float32) for _ in range(2)]
        for s in (recycling, fresh):
            _apply_push(s, [PushRequest("a", seq, seq, (("v", 0, grads[0]), ("v", 1, grads[1])), ())])

    (_, held), = recycling.read_blocks("v", [0])
    kept, view = held.copy(), memoryview(held)  # a reader: an array and a buffer export of it
    for seq in range(1, 6):
        push(seq)
        (_, now), = recycling.read_blocks("v", [0])
        assert now is not held and np.shares_memory(now, held) is False
        assert np.array_equal(held, kept) and bytes(view) == kept.tobytes()
    del held, view, now
    for seq in range(6, 12):
        push(seq)
    assert recycling.state_hash() == fresh.state_hash()
    for b in (0, 1):
        (_, x), = recycling.read_blocks("v", [b])
        (_, y), = fresh.read_blocks("v", [b])
        assert x.tobytes() == y.tobytes() and not x.flags.writeable
    reuses = optimizer["name"] in ("add", "sgd", "adagrad")
    assert (recycling._slots.reused > 0) == reuses
    assert recycling._slots.kept <= recycling._slots.max_bytes
