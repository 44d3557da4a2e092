"""Exact XOR deltas, incremental row pulls and lossy push codecs (pure parts: no cluster)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kvps.delta import frame
from kvps.delta.xor import apply_xor, xor_delta
from kvps.replica.history import BlockHistory
from kvps_client._lossy import LossyEncoder, bf16_round, bf16_widen
from kvps_client._rows import RowCache

FLOATS = [np.float16, np.float32, np.float64]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(FLOATS).flatmap(
    lambda dt: st.tuples(*[hnp.arrays(dt, st.just((7, 3)), elements=st.floats(allow_nan=True, width=np.dtype(dt).itemsize * 8))] * 2)))
def test_xor_delta_reconstructs_bit_exact_through_a_frame(pair):
    old, new = pair
    delta = xor_delta(new, old)
    wire = frame.decode(frame.encode(frame.KIND_RESPONSE, {}, [delta], codec="shuffle-lz4")).arrays[0]
    got = apply_xor(old, wire)
    assert got.dtype == new.dtype and got.tobytes() == new.tobytes()  # NaN payloads included


def test_xor_of_one_sgd_step_compresses_where_weights_do_not():
    """One SGD step that moves weights by ~0.2 % of their size (lr x grad = 1e-4, |w| ~ 0.05):
    the XOR keeps sign, exponent and top mantissa bits zero, which shuffle + lz4 removes."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal(1 << 18) * 0.05).astype(np.float32)
    w2 = (w - np.float32(1e-4) * rng.standard_normal(w.size).astype(np.float32)).astype(np.float32)
    raw = len(frame.encode(frame.KIND_RESPONSE, {}, [w2]))
    full = len(frame.encode(frame.KIND_RESPONSE, {}, [w2], codec="shuffle-lz4"))
    delta = len(frame.encode(frame.KIND_RESPONSE, {}, [xor_delta(w2, w)], codec="shuffle-lz4"))
    assert raw / delta >= 1.3 and delta < full


def test_history_is_bounded_by_depth_and_bytes():
    h = BlockHistory(depth=2, max_bytes=3 * 400)
    a = [np.full(100, i, np.float32) for i in range(5)]  # 400 bytes each
    for v in range(3):
        h.add("k", 0, v, a[v])
    assert h.get("k", 0, 0) is None and h.get("k", 0, 2) is a[2]  # depth 2
    h.add("j", 0, 0, a[3])
    h.add("j", 0, 1, a[4])                                       # 4 entries > 3 x 400 bytes
    assert h.nbytes <= 1200 and h.get("k", 0, 1) is None and h.get("j", 0, 1) is a[4]
    h.drop_key("j")
    assert h.get("j", 0, 1) is None and h.nbytes == 400


def test_row_cache_inserts_updates_and_reports_versions():
    c = RowCache(2, np.dtype(np.float32))
    c.update(np.array([5, 9]), np.array([1, 1]), np.ones((2, 2), np.float32))
    assert c.have(np.array([1, 5, 9])).tolist() == [-1, 1, 1]
    c.update(np.array([1, 9]), np.array([0, 2]), np.array([[7, 7], [3, 3]], np.float32))
    assert c.ids.tolist() == [1, 5, 9] and c.versions.tolist() == [0, 1, 2]
    np.testing.assert_array_equal(c.rows(np.array([1, 9])), [[7, 7], [3, 3]])
    with pytest.raises(KeyError):
        c.rows(np.array([2]))


# ---- lossy codecs: stated bounds, and error feedback loses nothing for good -----------------------

_grads = hnp.arrays(np.float32, st.integers(1, 300),
                    elements=st.floats(-1e4, 1e4, width=32).filter(lambda x: x == 0 or abs(x) > 1e-3))


@settings(max_examples=200, deadline=None)
@given(_grads)
def test_fp16_and_bf16_per_step_error_bounds(g):
    for spec, bound in (("fp16", 2.0 ** -11), ("bf16", 2.0 ** -8)):
        enc = LossyEncoder(spec)
        fields, arrays, pending = enc.encode("k", 0, g)
        enc.commit([pending])
        sent = arrays[0].astype(np.float32) if spec == "fp16" else bf16_widen(arrays[0].array)
        assert fields == {"encoding": spec}
        np.testing.assert_array_less(np.abs(sent - g), bound * np.abs(g) + 1e-30)
        np.testing.assert_allclose(enc.residual[("k", 0)], g - sent)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(["fp16", "bf16", "topk:0.1", "topk:0.01"]), st.integers(0, 2**32 - 1))
def test_error_feedback_sum_of_sent_tracks_sum_of_true_gradients(spec, seed):
    rng = np.random.default_rng(seed)
    enc = LossyEncoder(spec)
    true_sum = np.zeros(500, np.float64)
    sent_sum = np.zeros(500, np.float64)
    for _ in range(30):
        g = rng.standard_normal(500).astype(np.float32)
        fields, arrays, pending = enc.encode("k", 0, g)
        enc.commit([pending])
        if spec.startswith("topk"):
            values, idx = arrays
            assert len(idx) == max(1, int(np.ceil(float(spec[5:]) * 500)))
            sent = np.zeros(500, np.float32)
            sent[idx] = values
        else:
            sent = arrays[0].astype(np.float32) if spec == "fp16" else bf16_widen(arrays[0].array)
        true_sum += g
        sent_sum += sent
    # everything not yet sent is exactly the residual (up to float32 rounding of the sums)
    np.testing.assert_allclose(sent_sum + enc.residual[("k", 0)], true_sum, rtol=0, atol=1e-3)


def test_fp16_never_stores_a_non_finite_residual():
    """A value beyond fp16's range used to be sent as inf (the server refused it) and leave -inf
    in the residual, so every later push of the block was refused too."""
    enc = LossyEncoder("fp16")
    g = np.array([1.0, 1e5, -3.0], np.float32)  # 1e5 > 65504
    fields, arrays, pending = enc.encode("k", 0, g)
    assert fields == {} and arrays[0].dtype == np.float32 and arrays[0].tolist() == g.tolist()
    enc.commit([pending])
    assert np.isfinite(enc.residual[("k", 0)]).all() and not enc.residual[("k", 0)].any()
    fields, arrays, _ = enc.encode("k", 0, np.ones(3, np.float32))  # the next push is fp16 again
    assert fields == {"encoding": "fp16"} and arrays[0].dtype == np.float16
    bad = np.array([np.nan, 1.0, 2.0], np.float32)  # the user's NaN: sent as is, no residual kept
    fields, arrays, pending = LossyEncoder("bf16").encode("k", 0, bad)
    assert fields == {} and pending[3] is None
    huge = np.array([3.4e38], np.float32)  # rounds to inf in bf16: sent exactly instead
    assert LossyEncoder("bf16").encode("k", 0, huge)[0] == {}


def test_residual_is_stored_on_acknowledgement_and_put_back_on_failure():
    enc = LossyEncoder("fp16")
    g = np.full(4, 1.0 + 2**-13, np.float32)  # not representable in fp16: leaves a residual
    *_, first = enc.encode("k", 0, g)
    assert ("k", 0) not in enc.residual  # nothing stored while the push is in flight
    enc.commit([first])
    kept = enc.residual[("k", 0)].copy()
    assert kept.any()
    *_, second = enc.encode("k", 0, g)  # takes the residual out ...
    assert ("k", 0) not in enc.residual
    enc.abandon([second])  # ... and the failed push puts it back unchanged
    np.testing.assert_array_equal(enc.residual[("k", 0)], kept)


def test_bf16_rounds_to_nearest_even():
    x = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -2.5], np.float32)
    assert bf16_widen(bf16_round(x)).tolist() == [1.0, 1.0, 1.0 + 2**-6, -2.5]


def test_bad_lossy_specs_are_refused():
    from kvps.errors import InvalidRequest
    for spec in ("fp8", "topk:0", "topk:2", "topk:x"):
        with pytest.raises(InvalidRequest):
            LossyEncoder(spec)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 9)), max_size=12), max_size=8))
def test_row_cache_matches_a_dict_reference(batches):
    """The fast path (sorted arrays, searchsorted) agrees with a plain dict model."""
    cache, model = RowCache(3, np.dtype(np.float32)), {}
    for batch in batches:
        latest = dict(batch)                                  # one version per id in a batch
        ids = np.array(sorted(latest), dtype=np.int64)
        versions = np.array([latest[i] for i in ids], dtype=np.int64)
        values = np.repeat(versions[:, None], 3, axis=1).astype(np.float32) + ids[:, None]
        cache.update(ids, versions, values)
        model.update({int(i): int(v) for i, v in zip(ids, versions)})
        probe = np.arange(0, 42, dtype=np.int64)
        assert cache.have(probe).tolist() == [model.get(int(i), -1) for i in probe]
        held = np.array(sorted(model), dtype=np.int64)
        if len(held):
            rows = cache.rows(held)
            assert rows[:, 0].tolist() == [model[int(i)] + int(i) for i in held]
