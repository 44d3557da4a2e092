"""Placement is stable (pinned values) and layouts cover every row exactly once."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvps.errors import InvalidRequest
from kvps.placement import DenseLayout, block_shard, dtype_name, key_hash, layout_for, row_shards


def test_key_hash_definition_and_golden():
    assert key_hash("w") == int.from_bytes(hashlib.blake2b(b"w", digest_size=8).digest(), "little")
    assert key_hash("w") == 2347026877809978270
    assert key_hash("layer.0.weight") == 11068812338584882928


def test_golden_shards():
    """Pinned: changing these moves every key of every existing cluster."""
    assert [block_shard("w", b, 8) for b in range(8)] == [3, 6, 1, 4, 7, 3, 2, 2]
    ids = np.array([0, 1, 2, 3, -1, 2**62], dtype=np.int64)
    assert row_shards("emb", ids, 16).tolist() == [4, 4, 8, 6, 10, 8]


def test_row_shards_vectorised_and_in_range():
    ids = np.arange(-500, 500, dtype=np.int64)
    shards = row_shards("emb", ids, 7)
    assert shards.dtype == np.int64 and shards.shape == ids.shape
    assert shards.min() >= 0 and shards.max() < 7
    assert [int(row_shards("emb", np.array([i]), 7)[0]) for i in ids[:50].tolist()] == shards[:50].tolist()
    assert np.bincount(shards).min() > 100  # spread, roughly even
    assert row_shards("emb", np.array([], np.int64), 3).shape == (0,)
    assert row_shards("emb", ids.astype(np.int32), 7).tolist() == shards.tolist()


def test_block_shards_spread():
    counts = np.bincount([block_shard(f"key{k}", b, 8) for k in range(50) for b in range(20)], minlength=8)
    assert counts.min() > 80


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_shard_counts(bad):
    with pytest.raises(InvalidRequest):
        block_shard("w", 0, bad)
    with pytest.raises(InvalidRequest):
        row_shards("w", np.array([1]), bad)


def test_row_ids_must_be_integers():
    with pytest.raises(InvalidRequest):
        row_shards("w", np.array([1.0]), 4)


@pytest.mark.parametrize("shape,dtype,block_bytes,rows,n_blocks", [
    ((10, 4), "float32", 48, 3, 4),  # 16 bytes a row: 3 rows a block, last block 1 row
    ((10, 4), "float32", 10, 1, 10),  # a row bigger than a block: one row a block
    ((8,), "float64", 64, 8, 1),
    ((), "float32", 1024, 1, 1),  # 0-d: one block holding the scalar
    ((0, 3), "float32", 1024, 85, 1),  # empty: one empty block
    ((5, 0), "float32", 1024, 5, 1),  # zero-byte rows: one block
])
def test_layout_for(shape, dtype, block_bytes, rows, n_blocks):
    lay = layout_for(shape, dtype, block_bytes)
    assert (lay.block_rows, lay.n_blocks) == (rows, n_blocks)
    value = np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape)
    blocks = [lay.block(value, i) for i in range(lay.n_blocks)]
    assert [b.shape for b in blocks] == [lay.block_shape(i) for i in range(lay.n_blocks)]
    assert np.array_equal(lay.assemble(blocks), value) and lay.assemble(blocks).shape == value.shape


def test_block_slices_cover_dim0_once():
    lay = DenseLayout((17, 2), "float32", 5)
    slices = [lay.block_slice(i) for i in range(lay.n_blocks)]
    assert slices == [slice(0, 5), slice(5, 10), slice(10, 15), slice(15, 17)]
    assert lay.block_shape(3) == (2, 2)
    assert DenseLayout((), "float64", 1).block_shape(0) == ()
    with pytest.raises(InvalidRequest):
        lay.block_slice(4)


@pytest.mark.parametrize("shape,dtype,block_rows", [((-1,), "float32", 1), ((2,), "int32", 1),
                                                    ((2.0,), "float32", 1), ((2,), "bogus", 1),
                                                    ((2,), "float32", 0)])
def test_layout_validation(shape, dtype, block_rows):
    with pytest.raises(InvalidRequest):
        DenseLayout(shape, dtype, block_rows)
    with pytest.raises(InvalidRequest):  # block_bytes 0 stands in for block_rows 0
        layout_for(shape, dtype, 1024 if block_rows else 0)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=40), st.integers(-2**63, 2**63 - 1), st.integers(1, 1000))
def test_block_shard_in_scalar_arithmetic_is_the_vectorised_rule(key, block, shards):
    """``block_shard`` computes in Python ints; the rule is ``_shards``'s numpy one (rows use it)."""
    from kvps.placement import _BLOCK_SALT, _shards

    assert block_shard(key, block, shards) == int(_shards(key, np.array([block], np.int64), _BLOCK_SALT, shards)[0])


def test_layouts_are_cached_but_never_for_look_alike_arguments():
    """``layout_for`` remembers layouts (10,000 keys of one shape); 1, 1.0 and True are one cache
    key, so what the cache returns for exact ints must not be returned for the others."""
    good = layout_for((4, 3), "float32", 16)
    assert layout_for((4, 3), "float32", 16) is good and layout_for([4, 3], "float32", 16) is good
    for shape, block_bytes in (((4, 3), True), ((4.0, 3), 16), ((4, True), 16)):
        with pytest.raises(InvalidRequest):
            layout_for(shape, "float32", block_bytes)
    assert layout_for((4, 3), np.dtype("float32"), 16) == good  # a dtype, not its name: not cached
    assert dtype_name(np.dtype("float16")) == "float16" and dtype_name(np.zeros(1).dtype) == "float64"
