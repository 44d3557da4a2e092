"""Merging pushes: sums per block / row in a fixed order, counts, mean, and push ids."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvps.merge import PushRequest, is_finite, merge, request_bytes


def _ro(arr):
    arr = np.array(arr)
    arr.flags.writeable = False  # merging must never write into a request's buffers
    return arr


def test_dense_sum_and_mean():
    a = PushRequest("a", 1, 1, dense=(("w", 0, _ro(np.float32([1, 2]))), ("w", 1, _ro(np.float32([5])))))
    b = PushRequest("b", 4, 2, dense=(("w", 0, _ro(np.float32([10, 20]))),))
    c = PushRequest("c", 9, 9, dense=(("v", 0, _ro(np.float32([3, 3]))), ("w", 0, _ro(np.float32([1, 1])))))
    cmd = merge([a, b, c], {"w": "mean", "v": "sum"}, now=5.0)
    assert cmd.now == 5.0
    got = {(d.key, d.block): (d.grad.tolist(), d.count, d.grad.dtype) for d in cmd.dense}
    assert got == {("v", 0): ([3, 3], 1, np.float32), ("w", 0): ([4, float(np.float32(23) / np.float32(3))], 3, np.float32),
                   ("w", 1): ([5], 1, np.float32)}
    assert [(d.key, d.block) for d in cmd.dense] == [("v", 0), ("w", 0), ("w", 1)]  # sorted
    assert [(p.client, p.seq, p.floor, p.keys) for p in cmd.pushes] == [
        ("a", 1, 1, ("w",)), ("b", 4, 2, ("w",)), ("c", 9, 9, ("v", "w"))]


def test_rows_sum_counts_and_mean():
    a = PushRequest("a", 1, 1, rows=(("e", _ro(np.int64([5, 2, 5])), _ro(np.float32([[1], [2], [3]]))),))
    b = PushRequest("b", 1, 1, rows=(("e", _ro(np.int64([2, 7])), _ro(np.float32([[10], [20]]))),))
    (summed,) = merge([a, b], {}, now=0.0).rows
    assert summed.ids.tolist() == [2, 5, 7] and summed.ids.dtype == np.int64
    assert summed.grads.tolist() == [[12], [4], [20]]
    assert summed.counts.tolist() == [2, 1, 1]  # id 5 twice in one request counts that request once
    (mean,) = merge([a, b], {"e": "mean"}, now=0.0).rows
    assert mean.grads.tolist() == [[6], [4], [20]] and mean.grads.dtype == np.float32


def test_repeated_push_id_is_merged_once():
    a = PushRequest("a", 1, 1, dense=(("w", 0, np.float32([1])),))
    cmd = merge([a, a, PushRequest("a", 2, 1, dense=(("w", 0, np.float32([2])),))], {}, now=0.0)
    assert [(p.client, p.seq) for p in cmd.pushes] == [("a", 1), ("a", 2)]
    assert cmd.dense[0].grad.tolist() == [3] and cmd.dense[0].count == 2


def test_merge_is_deterministic():
    rng = np.random.default_rng(0)
    reqs = [PushRequest(f"c{i}", i, i, dense=(("w", 0, rng.standard_normal(4).astype(np.float32)),),
                        rows=(("e", rng.integers(0, 10, 6), rng.standard_normal((6, 2)).astype(np.float32)),))
            for i in range(5)]
    assert merge(reqs, {}, now=1.0).to_bytes() == merge(reqs, {}, now=1.0).to_bytes()


def test_request_bytes_and_finite():
    small = PushRequest("a", 1, 1, dense=(("w", 0, np.zeros(10, np.float32)),))
    big = PushRequest("a", 1, 1, dense=(("w", 0, np.zeros(1000, np.float32)),),
                      rows=(("e", np.zeros(3, np.int64), np.zeros((3, 4), np.float32)),))
    assert 40 < request_bytes(small) < request_bytes(big)
    assert request_bytes(big) >= 4000 + 24 + 48
    assert is_finite(big)
    assert not is_finite(PushRequest("a", 1, 1, dense=(("w", 0, np.float32([1, np.nan])),)))
    assert not is_finite(PushRequest("a", 1, 1, rows=(("e", np.int64([1]), np.float32([[np.inf]])),)))


@st.composite
def _requests(draw):
    reqs = []
    for i in range(draw(st.integers(1, 5))):
        rows = []
        for _ in range(draw(st.integers(0, 2))):
            ids = draw(st.lists(st.integers(-3, 6), max_size=6))
            rows.append(("e", np.array(ids, np.int64),
                         np.array(draw(st.lists(st.integers(-100, 100), min_size=2 * len(ids),
                                                max_size=2 * len(ids))), np.float64).reshape(len(ids), 2) / 8))
        dense = tuple(("w", b, np.array(draw(st.lists(st.integers(-9, 9), min_size=3, max_size=3)), np.float64))
                      for b in draw(st.sets(st.integers(0, 2), max_size=3)))
        reqs.append(PushRequest(f"c{i}", i, i, dense, tuple(rows)))
    return reqs


@settings(max_examples=150, deadline=None)
@given(_requests(), st.sampled_from(["sum", "mean"]))
def test_matches_a_dumb_reference(reqs, mode):
    """Against plain Python loops (values are multiples of 1/8: sums are exact in any order)."""
    sums, counts = {}, {}
    for r in reqs:
        touched = set()
        for key, ids, grads in r.rows:
            for i, g in zip(ids.tolist(), grads.tolist()):
                sums[i] = [s + x for s, x in zip(sums.get(i, [0.0, 0.0]), g)]
                touched.add(i)
        for i in touched:
            counts[i] = counts.get(i, 0) + 1
    cmd = merge(reqs, {"e": mode, "w": mode}, now=0.0)
    if not sums and not any(r.rows for r in reqs):
        assert cmd.rows == ()
    else:
        (rows,) = cmd.rows
        assert rows.ids.tolist() == sorted(sums)
        assert rows.counts.tolist() == [counts[i] for i in sorted(sums)]
        want = [[s / (counts[i] if mode == "mean" else 1) for s in sums[i]] for i in sorted(sums)]
        np.testing.assert_allclose(rows.grads.reshape(-1, 2), np.array(want).reshape(-1, 2), rtol=1e-15)
    dense_counts = {}
    for r in reqs:
        for _, b, _ in r.dense:
            dense_counts[b] = dense_counts.get(b, 0) + 1
    assert {d.block: d.count for d in cmd.dense} == dense_counts


def test_content_digest_tells_contents_apart_and_old_crc_digests_are_not_compared():
    from kvps.merge import comparable_digests, content_digest

    g = np.arange(6, dtype=np.float32)
    base = content_digest((("w", 0, g),), ())
    assert base == content_digest((("w", 0, g.copy()),), ())  # content, not identity
    changed = g.copy()
    changed[5] = np.nextafter(changed[5], np.float32(10))  # one bit of one gradient
    others = [content_digest((("w", 0, changed),), ()), content_digest((("w", 1, g),), ()),
              content_digest((("v", 0, g),), ()),
              content_digest((), (("w", np.int64([0]), g.reshape(1, 6)),))]
    assert base not in others and len(set(others)) == len(others)
    assert comparable_digests(base, others[0])
    crc_era = 0xDEADBEEF + 1  # what an applied table written by an older kvps holds
    assert not comparable_digests(base, crc_era) and comparable_digests(crc_era, crc_era + 1)
    bytes_era = (2 << 32) | 0xDEADBEEF  # XXH3 over the gradient bytes (kvps before 2026-12-07)
    assert not comparable_digests(base, bytes_era) and comparable_digests(bytes_era, bytes_era + 1)
    assert not comparable_digests(bytes_era, crc_era)
    assert not comparable_digests(base, 0)


def test_content_digest_of_a_received_gradient_uses_its_checked_sum_and_equals_the_computed_one():
    """A raw gradient of 64 KiB or more decoded from a request frame was checked against its XXH3
    sum; the digest takes that sum instead of reading the bytes again, and comes out as if it had."""
    from kvps.delta import frame
    from kvps.merge import content_digest

    g = np.random.default_rng(3).standard_normal(1 << 15).astype(np.float32)  # 128 KiB
    decoded = frame.decode(frame.encode(frame.KIND_REQUEST, {}, [g])).arrays[0]
    assert not decoded.flags.writeable and decoded.nbytes >= 64 << 10
    assert content_digest((("w", 0, decoded),), ()) == content_digest((("w", 0, g.copy()),), ())
    changed = g.copy()
    changed[-1] += 1
    assert content_digest((("w", 0, decoded),), ()) != content_digest((("w", 0, changed),), ())
    # the sum is the frame's: a remembered sum that were wrong would show here
    assert frame.array_checksum(decoded) == frame.array_checksum(g) == frame.array_checksum(g.copy())
