"""The chaos harness's linearizability checker on known-good and known-bad register histories."""
from __future__ import annotations

import math
import random

import pytest

from kvps_chaos.linearizability import UNKNOWN, Operation, RegisterModel, check, check_per_key

M = RegisterModel()


def op(client, input, output, call, ret=math.inf, key="r"):
    return Operation(client, input, output, call, ret, key)


def W(client, value, version, call, ret=math.inf):
    return op(client, ("write", value), version, call, ret)


def R(client, value, version, call, ret):
    return op(client, ("read", None), (value, version), call, ret)


def CAS(client, expected, value, out, call, ret=math.inf):
    return op(client, ("cas", (expected, value)), out, call, ret)


def test_sequential_history_is_linearizable():
    h = [W(0, 1.0, 1, 0, 1), R(0, 1.0, 1, 2, 3), W(0, 2.0, 2, 4, 5), R(0, 2.0, 2, 6, 7)]
    assert check(h, M).ok is True


def test_concurrent_writes_may_be_ordered_either_way():
    # Two overlapping writes; the read after both sees the one that went second (version 2).
    h = [W(0, 1.0, 2, 0, 10), W(1, 2.0, 1, 1, 9), R(2, 1.0, 2, 11, 12)]
    assert check(h, M).ok is True


def test_read_overlapping_a_write_may_see_old_or_new():
    for seen in ((0.0, 0), (1.0, 1)):
        h = [W(0, 1.0, 1, 0, 10), R(1, *seen, 2, 3)]
        assert check(h, M).ok is True, seen


def test_planted_stale_read_is_caught():
    # The write of 1.0 completed before the read began, yet the read returns the initial value.
    h = [W(0, 1.0, 1, 0, 1), R(1, 0.0, 0, 2, 3)]
    res = check(h, M)
    assert res.ok is False
    assert res.stuck == [h[1]]


def test_planted_lost_write_is_caught():
    # Two acknowledged writes, then a read that misses the second one (it was "lost").
    h = [W(0, 1.0, 1, 0, 1), W(0, 2.0, 2, 2, 3), R(1, 1.0, 1, 4, 5), R(1, 1.0, 1, 6, 7)]
    assert check(h, M).ok is False


def test_double_applied_write_is_caught():
    # A write applied twice advances the version by two: the next reader sees a version gap.
    h = [W(0, 1.0, 1, 0, 1), R(1, 1.0, 2, 2, 3)]
    assert check(h, M).ok is False


def test_unknown_outcome_write_may_or_may_not_have_happened():
    took_effect = [W(0, 7.0, UNKNOWN, 0), R(1, 7.0, 1, 5, 6)]
    never = [W(0, 7.0, UNKNOWN, 0), R(1, 0.0, 0, 5, 6), R(1, 0.0, 0, 7, 8)]
    late = [W(0, 7.0, UNKNOWN, 0), R(1, 0.0, 0, 5, 6), R(1, 7.0, 1, 7, 8)]
    for h in (took_effect, never, late):
        assert check(h, M).ok is True
    # ...but it cannot take effect before it was invoked.
    early = [R(1, 7.0, 1, 0, 1), W(0, 7.0, UNKNOWN, 2)]
    assert check(early, M).ok is False
    # ...and it cannot be undone once seen.
    undone = [W(0, 7.0, UNKNOWN, 0), R(1, 7.0, 1, 5, 6), R(1, 0.0, 0, 7, 8)]
    assert check(undone, M).ok is False


def test_compare_and_set():
    good = [W(0, 1.0, 1, 0, 1), CAS(0, 1, 2.0, ("ok", 2), 2, 3), CAS(1, 1, 3.0, ("conflict", 2), 4, 5),
            R(1, 2.0, 2, 6, 7)]
    assert check(good, M).ok is True
    # A CAS reported as a conflict whose value is nevertheless visible (a retried CAS applied
    # twice without the duplicate table answers exactly like this).
    bad = [W(0, 1.0, 1, 0, 1), CAS(0, 1, 2.0, ("conflict", 2), 2, 3), R(1, 2.0, 2, 4, 5)]
    assert check(bad, M).ok is False
    # A successful CAS against a version the register never had in its window.
    stale = [W(0, 1.0, 1, 0, 1), W(0, 2.0, 2, 2, 3), CAS(1, 1, 9.0, ("ok", 2), 4, 5)]
    assert check(stale, M).ok is False


def test_unknown_cas_applies_only_when_the_version_matches():
    h = [W(0, 1.0, 1, 0, 1), CAS(1, 0, 5.0, UNKNOWN, 2), R(0, 5.0, 2, 3, 4)]
    assert check(h, M).ok is False
    h = [W(0, 1.0, 1, 0, 1), CAS(1, 1, 5.0, UNKNOWN, 2), R(0, 5.0, 2, 3, 4)]
    assert check(h, M).ok is True


def test_keys_are_checked_independently():
    good = [op(0, ("write", 1.0), 1, 0, 1, key="a"), op(1, ("read", None), (1.0, 1), 2, 3, key="a")]
    bad = [op(0, ("write", 1.0), 1, 0, 1, key="b"), op(1, ("read", None), (0.0, 0), 2, 3, key="b")]
    results = check_per_key(good + bad, lambda key: RegisterModel())
    assert results["a"].ok is True and results["b"].ok is False


def test_budget_gives_unknown_instead_of_hanging():
    h = [W(c, float(c + 1), UNKNOWN, 0) for c in range(12)] + [R(99, 0.0, 99, 1, 2)]
    res = check(h, M, budget=500)
    assert res.ok is None and res.verdict.startswith("unknown")


@pytest.mark.parametrize("seed", range(20))
def test_random_linearizable_histories_pass(seed):
    """Simulate a real register with concurrent clients (each op takes effect at a random point
    inside its window) and check that the checker accepts what was produced."""
    rng = random.Random(seed)
    value, version, t, h = 0.0, 0, 0.0, []
    pending = []  # (effect time, client, input, call)
    for i in range(60):
        t += rng.uniform(0, 1)
        client = rng.randrange(4)
        kind = rng.choice(["read", "write", "cas"])
        arg = (float(i + 1) if kind == "write" else
               (rng.randrange(max(1, version + 1)), float(i + 1)) if kind == "cas" else None)
        pending.append((t + rng.uniform(0, 2), client, (kind, arg), t))
    ret_of = {}
    for effect, client, inp, call in sorted(pending):
        kind, arg = inp
        if kind == "read":
            out = (value, version)
        elif kind == "write":
            value, version = arg, version + 1
            out = version
        elif version == arg[0]:
            value, version = arg[1], version + 1
            out = ("ok", version)
        else:
            out = ("conflict", version)
        ret_of[(call, client)] = (out, effect + rng.uniform(0, 1))
        lost_reply = kind != "read" and rng.random() < 0.1
        out, ret = ret_of[(call, client)]
        h.append(op(client, inp, UNKNOWN if lost_reply else out, call, math.inf if lost_reply else ret))
    res = check(h, M)
    assert res.ok is True, f"seed {seed}: {res.verdict}"
