"""The per-row record of a table (kvps.record): only the columns its definition reads, ids and
versions in uint32 while they fit and int64 from the push that needs it (never wrapped), the
accounted bytes equal to what the columns hold, and replay and restore agreeing on all of it."""
from __future__ import annotations

import numpy as np
import pytest

from kvps.command import CreateTable, Push, PushId, RowDelta
from kvps.errors import CapacityExceeded, CodecError
from kvps.delta import frame
from kvps.optimizer import FTRL, SGD, Adagrad, Adam, Add, RowWiseAdagrad, clipped, optimizer_to_dict
from kvps.record import INDEX_BYTES, U32_MAX
from kvps.rows import MIN_LOAD, WINDOW, RowIndex
from kvps.shard import ShardState

ZEROS = {"name": "zeros"}
DIM = 4


def _state(opt: dict, life: dict | None = None, memory_limit: int | None = None) -> ShardState:
    s = ShardState(0, memory_limit=memory_limit)
    assert s.apply(CreateTable("e", DIM, "float32", opt, ZEROS, "sum", life)).result == {"created": True}
    return s


def _push(s: ShardState, seq: int, ids, counts=None, now: float = 1.0):
    ids = np.asarray(ids, np.int64)
    counts = np.ones(len(ids), np.int64) if counts is None else np.asarray(counts, np.int64)
    cmd = Push(now, (PushId("c", seq, seq, ("e",)),), (),
               (RowDelta("e", ids, np.ones((len(ids), DIM), np.float32), counts),))
    return s.apply(cmd).result["results"][("c", seq)]


def _record_columns(t) -> list[np.ndarray]:
    return [c for c in (t.ids, t.versions, t.steps, t.last, t.count) if c is not None]


def _agrees_with_a_restore(s: ShardState) -> None:
    """A restore holds the same columns in the same widths and writes the same bytes."""
    c = ShardState.restore(s.snapshot())
    t, u = s._keys["e"], c._keys["e"]
    assert c.snapshot() == s.snapshot() and u.row_bytes == t.row_bytes
    assert [a.dtype for a in _record_columns(t)] == [a.dtype for a in _record_columns(u)]


# ---- which columns ---------------------------------------------------------------------------

CAP_LRU, CAP_LFU, TTL = {"max_rows": 50, "evict": "lru"}, {"max_rows": 50, "evict": "lfu"}, {"ttl_s": 9.0}
COLUMNS = [  # optimizer, lifecycle -> (steps, last, count), record + index bytes with ids in [0, 2**32)
    (Add(), None, (False, False, False), 4 + 4 + INDEX_BYTES),
    (SGD(lr=0.1), None, (False, False, False), 16),
    (RowWiseAdagrad(), None, (False, False, False), 16),
    (FTRL(), {"admit": {"name": "probability", "p": 0.5}}, (False, False, False), 16),
    (SGD(lr=0.1, momentum=0.9), None, (True, False, False), 20),
    (Adagrad(), None, (True, False, False), 20),
    (Adam(), None, (True, False, False), 20),
    (Add(), CAP_LRU, (False, True, False), 24),
    (Add(), TTL, (False, True, False), 24),
    (Add(), {"evict": "lfu"}, (False, False, False), 16),  # no cap: nothing is ever evicted
    (Adam(), CAP_LFU, (True, True, True), 36),
]


@pytest.mark.parametrize("opt, life, kept, record", COLUMNS)
def test_a_table_keeps_the_columns_its_definition_reads_and_accounts_for_them(opt, life, kept, record):
    s = _state(optimizer_to_dict(opt), life)
    assert _push(s, 1, range(20))["versions"]
    t = s._keys["e"]
    assert (t.steps is not None, t.last is not None, t.count is not None) == kept
    held = sum(c.itemsize for c in _record_columns(t))  # what the columns hold per row
    payload = 4 * (DIM + sum(int(np.prod(a.shape[1:])) for a in t.state.values()))  # values, state
    assert held + INDEX_BYTES == record and t.row_bytes == payload + record
    assert s.describe("e")["bytes"] == t.n * t.row_bytes and t.n > 0
    _agrees_with_a_restore(s)


@pytest.mark.parametrize("opt", [Add(), SGD(lr=0.1, weight_decay=0.1), RowWiseAdagrad(lr=0.1), FTRL(l1=0.01),
                                 clipped(SGD(lr=0.5), 1.0)])
def test_optimizers_that_keep_no_steps_compute_the_same_bits_at_any_step(opt):
    """What makes dropping a table's step counts sound: ``step`` is not read."""
    assert not opt.uses_step()
    rng = np.random.default_rng(5)
    value, grad = rng.standard_normal((4, 6)).astype(np.float32), rng.standard_normal((4, 6)).astype(np.float32)
    state = opt.init_state(value)
    ones, ones_state = opt.step(value, grad, state, np.ones(4, np.int64))
    other, other_state = opt.step(value, grad, state, np.array([1, 2, 70, 2**40], np.int64))
    assert ones.tobytes() == other.tobytes()
    assert all(ones_state[k].tobytes() == other_state[k].tobytes() for k in ones_state)


def test_a_schedule_cannot_make_an_optimizer_read_steps_it_was_created_without():
    from kvps.errors import InvalidRequest
    from kvps.hyper import retuned
    with pytest.raises(InvalidRequest):
        retuned({"name": "sgd", "lr": 0.1}, {}, {"momentum": 0.9})
    assert retuned({"name": "adagrad", "lr": 0.1}, {}, {"lr_decay": 0.5})[1].uses_step()


# ---- widths ----------------------------------------------------------------------------------

def test_versions_widen_past_2_32_and_never_wrap():
    s = _state(optimizer_to_dict(Adam()))
    _push(s, 1, [1, 2])
    t = s._keys["e"]
    narrow = t.row_bytes
    assert t.versions.dtype == np.uint32 and t.steps.dtype == np.uint32
    got = _push(s, 2, [1], counts=[U32_MAX])  # row 1: 1 + (2**32 - 1) = 2**32
    assert got["versions"] == {"e": 2**32}
    assert t.versions.dtype == np.int64 and t.steps.dtype == np.int64
    assert s.read_rows("e", np.int64([1, 2, 3]))[1].tolist() == [2**32, 1, 0]
    assert s.changed_rows("e", np.int64([1, 2, 3]), np.full(3, -1))[0].tolist() == [2**32, 1, 0]
    assert t.row_bytes == narrow + 8  # version and step: 4 bytes more each
    _push(s, 3, [2])
    assert s.read_rows("e", np.int64([2]))[1].tolist() == [2]
    _agrees_with_a_restore(s)


def test_a_restore_floor_past_2_32_widens_the_versions():
    s = _state(optimizer_to_dict(Add()))
    _push(s, 1, [5, 6])
    t = s._keys["e"]
    t.bump_versions(2**33)
    assert t.versions.dtype == np.int64 and s.read_rows("e", np.int64([5, 7]))[1].tolist() == [2**33 + 1, 0]
    _agrees_with_a_restore(s)


def test_ids_outside_uint32_widen_the_id_column_and_it_narrows_when_they_are_evicted():
    s = _state(optimizer_to_dict(Add()), {"max_rows": 3, "evict": "lru"})
    t = s._keys["e"]
    _push(s, 1, [1, 2, 3], now=1.0)
    assert t.ids.dtype == np.uint32 and t.far == 0
    for seq, far in ((2, 2**40), (3, -7)):  # each evicts the least recently pushed row
        _push(s, seq, [far], now=float(seq))
        assert t.ids.dtype == np.int64 and s.read_rows("e", np.int64([far]))[0][:, 0].tolist() == [1.0]
        _agrees_with_a_restore(s)
    assert t.far == 2 and sorted(s.stored_rows("e")[0].tolist()) == [-7, 3, 2**40]
    _push(s, 4, [10, 11], now=4.0)  # evicts 3 and 2**40
    assert t.far == 1 and t.ids.dtype == np.int64
    _push(s, 5, [12], now=5.0)  # evicts -7: every id fits again
    assert t.far == 0 and t.ids.dtype == np.uint32
    assert s.stored_rows("e")[0].tolist() == [10, 11, 12] and s.stored_rows("e")[0].dtype == np.int64
    assert s.read_rows("e", np.int64([-7, 2**40, 10, 2**32 + 10]))[0][:, 0].tolist() == [0, 0, 1, 0]
    _agrees_with_a_restore(s)


def test_the_memory_limit_counts_a_push_at_the_widths_it_needs():
    row = DIM * 4 + 4 + 4 + INDEX_BYTES  # Add, narrow
    s = _state(optimizer_to_dict(Add()), memory_limit=3 * row + 4)
    assert "versions" in _push(s, 1, [1, 2])
    err = _push(s, 2, [2**40])  # three rows, each with an 8-byte id: 12 bytes past the limit
    assert isinstance(err, CapacityExceeded) and err.needed == 3 * (row + 4)
    assert s._keys["e"].ids.dtype == np.uint32 and s.describe("e")["rows"] == 2  # nothing changed
    assert "versions" in _push(s, 3, [3])


# ---- snapshots -------------------------------------------------------------------------------

def test_snapshots_hold_int64_columns_and_refuse_what_does_not_fit():
    s = _state(optimizer_to_dict(Adam()))
    _push(s, 1, [1, 2, 3])
    f = frame.decode(s.snapshot())
    (table,) = [m for m in f.meta["keys"] if m["key"] == "e"]
    assert table["layout"] == 2
    ids, _, versions, steps = f.arrays[:4]
    assert ids.dtype == versions.dtype == steps.dtype == np.int64

    def restore(meta_change=None, steps_value=None):
        meta = {**f.meta, "keys": [{**table, **(meta_change or {})}]}
        arrays = list(f.arrays)
        if steps_value is not None:
            arrays[3] = np.array([1, 1, steps_value], np.int64)
        return ShardState.restore(frame.encode(frame.KIND_SNAPSHOT, meta, arrays))

    restore()
    with pytest.raises(CodecError):
        restore({"layout": 3})
    with pytest.raises(CodecError):
        restore(steps_value=2**32)  # a step past every version of a table still narrow


# ---- the index -------------------------------------------------------------------------------

def test_the_index_never_costs_more_than_its_accounted_bytes_while_rows_are_added():
    """4 bytes an entry at a load of at least 0.5 after every rebuild (power-of-two sizes let it
    fall to 0.25: 16 bytes a row, twice what was accounted)."""
    assert 4 / MIN_LOAD <= INDEX_BYTES
    rng = np.random.default_rng(3)
    keys, index, n, worst = np.zeros(200_000, np.int64), RowIndex(), 0, 0.0
    while n < len(keys) - 5000:
        fresh = n + np.arange(int(rng.integers(1, 5000)))
        keys[fresh] = fresh * 7919 + 13
        index.insert(keys[fresh], fresh, keys)
        n += len(fresh)
        worst = max(worst, index.nbytes / n)
    assert n > 190_000 and worst <= INDEX_BYTES, worst
    assert (index.find(keys[:n], keys)[0] == np.arange(n)).all()
    assert (index.find(keys[:n] + 1, keys)[0] == -1).all()


def test_probe_sequences_that_wrap_past_the_end_and_run_longer_than_a_window():
    """Ids that all start at the last positions of a small index: every probe wraps to the front
    and most run past one window (the lookup inspects WINDOW positions per pass)."""
    index = RowIndex()
    size = len(index.table)
    pool = np.arange(1, 200_000, dtype=np.int64)
    tail = pool[index._start(pool) >= size - 2][: int(0.75 * size)]  # as many as the load allows
    assert len(tail) > WINDOW
    keys = np.zeros(len(tail) + 1, np.int64)
    keys[: len(tail)] = tail
    slots = np.arange(len(tail), dtype=np.int64)
    index.insert(tail[::2], slots[::2], keys)  # in two batches: the second probes past the first
    index.insert(tail[1::2], slots[1::2], keys)
    assert len(index.table) == size  # no rebuild: the crowding is the test
    got, where = index.find(tail, keys)
    assert got.tolist() == slots.tolist()
    assert sorted(where.tolist()) == sorted(set(where.tolist()))
    assert (where < WINDOW).any()  # wrapped to the front
    absent = pool[index._start(pool) >= size - 1][len(tail):len(tail) + 20]
    assert (index.find(absent, keys)[0] == -1).all()


def test_changed_rows_are_the_rows_read_whose_version_differs():
    s = _state(optimizer_to_dict(SGD(lr=0.5)))
    _push(s, 1, [2, 5, 9])
    _push(s, 2, [5])
    ids = np.int64([1, 2, 5, 9, 11])
    values, versions = s.read_rows("e", ids)
    have = versions.copy()
    have[[0, 2]] = -1  # the caller lacks a row never stored and a stored one
    current, changed = s.changed_rows("e", ids, have)
    assert current.tolist() == versions.tolist()
    assert np.array_equal(changed, values[[0, 2]])
    stored = ids[1:4]  # every one stored (a quicker path)
    got, got_versions = s.read_rows("e", stored)
    assert np.array_equal(got, values[1:4]) and got_versions.tolist() == versions[1:4].tolist()
    current, changed = s.changed_rows("e", stored, np.int64([-1, versions[2], -1]))
    assert current.tolist() == versions[1:4].tolist() and np.array_equal(changed, values[[1, 3]])
