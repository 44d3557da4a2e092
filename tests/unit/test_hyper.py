"""Learning-rate schedules on the server: the ``Hyperparams`` command, its validation, its apply
(stamped with the worker step; errors as values), and its place in snapshots and determinism."""
from __future__ import annotations

import numpy as np
import pytest

from kvps.command import CreateKey, CreateTable, DeleteKey, Hyperparams, SnapshotStep, decode_command
from kvps.errors import InvalidRequest, KeyNotFound
from kvps.hyper import SCHEDULABLE, check_values, retuned
from kvps.merge import PushRequest, merge
from kvps.optimizer import SGD, Adam
from kvps.shard import ShardState

SGD_DEF = {"name": "sgd", "lr": 0.1}
ADAM_DEF = {"name": "adam", "lr": 0.01}


def _state() -> ShardState:
    """Dense 'w' (2, 2) float32, one block, SGD(lr=0.1); table 'e' (dim 2) with Adam(lr=0.01)."""
    s = ShardState(0)
    w = np.ones((2, 2), np.float32)
    assert s.apply(CreateKey("w", (2, 2), "float32", 2, SGD_DEF, "sum", ((0, w),))).result["created"]
    assert s.apply(CreateTable("e", 2, "float32", ADAM_DEF, {"name": "zeros"}, "sum")).result["created"]
    return s


def _push(s: ShardState, seq: int, grad: float) -> None:
    req = PushRequest("c", seq, seq, (("w", 0, np.full((2, 2), grad, np.float32)),),
                      (("e", np.int64([5]), np.full((1, 2), grad, np.float32)),))
    result = s.apply(merge([req], {}, now=1.0)).result["results"][("c", seq)]
    assert "versions" in result, result


def test_values_are_normalised_and_bad_ones_named():
    assert check_values({"lr": 1, "betas": (0.9, 0.99)}) == {"betas": [0.9, 0.99], "lr": 1.0}
    for bad, field in [({"lr": "x"}, "lr"), ({"lr": float("nan")}, "lr"), ({"lr": True}, "lr"),
                       ({"betas": [0.9]}, "betas"), ({"nesterov": True}, "nesterov"), ({}, "values"),
                       ([("lr", 1.0)], "values")]:
        with pytest.raises(InvalidRequest) as info:
            check_values(bad)
        assert info.value.fields["field"] == field


def test_retune_refuses_foreign_fields_bad_ranges_and_state_changes():
    merged, opt = retuned(ADAM_DEF, {"lr": 0.5}, {"betas": [0.8, 0.9]})
    assert merged == {"lr": 0.5, "betas": [0.8, 0.9]} and opt == Adam(lr=0.5, betas=(0.8, 0.9))
    cases = [(SGD_DEF, {"betas": [0.9, 0.9]}, "cannot schedule betas"),
             ({"name": "add"}, {"lr": 0.1}, "cannot schedule lr"),
             (SGD_DEF, {"lr": -1.0}, "SGD.lr"),
             (SGD_DEF, {"momentum": 0.9}, "state arrays"),  # would add a momentum buffer
             ({"name": "sgd", "lr": 0.1, "momentum": 0.9, "nesterov": True}, {"momentum": 0.0}, "nesterov")]
    for definition, values, message in cases:
        with pytest.raises(InvalidRequest, match=message):
            retuned(definition, {}, values)
    assert set(SCHEDULABLE) == {"add", "adagrad", "adam", "ftrl", "rowwise_adagrad", "sgd"}


def test_command_round_trip_and_structural_checks():
    cmd = Hyperparams("w", 7, {"lr": 0.05, "betas": (0.8, 0.9)})
    assert decode_command(cmd.to_bytes()) == cmd and cmd.values["betas"] == [0.8, 0.9]
    for args in [("", 1, {"lr": 0.1}), ("w", -1, {"lr": 0.1}), ("w", 1, {"bogus": 1.0})]:
        with pytest.raises(InvalidRequest):
            Hyperparams(*args)


def test_an_update_changes_the_optimizer_from_then_on_and_older_steps_are_ignored():
    s = _state()
    _push(s, 1, 1.0)  # lr 0.1: 1 - 0.1 = 0.9
    assert s.apply(Hyperparams("w", 5, {"lr": 0.5})).result == {"applied": True, "step": 5, "values": {"lr": 0.5}}
    _push(s, 2, 1.0)  # lr 0.5: 0.9 - 0.5
    expected = np.float32(0.9) - np.float32(0.5) * np.float32(1.0)
    assert s.read_blocks("w", [0])[0][1][0, 0] == expected
    stale = s.apply(Hyperparams("w", 4, {"lr": 9.0})).result  # a slow worker's older schedule
    assert stale == {"applied": False, "step": 5, "values": {"lr": 0.5}}
    assert s.apply(Hyperparams("w", 5, {"weight_decay": 0.1})).result["values"] == {"lr": 0.5, "weight_decay": 0.1}
    info = s.describe("w")
    assert info["optimizer"]["lr"] == 0.1  # the definition is kept ...
    assert info["hyperparams"] == {"step": 5, "values": {"lr": 0.5, "weight_decay": 0.1}}  # ... overrides apart
    w = np.ones((2, 2), np.float32)  # creating it again with the original definition is still a no-op
    assert s.apply(CreateKey("w", (2, 2), "float32", 2, SGD_DEF, "sum", ((0, w),))).result == {"created": False}


def test_tables_follow_the_schedule_too():
    s, ref = _state(), _state()
    s.apply(Hyperparams("e", 0, {"lr": 0.2})).result
    ref_table = ref._keys["e"]
    ref_table.optimizer = Adam(lr=0.2)  # what the schedule means, set by hand
    for seq in (1, 2):
        _push(s, seq, 0.5)
        _push(ref, seq, 0.5)
    assert s.read_rows("e", np.int64([5]))[0].tobytes() == ref.read_rows("e", np.int64([5]))[0].tobytes()


def test_errors_are_values_and_change_nothing():
    s = _state()
    before = s.state_hash()
    for cmd, error in [(Hyperparams("nope", 1, {"lr": 0.1}), KeyNotFound),
                       (Hyperparams("w", 1, {"betas": [0.9, 0.9]}), InvalidRequest),
                       (Hyperparams("w", 1, {"momentum": 0.9}), InvalidRequest)]:
        assert isinstance(s.check_hyperparams(cmd), error)  # the leader's pre-check ...
        assert isinstance(s.apply(cmd).result, error)  # ... and apply agree, without raising
    assert s.state_hash() == before
    assert s.check_hyperparams(Hyperparams("w", 1, {"lr": 0.3})) is None


def test_overrides_survive_snapshot_restore_and_replicas_stay_identical():
    log = [Hyperparams("w", 1, {"lr": 0.3}).to_bytes(), Hyperparams("e", 2, {"betas": [0.5, 0.6]}).to_bytes()]
    a, b = _state(), _state()
    for data in log:
        a.apply(decode_command(data)).result
        b.apply(decode_command(data)).result
    assert a.snapshot() == b.snapshot()
    c = ShardState.restore(a.snapshot())
    assert c.snapshot() == a.snapshot() and c.describe("w")["hyperparams"]["values"] == {"lr": 0.3}
    for seq in (1, 2):
        _push(a, seq, 1.0)
        _push(c, seq, 1.0)
    assert a.state_hash() == c.state_hash()  # the restored replica applies the same optimizer
    assert c.apply(Hyperparams("w", 0, {"lr": 1.0})).result["applied"] is False  # the step came along too


def test_snapshots_without_overrides_keep_their_bytes_and_delete_drops_them():
    s = _state()
    plain = s.snapshot()
    assert b"hyper" not in plain  # no new meta field unless a schedule was set
    s.apply(Hyperparams("w", 1, {"lr": 0.3})).result
    assert b"hyper" in s.snapshot()
    s.apply(DeleteKey("w")).result
    s.apply(CreateKey("w", (2, 2), "float32", 2, SGD_DEF, "sum", ((0, np.ones((2, 2), np.float32)),))).result
    assert "hyperparams" not in s.describe("w") and s._keys["w"].optimizer == SGD(lr=0.1)


def test_a_user_snapshot_restore_brings_back_its_schedule():
    s = _state()
    s.apply(Hyperparams("w", 3, {"lr": 0.3})).result
    for op in ("cut", "seal", "commit"):
        s.apply(SnapshotStep(op, "s1", at=1.0, digest="d")).result
    snap = ShardState.restore(s.snapshot())
    s.apply(Hyperparams("w", 9, {"lr": 0.9})).result
    assert s.apply_restore(SnapshotStep("restore", "s1", digest="d"), snap).result["restored"] == "s1"
    assert s.describe("w")["hyperparams"] == {"step": 3, "values": {"lr": 0.3}}
    assert s._keys["w"].optimizer == SGD(lr=0.3)
