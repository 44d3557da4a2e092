"""Row-wise Adagrad, FTRL-Proximal and gradient clipping against numpy references written from
their definitions (FBGEMM's EXACT_ROWWISE_ADAGRAD; McMahan et al. 2013, Algorithm 1;
torch.nn.utils.clip_grad_norm_), directly, through a table and through dense blocks. The
references run in float64; ours in float32, so they agree to float32 rounding. Every random
draw comes from SEED, printed on failure."""
from __future__ import annotations

import functools
import json

import numpy as np
import pytest

from kvps.command import CreateKey, CreateTable
from kvps.errors import InvalidRequest
from kvps.initializer import Normal, initializer_to_dict
from kvps.merge import PushRequest, merge
from kvps.optimizer import (FTRL, SGD, Add, RowWiseAdagrad, clipped, fitted_state, optimizer_from_dict,
                            optimizer_to_dict)
from kvps.shard import ShardState
from kvps.table import Table

SEED = 20240611
STEPS = 30
RTOL, ATOL = 1e-4, 1e-5


# ---- references, float64, written from the definitions ------------------------------------------

def ref_rowwise_adagrad(w, grads, lr, eps, acc0):
    w, acc = w.astype(np.float64), np.full(len(w), acc0, np.float64)
    for g in grads:
        g = g.astype(np.float64)
        acc = acc + (g * g).mean(axis=1)  # one accumulator per row: mean of g^2 over the row
        w = w - lr * g / (np.sqrt(acc)[:, None] + eps)
    return w


def ref_ftrl(w, grads, alpha, beta, l1, l2):
    w = w.astype(np.float64)
    z, n = np.zeros_like(w), np.zeros_like(w)
    for g in grads:
        g = g.astype(np.float64)
        sigma = (np.sqrt(n + g * g) - np.sqrt(n)) / alpha
        z = z + g - sigma * w
        n = n + g * g
        w = np.where(np.abs(z) <= l1, 0.0, -(z - np.sign(z) * l1) / ((beta + np.sqrt(n)) / alpha + l2))
    return w


def ref_clip(g, max_norm):
    norm = np.sqrt((g.astype(np.float64) ** 2).sum())
    return g * (max_norm / (norm + 1e-6)) if norm > max_norm else g


def _grads(rng, shape, n=STEPS):
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(n)]


def _seeded(test):
    """Re-raise a failure with the seed in the message."""
    @functools.wraps(test)
    def run(*args, **kwargs):
        try:
            return test(*args, **kwargs)
        except AssertionError as exc:
            raise AssertionError(f"seed={SEED}: {exc}") from exc
    return run


CASES = {
    "rowwise": (RowWiseAdagrad(lr=0.1, eps=1e-8, initial_accumulator=0.0),
                lambda w, gs: ref_rowwise_adagrad(w, gs, 0.1, 1e-8, 0.0)),
    "rowwise-acc0": (RowWiseAdagrad(lr=0.05, eps=1e-6, initial_accumulator=0.5),
                     lambda w, gs: ref_rowwise_adagrad(w, gs, 0.05, 1e-6, 0.5)),
    "ftrl": (FTRL(alpha=0.1, beta=1.0), lambda w, gs: ref_ftrl(w, gs, 0.1, 1.0, 0.0, 0.0)),
    "ftrl-l1l2": (FTRL(alpha=0.5, beta=0.5, l1=0.8, l2=0.3),
                  lambda w, gs: ref_ftrl(w, gs, 0.5, 0.5, 0.8, 0.3)),
}


@pytest.mark.parametrize("case", sorted(CASES))
@_seeded
def test_step_matches_reference(case):
    ours, ref = CASES[case]
    rng = np.random.default_rng(SEED)
    start = rng.standard_normal((6, 8)).astype(np.float32)
    grads = _grads(rng, (6, 8))
    value, state = start, ours.init_state(start)
    for t, g in enumerate(grads, start=1):
        value, state = ours.step(value, g, state, t)
        assert value.dtype == np.float32 and all(s.dtype == np.float32 for s in state.values())
    np.testing.assert_allclose(value, ref(start, grads), rtol=RTOL, atol=ATOL)


def test_ftrl_l1_makes_weights_exactly_zero():
    rng = np.random.default_rng(SEED)
    value, state = np.zeros((4, 16), np.float32), FTRL().init_state(np.zeros((4, 16), np.float32))
    for _ in range(5):
        value, state = FTRL(alpha=0.1, l1=5.0).step(value, rng.standard_normal((4, 16)).astype(np.float32) * 0.1,
                                                   state, 1)
    assert (value == 0).all(), f"seed={SEED}"


@pytest.mark.parametrize("case", sorted(CASES))
@_seeded
def test_table_rows_match_reference_per_row(case):
    """Rows pushed at different steps each follow the reference over their own gradients."""
    ours, ref = CASES[case]
    init, dim, n_ids = Normal(std=0.5, seed=SEED % 1000), 4, 6
    shard = ShardState(0)
    shard.apply(CreateTable("e", dim, "float32", optimizer_to_dict(ours), initializer_to_dict(init), "sum")).result
    rng = np.random.default_rng(SEED)
    seen: dict[int, list[np.ndarray]] = {i: [] for i in range(n_ids)}
    for seq in range(1, STEPS + 1):
        ids = np.sort(rng.choice(n_ids, size=int(rng.integers(1, n_ids)), replace=False)).astype(np.int64)
        g = rng.standard_normal((len(ids), dim)).astype(np.float32)
        for i, row in zip(ids.tolist(), g):
            seen[i].append(row[None])
        shard.apply(merge([PushRequest("c", seq, seq, rows=(("e", ids, g),))], {"e": "sum"}, now=float(seq))).result
    values, _ = shard.read_rows("e", np.arange(n_ids, dtype=np.int64))
    for i in range(n_ids):
        start = init.rows(np.array([i]), dim, np.float32)
        np.testing.assert_allclose(values[i:i + 1], ref(start, seen[i]), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("opt", [RowWiseAdagrad(lr=0.1), FTRL(alpha=0.2, l1=0.1), SGD(lr=0.1, clip_norm=1.0)])
@_seeded
def test_per_row_steps_are_bit_identical_and_pure(opt):
    rng = np.random.default_rng(SEED)
    rows = rng.standard_normal((4, 5)).astype(np.float32)
    state = opt.init_state(rows)
    grad = (rng.standard_normal((4, 5)) * 3).astype(np.float32)
    for arr in (rows, grad, *state.values()):
        arr.flags.writeable = False
    steps = np.array([1, 2, 5, 9], dtype=np.int64)
    batch, batch_state = opt.step(rows, grad, state, steps)
    for i, t in enumerate(steps.tolist()):
        one, one_state = opt.step(rows[i:i + 1], grad[i:i + 1], {k: v[i:i + 1] for k, v in state.items()},
                                  np.array([t]))
        assert one.tobytes() == batch[i:i + 1].tobytes()
        for name in opt.state_names():
            assert one_state[name].tobytes() == batch_state[name][i:i + 1].tobytes()


# ---- clipping ------------------------------------------------------------------------------------

@_seeded
def test_clip_is_per_row_for_tables():
    rng = np.random.default_rng(SEED)
    init, dim = Normal(std=0.5, seed=1), 6
    shard = ShardState(0)
    shard.apply(CreateTable("e", dim, "float32", optimizer_to_dict(SGD(lr=1.0, clip_norm=0.5)),
                            initializer_to_dict(init), "sum")).result
    ids = np.arange(5, dtype=np.int64)
    g = (rng.standard_normal((5, dim)) * np.array([[0.01], [0.1], [1], [10], [100]])).astype(np.float32)
    shard.apply(merge([PushRequest("c", 1, 1, rows=(("e", ids, g),))], {"e": "sum"}, now=1.0)).result
    values, _ = shard.read_rows("e", ids)
    want = init.rows(ids, dim, np.float32) - np.stack([ref_clip(r, 0.5) for r in g])
    np.testing.assert_allclose(values, want, rtol=1e-6, atol=1e-6)
    moved = np.linalg.norm(values - init.rows(ids, dim, np.float32), axis=1)
    assert (moved <= 0.5 + 1e-5).all() and moved[0] < 0.1


@_seeded
def test_clip_is_per_block_for_dense_keys():
    rng = np.random.default_rng(SEED)
    start = rng.standard_normal((4, 3)).astype(np.float32)
    shard = ShardState(0)
    blocks = ((0, start[0:2]), (1, start[2:4]))
    shard.apply(CreateKey("w", (4, 3), "float32", 2, optimizer_to_dict(Add(clip_norm=1.0)), "sum", blocks)).result
    g = (rng.standard_normal((4, 3)) * np.array([[0.1], [0.1], [10], [10]])).astype(np.float32)
    req = PushRequest("c", 1, 1, tuple(("w", b, g[2 * b:2 * b + 2]) for b in range(2)))
    shard.apply(merge([req], {"w": "sum"}, now=1.0)).result
    got = np.concatenate([v for _, v in shard.read_blocks("w", [0, 1])])
    want = start + np.concatenate([ref_clip(g[0:2], 1.0), ref_clip(g[2:4], 1.0)])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_same_log_gives_bit_identical_replicas():
    def run():
        rng = np.random.default_rng(SEED)
        shard = ShardState(0)
        for key, opt in (("r", RowWiseAdagrad(lr=0.1, clip_norm=2.0)), ("f", FTRL(l1=0.01, clip_norm=1.0))):
            shard.apply(CreateTable(key, 8, "float32", optimizer_to_dict(opt),
                                    initializer_to_dict(Normal(seed=3)), "sum")).result
        for seq in range(1, 20):
            ids = np.unique(rng.zipf(1.5, size=16) % 50).astype(np.int64)
            rows = tuple((k, ids, (rng.standard_normal((len(ids), 8)) * 2).astype(np.float32)) for k in "rf")
            shard.apply(merge([PushRequest("c", seq, seq, rows=rows)], {"r": "sum", "f": "sum"},
                              now=float(seq))).result
        return shard.snapshot()
    assert run() == run(), f"seed={SEED}"


def test_dicts_round_trip_and_clip_left_out_when_off():
    for opt in (RowWiseAdagrad(lr=0.2, eps=1e-6, initial_accumulator=0.1), FTRL(alpha=0.3, l1=1, l2=2),
                SGD(lr=0.1, clip_norm=3.0), clipped(Add(), 0.5)):
        d = optimizer_to_dict(opt)
        assert optimizer_from_dict(json.loads(json.dumps(d))) == opt
    assert "clip_norm" not in optimizer_to_dict(SGD(lr=0.1))
    assert optimizer_to_dict(clipped(SGD(lr=0.1), 2.0))["clip_norm"] == 2.0
    assert clipped(SGD(lr=0.1), None) == SGD(lr=0.1)


@pytest.mark.parametrize("junk", [
    {"name": "ftrl", "alpha": 0}, {"name": "ftrl", "l1": -1}, {"name": "rowwise_adagrad", "eps": "x"},
    {"name": "sgd", "lr": 0.1, "clip_norm": -1}, {"name": "add", "clip_norm": float("inf")},
    {"name": "rowwise_adagrad", "initial_accumulator_value": 0.1},
])
def test_from_dict_rejects_junk(junk):
    with pytest.raises(InvalidRequest):
        optimizer_from_dict(junk)


@pytest.mark.parametrize("opt", [RowWiseAdagrad(lr=0.1), SGD(lr=0.1, clip_norm=1.0), FTRL(), clipped(Add(), 2.0)])
def test_a_push_whose_rows_are_all_left_out_by_admission_applies(opt):
    """Count admission leaves every row of a first push out: the optimizer steps zero rows."""
    shard = ShardState(0)
    shard.apply(CreateTable("e", 4, "float32", optimizer_to_dict(opt), {"name": "zeros"}, "sum",
                            {"admit": {"name": "count", "min_count": 2}})).result
    ids, g = np.int64([3, 8]), np.ones((2, 4), np.float32)
    for seq in (1, 2):
        got = shard.apply(merge([PushRequest("c", seq, seq, rows=(("e", ids, g),))], {"e": "sum"},
                                now=float(seq))).result["results"][("c", seq)]
        assert "versions" in got, got
    assert shard.describe("e")["rows"] == 2


# ---- row-wise Adagrad keeps one accumulator per row ------------------------------------------

@_seeded
def test_rowwise_accumulator_is_one_number_per_row():
    """Shaped (rows, 1) from the start and after every step (never broadcast back over the row),
    in tables and dense blocks, and the bytes a table accounts for follow it."""
    opt, rng = RowWiseAdagrad(lr=0.1, initial_accumulator=0.5), np.random.default_rng(SEED)
    value = rng.standard_normal((6, 8)).astype(np.float32)
    state = opt.init_state(value)
    assert state["sum"].shape == (6, 1) and state["sum"].tolist() == [[0.5]] * 6
    for t in range(1, 4):
        value, state = opt.step(value, rng.standard_normal((6, 8)).astype(np.float32), state, t)
        assert state["sum"].shape == (6, 1) and state["sum"].dtype == np.float32
    assert opt.init_state(np.zeros(5, np.float32))["sum"].shape == (5,)  # a 1-d block: one element per row
    assert opt.init_state(np.zeros((2, 3, 4), np.float32))["sum"].shape == (2, 1, 1)

    dim = 64
    shard = ShardState(0)
    shard.apply(CreateTable("e", dim, "float32", optimizer_to_dict(opt), {"name": "zeros"}, "sum")).result
    shard.apply(CreateKey("w", (4, dim), "float32", 2, optimizer_to_dict(opt), "sum",
                          ((0, np.zeros((2, dim), np.float32)), (1, np.zeros((2, dim), np.float32))))).result
    ids = np.arange(100, dtype=np.int64)
    shard.apply(merge([PushRequest("c", 1, 1, (("w", 0, np.ones((2, dim), np.float32)),),
                                   (("e", ids, np.ones((100, dim), np.float32)),))], {}, now=1.0)).result
    table = shard._keys["e"]
    assert table.state["sum"].shape[1:] == (1,) and table.state["sum"].nbytes == len(table.ids) * 4
    plain = Table("p", dim, "float32", {"name": "add"}, {"name": "zeros"}, "sum")  # no state at all
    assert table.row_bytes - plain.row_bytes == 4  # the accumulator: 4 bytes a row, not dim * 4
    assert shard.describe("e")["bytes"] == 100 * table.row_bytes
    assert shard._keys["w"].blocks[0].state["sum"].shape == (2, 1)


@_seeded
def test_rowwise_per_element_state_of_older_snapshots_steps_to_the_same_bits():
    opt, rng = RowWiseAdagrad(lr=0.1), np.random.default_rng(SEED)
    value, grad = rng.standard_normal((5, 4)).astype(np.float32), rng.standard_normal((5, 4)).astype(np.float32)
    acc = np.abs(rng.standard_normal((5, 1))).astype(np.float32)
    wide = np.repeat(acc, 4, axis=1)  # what snapshots held before: the accumulator on every column
    compact = fitted_state(opt, wide, (5, 4))
    assert compact.shape == (5, 1) and compact.tobytes() == acc.tobytes()
    one, one_state = opt.step(value, grad, {"sum": acc}, 1)
    two, two_state = opt.step(value, grad, {"sum": wide}, 1)
    assert one.tobytes() == two.tobytes() and one_state["sum"].tobytes() == two_state["sum"].tobytes()
    wide[2, 3] += 1
    with pytest.raises(ValueError):
        fitted_state(opt, wide, (5, 4))  # not a broadcast accumulator: refused, not guessed
    with pytest.raises(ValueError):
        fitted_state(opt, np.zeros((5, 3), np.float32), (5, 4))
    assert fitted_state(FTRL(), wide, (5, 4)) is wide  # per-element state stays as it is
