"""Lossless codecs: shuffle layout against a plain-loop reference, bit-exact round trips."""
from __future__ import annotations

import lz4.block
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvps.delta.codec import (
    CODEC_LZ4,
    CODEC_NONE,
    CODEC_SHUFFLE_LZ4,
    compress,
    decompress,
    shuffle,
    unshuffle,
)
from kvps.errors import CodecError

ITEMSIZES = st.sampled_from([1, 2, 4, 8])


def shuffle_reference(buf: bytes, itemsize: int) -> bytes:
    """The dumb definition: plane k holds byte k of every element, in element order."""
    n = len(buf) // itemsize
    return bytes(buf[i * itemsize + k] for k in range(itemsize) for i in range(n))


@st.composite
def item_buffers(draw):
    itemsize = draw(ITEMSIZES)
    n = draw(st.integers(0, 40))
    return draw(st.binary(min_size=n * itemsize, max_size=n * itemsize)), itemsize


@settings(max_examples=300, deadline=None)
@given(item_buffers())
def test_shuffle_matches_reference_and_unshuffle_inverts_it(case):
    buf, itemsize = case
    shuffled = shuffle(buf, itemsize)
    assert shuffled == shuffle_reference(buf, itemsize)
    assert unshuffle(shuffled, itemsize) == buf


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_shuffle_round_trip_on_buffers_past_the_small_cutoff(itemsize):
    """Big buffers take the word-shift unshuffle path; the small hypothesis cases do not."""
    buf = np.random.default_rng(itemsize).bytes((1 << 17) + 3 * itemsize)
    shuffled = shuffle(buf, itemsize)
    assert shuffled == np.frombuffer(buf, np.uint8).reshape(-1, itemsize).T.tobytes()
    assert unshuffle(shuffled, itemsize) == buf


def test_shuffle_known_layout():
    assert shuffle(bytes(range(8)), 4) == bytes([0, 4, 1, 5, 2, 6, 3, 7])
    assert unshuffle(bytes([0, 4, 1, 5, 2, 6, 3, 7]), 4) == bytes(range(8))


@pytest.mark.parametrize("fn", [shuffle, unshuffle])
@pytest.mark.parametrize("size, itemsize", [(7, 4), (3, 2), (4, 0)])
def test_shuffle_refuses_partial_items(fn, size, itemsize):
    with pytest.raises(CodecError):
        fn(bytes(size), itemsize)


DTYPES = ["<f4", "<f8", "<f2", "<u2", "<i4", "<i8", "u1"]


@st.composite
def arrays(draw):
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    n = draw(st.integers(0, 300))
    raw = draw(st.binary(min_size=n * dtype.itemsize, max_size=n * dtype.itemsize)
               | st.just(bytes(n * dtype.itemsize)))  # incompressible and very compressible
    return np.frombuffer(raw, dtype=dtype)


@settings(max_examples=300, deadline=None)
@given(arr=arrays(), codec=st.sampled_from(["none", "lz4", "shuffle-lz4", "auto"]))
def test_compress_decompress_round_trip_is_bit_exact(arr, codec):
    code, wire = compress(arr, codec)
    assert bytes(decompress(code, wire, arr.nbytes, arr.itemsize)) == arr.tobytes()
    if arr.nbytes == 0:
        assert code == CODEC_NONE and len(wire) == 0
    elif codec == "auto":
        assert code in (CODEC_NONE, CODEC_SHUFFLE_LZ4)
        assert code == CODEC_NONE or len(wire) * 20 <= arr.nbytes * 19


def test_wire_formats_are_plain_lz4_blocks():
    """Pins the wire: lz4 block without a size prefix; shuffle-lz4 compresses the shuffled bytes."""
    arr = np.linspace(0, 1, 1000, dtype=np.float32)
    assert compress(arr, "lz4") == (CODEC_LZ4, lz4.block.compress(arr.tobytes(), store_size=False))
    shuffled = shuffle_reference(arr.tobytes(), 4)
    assert compress(arr, "shuffle-lz4") == (CODEC_SHUFFLE_LZ4, lz4.block.compress(shuffled, store_size=False))


def test_none_is_zero_copy_both_ways():
    arr = np.arange(100, dtype=np.int64)
    code, wire = compress(arr, "none")
    assert code == CODEC_NONE and np.shares_memory(np.frombuffer(wire, np.uint8), arr)
    assert decompress(CODEC_NONE, wire, arr.nbytes, 8) is wire


def test_auto_choice():
    assert compress(np.zeros(1000, np.float32), "auto")[0] == CODEC_SHUFFLE_LZ4
    noise = np.frombuffer(np.random.default_rng(1).bytes(4000), np.float32)
    assert compress(noise, "auto")[0] == CODEC_NONE


def test_shuffle_helps_smooth_floats():
    weights = (np.random.default_rng(2).standard_normal(50_000) * 0.05).astype(np.float32)
    assert len(compress(weights, "shuffle-lz4")[1]) < len(compress(weights, "lz4")[1])


@pytest.mark.parametrize(
    "code, wire, raw_size",
    [
        (CODEC_NONE, b"abc", 4),  # raw buffer of the wrong length
        (3, b"abc", 3),  # unknown codec code
        (CODEC_LZ4, b"\xff\xff\xff", 3),  # corrupt stream
        (CODEC_LZ4, lz4.block.compress(bytes(100), store_size=False), 99),  # stream longer than declared
        (CODEC_LZ4, lz4.block.compress(bytes(100), store_size=False), 101),  # shorter
        (CODEC_LZ4, b"\x00" * 4, 255 * 4 + 1),  # more than lz4 can ever expand to
        (CODEC_SHUFFLE_LZ4, lz4.block.compress(bytes(6), store_size=False), 6),  # not whole 4-byte items
    ],
)
def test_decompress_refusals(code, wire, raw_size):
    with pytest.raises(CodecError):
        decompress(code, wire, raw_size, 4)


def test_compress_refuses_unknown_codec():
    with pytest.raises(CodecError):
        compress(np.zeros(4), "zstd")
