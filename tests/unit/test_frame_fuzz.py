"""Decoder robustness: every malformed input is a CodecError, never another exception, a hang,
or an allocation beyond the declared cap."""
from __future__ import annotations

import struct
import tracemalloc
import zlib

import lz4.block
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvps.delta.frame import KIND_COMMAND, Bf16, Frame, decode, encode
from kvps.errors import CodecError

MiB = 2**20


def _valid_frames() -> list[bytes]:
    arrays = [
        np.linspace(-1, 1, 40, dtype=np.float32).reshape(5, 8),
        np.arange(6, dtype=np.int64),
        np.array(True),
        Bf16(np.arange(3, dtype=np.uint16)),
        np.zeros((0, 4), np.float16),
    ]
    return [encode(KIND_COMMAND, {"type": "push", "n": [1, 2]}, arrays, codec=c)
            for c in ("none", "lz4", "shuffle-lz4")]


VALID = _valid_frames()


def forge(descrs, payload: bytes, *, meta: bytes = b"{}", kind: int = 1, version: int = 1,
          flags: int = 0, magic: bytes = b"KVPF", n_arrays: int | None = None) -> bytes:
    """A frame with arbitrary descriptors and a *correct* header CRC, so that the check under
    test (not the checksum) is what must reject it. descr: (dtype, codec, crc|None, raw, wire, dims)."""
    parts = []
    for dtype, codec, crc, raw, wire, dims in descrs:
        crc = zlib.crc32(payload) if crc is None else crc
        parts.append(struct.pack("<BBBxIQQ", dtype, codec, len(dims), crc, raw, wire))
        parts.append(struct.pack(f"<{len(dims)}Q", *dims))
    descr = b"".join(parts)
    count = len(descrs) if n_arrays is None else n_arrays
    header = struct.pack("<4sBBHIII", magic, version, kind, flags, len(meta), count, zlib.crc32(meta + descr))
    return header + meta + descr + payload


def assert_rejected(data, **kwargs) -> None:
    with pytest.raises(CodecError):
        decode(data, **kwargs)


def test_forge_helper_builds_valid_frames():
    payload = np.arange(4, dtype="<f4").tobytes()
    got = decode(forge([(1, 0, None, 16, 16, (2, 2))], payload))
    assert got.arrays[0].tolist() == [[0, 1], [2, 3]]


# ------------------------------------------------------------------------------- truncation, flips


@pytest.mark.parametrize("index", range(len(VALID)))
def test_every_truncation_and_extension_is_rejected(index):
    data = VALID[index]
    for cut in range(len(data)):
        assert_rejected(data[:cut])
    assert_rejected(data + b"\x00")


@pytest.mark.parametrize("index", range(len(VALID)))
def test_every_single_byte_flip_is_detected(index):
    # The header CRC covers meta + descriptors only (as specified), so a flip of the kind byte to
    # another valid kind is caught by the caller's ``kinds`` filter, not by the checksum.
    data = VALID[index]
    for pos in range(len(data)):
        for mask in (0x01, 0x80, 0xFF):
            flipped = bytearray(data)
            flipped[pos] ^= mask
            assert_rejected(bytes(flipped), kinds={KIND_COMMAND})


# ------------------------------------------------------------------------------- header fields


@pytest.mark.parametrize(
    "overrides",
    [
        {"magic": b"KVPG"}, {"version": 0}, {"version": 2}, {"version": 255},
        {"kind": 0}, {"kind": 5}, {"kind": 255}, {"flags": 1}, {"flags": 0x8000},
        {"n_arrays": 2}, {"n_arrays": 2**32 - 1},
    ],
)
def test_bad_header_fields(overrides):
    payload = bytes(8)
    assert_rejected(forge([(5, 0, None, 8, 8, (2,))], payload, **overrides))


def test_huge_meta_len_is_refused():
    header = struct.pack("<4sBBHIII", b"KVPF", 1, 1, 0, 2**32 - 1, 0, 0)
    assert_rejected(header + b"{}")


@pytest.mark.parametrize(
    "meta",
    [b"[]", b'"x"', b"1", b"null", b"{", b'{"a":NaN}', b'{"a":Infinity}', b"\xff\xfe{}",
     b'{"a":1}x', b"[" * 100_000 + b"]" * 100_000, b'{"a":' + b"9" * 5000 + b"}"],
)
def test_bad_meta(meta):
    assert_rejected(forge([], b"", meta=meta))


# ------------------------------------------------------------------------------- descriptors


@pytest.mark.parametrize(
    "descr, payload",
    [
        ((0, 0, None, 4, 4, (1,)), bytes(4)),  # dtype code 0
        ((9, 0, None, 4, 4, (4,)), bytes(4)),  # dtype code 9
        ((255, 0, None, 4, 4, (4,)), bytes(4)),
        ((1, 3, None, 4, 4, (1,)), bytes(4)),  # codec code 3
        ((1, 255, None, 4, 4, (1,)), bytes(4)),
        ((1, 0, None, 8, 8, (3,)), bytes(8)),  # shape says 12 bytes, raw says 8
        ((1, 0, None, 12, 8, (3,)), bytes(8)),  # raw codec, wire != raw
        ((1, 0, None, 8, 9, (2,)), bytes(8)),  # wire_size longer than the payload
        ((1, 0, None, 8, 7, (2,)), bytes(8)),  # wire_size shorter than the payload
        ((1, 0, None, 2**64 - 4, 2**64 - 4, (2**62 - 1,)), bytes(8)),  # consistent but absurd
        ((1, 0, None, 8, 8, (2**64 - 1, 2**64 - 1)), bytes(8)),  # dims overflow 2**64
        ((1, 0, None, 0, 0, (0, 2**64 - 1)), b""),  # empty but unrepresentable
        ((2, 0, None, 0, 0, (0, 2**61)), b""),  # empty, span 2**64 bytes
        ((1, 0, None, 0, 0, (0,) * 33), b""),  # ndim over the cap
        ((1, 0, 12345, 8, 8, (2,)), bytes(8)),  # payload CRC mismatch
        ((8, 0, None, 3, 3, (3,)), b"\x00\x01\x02"),  # bool byte 2
    ],
)
def test_forged_descriptors(descr, payload):
    assert_rejected(forge([descr], payload))


def test_forged_second_descriptor_after_a_valid_one():
    good = np.arange(2, dtype="<f4").tobytes()
    data = forge([(1, 0, None, 8, 8, (2,)), (1, 0, None, 8, 8, (3,))], good + good)
    assert_rejected(data)


# ------------------------------------------------------------------------------- bombs and caps


def _peak_while(fn) -> int:
    tracemalloc.start()
    try:
        fn()
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return peak


def _refused(data, **kwargs):
    def run():
        with pytest.raises(CodecError):
            decode(data, **kwargs)

    return run


def test_2gib_declared_with_1mib_cap_is_refused_without_allocating():
    payload = bytes(64)
    data = forge([(7, 0, None, 2 * 1024 * MiB, 2 * 1024 * MiB, (2 * 1024 * MiB,))], payload)
    assert _peak_while(_refused(data, max_raw_bytes=MiB)) < 64 * 1024


def test_lz4_bomb_over_the_cap_is_refused_before_decompressing():
    wire = lz4.block.compress(bytes(64 * MiB), store_size=False)  # ~250 KiB of stream
    data = forge([(7, 1, None, 64 * MiB, len(wire), (64 * MiB,))], wire)
    assert _peak_while(_refused(data, max_raw_bytes=MiB)) < 64 * 1024
    assert decode(data, max_raw_bytes=64 * MiB).arrays[0].size == 64 * MiB  # honest under a big cap


def test_lz4_declaring_more_than_lz4_can_expand_is_refused_before_allocating():
    wire = lz4.block.compress(bytes(1000), store_size=False)
    data = forge([(7, 1, None, 100 * MiB, len(wire), (100 * MiB,))], wire)
    assert _peak_while(_refused(data)) < 64 * 1024


@pytest.mark.parametrize("declared", [999, 10, 1])
def test_lz4_stream_longer_than_declared_is_refused(declared):
    wire = lz4.block.compress(bytes(1000), store_size=False)
    data = forge([(7, 1, None, declared, len(wire), (declared,))], wire)
    assert _peak_while(_refused(data)) < 64 * 1024


def test_shape_mismatch_is_refused_before_decompressing():
    wire = lz4.block.compress(bytes(64 * MiB), store_size=False)
    data = forge([(7, 1, None, 64 * MiB, len(wire), (64 * MiB - 1,))], wire)
    assert _peak_while(_refused(data)) < 64 * 1024


def test_lz4_stream_shorter_than_declared_is_refused():
    wire = lz4.block.compress(bytes(1000), store_size=False)
    assert_rejected(forge([(7, 1, None, 1001, len(wire), (1001,))], wire))
    assert_rejected(forge([(1, 2, None, 1004, len(wire), (251,))], wire))


def test_raw_cap_sums_over_arrays():
    payload = bytes(600)
    data = forge([(7, 0, zlib.crc32(payload[:300]), 300, 300, (300,)),
                  (7, 0, zlib.crc32(payload[300:]), 300, 300, (300,))], payload)
    assert len(decode(data, max_raw_bytes=600).arrays) == 2
    assert_rejected(data, max_raw_bytes=599)


# ------------------------------------------------------------------------------- garbage


@pytest.mark.parametrize("data", ["KVPF", None, 12, 1.5, [1, 2], memoryview(bytes(64))[::2]])
def test_non_bytes_input(data):
    assert_rejected(data)


def test_buffer_of_another_format_is_read_as_bytes():
    assert_rejected(np.zeros(8, np.float64))  # a valid buffer, garbage content


def _only_codec_error(data) -> None:
    try:
        assert isinstance(decode(data), Frame)
    except CodecError:
        pass


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_random_garbage(data):
    _only_codec_error(data)
    _only_codec_error(b"KVPF\x01\x01\x00\x00" + data)


@settings(max_examples=1500, deadline=None)
@given(index=st.integers(0, len(VALID) - 1),
       edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=8),
       cut=st.integers(0, 10**6))
def test_random_mutations_of_valid_frames(index, edits, cut):
    data = bytearray(VALID[index])
    for pos, value in edits:
        data[pos % len(data)] = value
    _only_codec_error(bytes(data))
    _only_codec_error(bytes(data[: cut % (len(data) + 1)]))


@settings(max_examples=500, deadline=None)
@given(meta=st.binary(max_size=60), dims=st.lists(st.integers(0, 2**64 - 1), max_size=4),
       dtype=st.integers(0, 9), codec=st.integers(0, 3), raw=st.integers(0, 2**64 - 1),
       payload=st.binary(max_size=64))
def test_random_forged_frames_with_valid_checksums(meta, dims, dtype, codec, raw, payload):
    """Past the checksums, only the semantic checks stand between the input and numpy/lz4."""
    _only_codec_error(forge([(dtype, codec, None, raw, len(payload), tuple(dims))], payload, meta=meta))
