"""Optimizers match torch.optim on the same gradients: directly, through the shard's dense blocks,
and per row through a table (each row steps only when it is pushed)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kvps.command import CreateKey, CreateTable
from kvps.errors import InvalidRequest
from kvps.initializer import Normal, initializer_to_dict
from kvps.merge import PushRequest, merge
from kvps.optimizer import (
    SGD, Adagrad, Adam, Add, optimizer_from_dict, optimizer_to_dict,
)
from kvps.shard import ShardState

STEPS = 25
RTOL, ATOL = 2e-5, 2e-6  # float32: a few ulp of drift over 25 steps

# (our optimizer, torch class, torch kwargs)
CASES = {
    "sgd": (SGD(lr=0.1), torch.optim.SGD, dict(lr=0.1)),
    "sgd-momentum": (SGD(lr=0.05, momentum=0.9, dampening=0.1), torch.optim.SGD,
                     dict(lr=0.05, momentum=0.9, dampening=0.1)),
    "sgd-nesterov": (SGD(lr=0.05, momentum=0.8, nesterov=True), torch.optim.SGD,
                     dict(lr=0.05, momentum=0.8, nesterov=True)),
    "sgd-wd": (SGD(lr=0.1, momentum=0.5, weight_decay=0.01), torch.optim.SGD,
               dict(lr=0.1, momentum=0.5, weight_decay=0.01)),
    "adagrad": (Adagrad(lr=0.1), torch.optim.Adagrad, dict(lr=0.1)),
    "adagrad-decay": (Adagrad(lr=0.1, lr_decay=0.05, weight_decay=0.02, initial_accumulator_value=0.3),
                      torch.optim.Adagrad,
                      dict(lr=0.1, lr_decay=0.05, weight_decay=0.02, initial_accumulator_value=0.3)),
    "adam": (Adam(lr=0.01), torch.optim.Adam, dict(lr=0.01)),
    "adam-wd": (Adam(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1), torch.optim.Adam,
                dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)),
    "adamw": (Adam(lr=0.01, weight_decay=0.1, decoupled=True), torch.optim.AdamW,
              dict(lr=0.01, weight_decay=0.1)),
}


def _torch_run(torch_cls, kwargs, start: np.ndarray, grads: list[np.ndarray]) -> np.ndarray:
    param = torch.nn.Parameter(torch.from_numpy(start.copy()))
    opt = torch_cls([param], foreach=False, **kwargs)
    for g in grads:
        param.grad = torch.from_numpy(g.copy())
        opt.step()
    return param.detach().numpy()


def _grads(seed: int, shape: tuple[int, ...], n: int = STEPS) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(n)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_step_matches_torch(case):
    ours, torch_cls, kwargs = CASES[case]
    rng = np.random.default_rng(1)
    start = rng.standard_normal((4, 5)).astype(np.float32)
    grads = _grads(2, (4, 5))
    value, state = start, ours.init_state(start)
    for t, g in enumerate(grads, start=1):
        value, state = ours.step(value, g, state, t)
        assert value.dtype == np.float32
    np.testing.assert_allclose(value, _torch_run(torch_cls, kwargs, start, grads), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("case", sorted(CASES))
def test_dense_push_through_shard_matches_torch(case):
    ours, torch_cls, kwargs = CASES[case]
    start = np.random.default_rng(3).standard_normal((5, 3)).astype(np.float32)
    grads = _grads(4, (5, 3))
    shard = ShardState(0)
    blocks = ((0, start[0:2]), (1, start[2:4]), (2, start[4:5]))
    shard.apply(CreateKey("w", (5, 3), "float32", 2, optimizer_to_dict(ours), "sum", blocks)).result
    for seq, g in enumerate(grads, start=1):
        req = PushRequest("c", seq, seq, tuple(("w", b, g[2 * b:2 * b + 2]) for b in range(3)))
        assert shard.check_push(req) is None
        result = shard.apply(merge([req], {"w": "sum"}, now=float(seq))).result
        assert result["results"][("c", seq)] == {"versions": {"w": seq}}
    got = np.concatenate([v for _, v in shard.read_blocks("w", [0, 1, 2])])
    np.testing.assert_allclose(got, _torch_run(torch_cls, kwargs, start, grads), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("case", sorted(CASES))
def test_table_rows_step_only_when_pushed(case):
    """Rows pushed at different steps (and by two merged requests) each match a torch parameter
    that stepped only when that row was pushed, with the summed gradient."""
    ours, torch_cls, kwargs = CASES[case]
    init = Normal(std=0.5, seed=7)
    dim, n_ids = 3, 8
    shard = ShardState(0)
    shard.apply(CreateTable("e", dim, "float32", optimizer_to_dict(ours), initializer_to_dict(init), "sum")).result
    params = [torch.nn.Parameter(torch.from_numpy(init.rows(np.array([i]), dim, np.float32)[0]))
              for i in range(n_ids)]
    opts = [torch_cls([p], foreach=False, **kwargs) for p in params]
    rng = np.random.default_rng(5)
    for seq in range(1, STEPS + 1):
        reqs = []
        total = np.zeros((n_ids, dim), np.float32)
        for client in ("a", "b")[: int(rng.integers(1, 3))]:
            ids = np.sort(rng.choice(n_ids, size=int(rng.integers(1, 5)), replace=False)).astype(np.int64)
            g = rng.standard_normal((len(ids), dim)).astype(np.float32)
            total[ids] += g
            reqs.append(PushRequest(client, seq, seq, rows=(("e", ids, g),)))
        shard.apply(merge(reqs, {"e": "sum"}, now=float(seq))).result
        touched = sorted({int(i) for r in reqs for i in r.rows[0][1]})
        for i in touched:
            params[i].grad = torch.from_numpy(total[i].copy())
            opts[i].step()
    values, _ = shard.read_rows("e", np.arange(n_ids, dtype=np.int64))
    want = np.stack([p.detach().numpy() for p in params])
    np.testing.assert_allclose(values, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("case", sorted(CASES) + ["add"])
def test_step_is_pure_and_per_row_steps_are_bit_identical(case):
    """Inputs are never written (read-only arrays would raise); a row stepping with an array of
    step counts gets exactly the bits of a dense step with that count."""
    ours = Add() if case == "add" else CASES[case][0]
    rng = np.random.default_rng(9)
    rows = rng.standard_normal((4, 6)).astype(np.float32)
    state = ours.init_state(rows)
    for _ in range(3):  # build some non-trivial state first
        rows, state = ours.step(rows, rng.standard_normal((4, 6)).astype(np.float32), state, 1)
    grad = rng.standard_normal((4, 6)).astype(np.float32)
    for arr in (rows, grad, *state.values()):
        arr.flags.writeable = False
    steps = np.array([1, 2, 7, 30], dtype=np.int64)
    batch_value, batch_state = ours.step(rows, grad, state, steps)
    for i, t in enumerate(steps.tolist()):
        one_value, one_state = ours.step(rows[i:i + 1], grad[i:i + 1], {k: v[i:i + 1] for k, v in state.items()}, t)
        assert one_value.tobytes() == batch_value[i:i + 1].tobytes()
        for name in ours.state_names():
            assert one_state[name].tobytes() == batch_state[name][i:i + 1].tobytes()
    assert set(batch_state) == set(ours.state_names())


def test_add_is_plain_addition():
    value, state = Add().step(np.float32([1, 2]), np.float32([0.5, -1]), {}, 1)
    assert value.tolist() == [1.5, 1.0] and state == {}


def test_adagrad_initial_accumulator():
    state = Adagrad(initial_accumulator_value=0.25).init_state(np.zeros((2, 2), np.float32))
    assert state["sum"].tolist() == [[0.25, 0.25], [0.25, 0.25]]


@pytest.mark.parametrize("opt", [Add(), SGD(lr=0.5, momentum=0.9, nesterov=True), Adagrad(lr_decay=0.1),
                                 Adam(betas=(0.5, 0.6), decoupled=True, weight_decay=0.01)])
def test_dict_round_trip(opt):
    d = optimizer_to_dict(opt)
    assert d["name"] == opt.name
    assert optimizer_from_dict(d) == opt
    import json
    assert optimizer_from_dict(json.loads(json.dumps(d))) == opt  # survives JSON (betas as a list)


@pytest.mark.parametrize("junk", [
    None, 3, [], {}, {"name": "rmsprop"}, {"name": ["sgd"]}, {"name": "sgd"}, {"name": "sgd", "lr": -1},
    {"name": "sgd", "lr": float("nan")}, {"name": "sgd", "lr": True}, {"name": "sgd", "lr": "0.1"},
    {"name": "sgd", "lr": 0.1, "nesterov": True}, {"name": "sgd", "lr": 0.1, "bogus": 1},
    {"name": "adam", "betas": [0.9]}, {"name": "adam", "betas": [1.0, 0.9]},
    {"name": "adam", "decoupled": 1}, {"name": "adagrad", "eps": float("inf")},
])
def test_from_dict_rejects_junk(junk):
    with pytest.raises(InvalidRequest):
        optimizer_from_dict(junk)


def test_float64_values_stay_float64():
    value, _ = Adam().step(np.ones(3), np.ones(3), Adam().init_state(np.ones(3)), 1)
    assert value.dtype == np.float64


def test_definitions_are_cached_without_changing_what_they_turn_into():
    """An optimizer definition is validated once and its instance shared (optimizers are frozen);
    the cache tells 1, 1.0 and True apart, a caller changing the dict it got back changes nothing
    for the next one, and bad definitions still raise every time."""
    from kvps.optimizer import _optimizer_from_dict, normalized_optimizer

    defs = [{"name": "sgd", "lr": 1}, {"name": "sgd", "lr": 1.0},
            {"name": "adam", "lr": 0.5, "betas": [0.9, 0.99]}, {"lr": 0.5, "betas": [0.9, 0.99], "name": "adam"},
            {"name": "add", "clip_norm": 2}, {"name": "add"}]
    for d in defs * 2:
        fresh = _optimizer_from_dict(d)
        assert optimizer_from_dict(d) == fresh
        assert optimizer_from_dict(d) is optimizer_from_dict(dict(d))
        got = normalized_optimizer(d)
        assert got == optimizer_to_dict(fresh) and json.dumps(got) == json.dumps(optimizer_to_dict(fresh))
        got["name"] = "changed"
        for v in got.values():
            if isinstance(v, list):
                v.append(0)
    # lr True equals lr 1 as a dict value: a cache keyed by value would take it for valid
    for bad in ({"name": "sgd", "lr": True}, {"name": "sgd"}, {"name": "nope"}, {"name": "sgd", "lr": 0.1, "x": 1},
                ["sgd"]):
        for _ in range(2):
            with pytest.raises(InvalidRequest):
                optimizer_from_dict(bad)
