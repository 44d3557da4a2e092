"""Frame format: bit-exact round trips, determinism, the documented layout, golden files.

Regenerate the golden files (only after a deliberate format change, with a new version):
    KVPS_REGEN_GOLDEN=1 .venv/bin/pytest tests/unit/test_frame.py -k golden
"""
from __future__ import annotations

import ast
import json
import os
import pathlib
import struct
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kvps.delta import frame
from kvps.delta.frame import (
    FLAG_XXH3,
    KIND_COMMAND,
    KIND_REQUEST,
    KIND_RESPONSE,
    KIND_SNAPSHOT,
    Bf16,
    decode,
    encode,
    encode_parts,
)
from kvps.errors import CodecError

CODECS = ["none", "lz4", "shuffle-lz4", "auto"]
DTYPES = ["<f4", "<f8", "<f2", "<i4", "<i8", "u1", "?", "bf16"]
GOLDEN = pathlib.Path(__file__).parent / "golden"

# ------------------------------------------------------------------------------- strategies


@st.composite
def input_arrays(draw):
    """(input given to encode, expected decoded array): any bits, any layout, any byte order."""
    name = draw(st.sampled_from(DTYPES))
    dtype = np.dtype("<u2" if name == "bf16" else name)
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5))
    count = int(np.prod(shape))
    if dtype.kind == "b":
        base = draw(hnp.arrays(dtype, shape))
    else:  # arbitrary bit patterns: NaN payloads, -0.0, subnormals, inf
        base = np.frombuffer(draw(st.binary(min_size=count * dtype.itemsize, max_size=count * dtype.itemsize)),
                             dtype=dtype).reshape(shape)
    layout = draw(st.sampled_from(["contiguous", "transpose", "step", "reverse"]))
    if layout == "transpose":
        view = base.T
    elif layout == "step" and base.ndim:
        view = np.repeat(base, 2, axis=0)[::2]  # same values, stride doubled
    elif layout == "reverse" and base.ndim:
        view = base[::-1]
    else:
        view = base
    expected = view.copy(order="C")  # an element-wise memcpy: bit-exact reference
    given_arr = view
    if draw(st.booleans()) and dtype.itemsize > 1:  # big-endian input, same bits
        given_arr = view.byteswap().view(dtype.newbyteorder(">"))
    return (Bf16(given_arr) if name == "bf16" else given_arr), expected


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
metas = st.dictionaries(st.text(max_size=8), json_values, max_size=5)
kinds = st.sampled_from([KIND_REQUEST, KIND_RESPONSE, KIND_COMMAND, KIND_SNAPSHOT])


def assert_bit_exact(got: np.ndarray, expected: np.ndarray) -> None:
    assert got.dtype == expected.dtype.newbyteorder("<")
    assert got.shape == expected.shape
    assert got.flags.c_contiguous
    assert got.tobytes() == expected.tobytes()


# ------------------------------------------------------------------------------- round trips


@settings(max_examples=400, deadline=None)
@given(kind=kinds, meta=metas, pairs=st.lists(input_arrays(), max_size=4), codec=st.sampled_from(CODECS))
def test_round_trip_is_bit_exact(kind, meta, pairs, codec):
    data = encode(kind, meta, [given_arr for given_arr, _ in pairs], codec=codec)
    got = decode(data)
    assert got.kind == kind
    assert got.meta == meta
    assert len(got.arrays) == len(pairs)
    for arr, (_, expected) in zip(got.arrays, pairs, strict=True):
        assert_bit_exact(arr, expected)
        assert not arr.flags.writeable


@settings(max_examples=200, deadline=None)
@given(meta=metas, pairs=st.lists(input_arrays(), max_size=3), codec=st.sampled_from(CODECS))
def test_encoding_is_deterministic_and_layout_independent(meta, pairs, codec):
    given_arrays = [given_arr for given_arr, _ in pairs]
    canonical = [Bf16(e) if isinstance(g, Bf16) else e for g, e in pairs]  # contiguous little-endian
    shuffled_meta = dict(reversed(list(meta.items())))
    data = encode(KIND_COMMAND, meta, given_arrays, codec=codec)
    assert data == encode(KIND_COMMAND, meta, given_arrays, codec=codec)
    assert data == encode(KIND_COMMAND, shuffled_meta, canonical, codec=codec)
    assert data == b"".join(encode_parts(KIND_COMMAND, meta, given_arrays, codec=codec))


@pytest.mark.parametrize("codec", CODECS)
def test_large_arrays_of_every_dtype_round_trip(codec):
    rng = np.random.default_rng(3)
    arrays = [np.frombuffer(rng.bytes(70_001 * np.dtype(d).itemsize), d).reshape(70_001, 1)
              for d in ["<f4", "<f8", "<f2", "<i4", "<i8", "u1"]]
    arrays += [rng.integers(0, 2, 70_001).astype(bool), (np.arange(70_001, dtype="<f4") * 1e-3)]
    given_arrays = arrays + [Bf16(np.frombuffer(rng.bytes(2 * 70_001), "<u2"))]
    got = decode(encode(KIND_SNAPSHOT, {}, given_arrays, codec=codec)).arrays
    for arr, want in zip(got, arrays + [given_arrays[-1].array], strict=True):
        assert_bit_exact(arr, want)


def test_numpy_scalar_zero_d_and_empty_arrays():
    arrays = [np.float64(2.5), np.array(7, dtype=np.int32), np.zeros((0,), np.float32),
              np.zeros((3, 0, 2), np.int64), np.zeros((0,), bool)]
    for codec in CODECS:
        got = decode(encode(KIND_RESPONSE, {}, arrays, codec=codec)).arrays
        assert [a.shape for a in got] == [(), (), (0,), (3, 0, 2), (0,)]
        assert got[0][()] == 2.5 and got[1][()] == 7


def test_bf16_decodes_to_uint16_words():
    words = np.array([0x3F80, 0x7FC1, 0x8000, 0xFFFF], dtype=np.uint16)  # 1.0, a NaN, -0.0, NaN
    data = encode(KIND_REQUEST, {"dtype": "bfloat16"}, [Bf16(words)])
    (got,) = decode(data).arrays
    assert got.dtype == np.dtype("<u2")
    assert got.tolist() == words.tolist()
    assert data[frame._HEADER.size + _meta_len(data)] == 4  # dtype code 4 = bfloat16 on the wire


def _meta_len(data: bytes) -> int:
    return struct.unpack_from("<4sBBHIII", data)[4]


# ------------------------------------------------------------------------------- zero copy, alignment


def test_raw_payload_is_zero_copy_on_both_sides():
    arr = np.arange(1000, dtype=np.float32)
    parts = encode_parts(KIND_REQUEST, {"k": 1}, [arr])
    assert np.shares_memory(np.frombuffer(parts[1], np.uint8), arr)  # encoder: a view of the input
    data = b"".join(parts)
    (got,) = decode(data).arrays
    assert np.shares_memory(got, np.frombuffer(data, np.uint8))  # decoder: a view of the input
    assert got.flags.aligned


@pytest.mark.parametrize("meta", [{}, {"a": 1}, {"ab": "c"}, {"x": "y" * 13}])
@pytest.mark.parametrize("n", [0, 1, 3])
def test_payload_starts_8_aligned(meta, n):
    arrays = [np.arange(3, dtype=np.int64)] * n
    data = encode(KIND_COMMAND, meta, arrays)
    _, _, _, _, meta_len, n_arrays, _ = struct.unpack_from("<4sBBHIII", data)
    payload = 20 + meta_len + n_arrays * (24 + 8)
    assert payload % 8 == 0
    assert len(data) - payload == 24 * n
    assert json.loads(data[20 : 20 + meta_len]) == meta  # the padding is JSON whitespace


def test_misaligned_input_buffer_still_decodes_to_aligned_arrays():
    data = encode(KIND_REQUEST, {}, [np.arange(5, dtype=np.float64)])
    buf = bytearray(1) + bytearray(data)
    (got,) = decode(memoryview(buf)[1:]).arrays
    assert got.flags.aligned and got.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize("wrap", [bytes, bytearray, memoryview, lambda b: memoryview(bytearray(b))])
def test_decode_accepts_any_bytes_like(wrap):
    data = encode(KIND_SNAPSHOT, {"v": [1]}, [np.ones((2, 2), np.float16)], codec="lz4")
    got = decode(wrap(data))
    assert got.meta == {"v": [1]} and got.arrays[0].tolist() == [[1, 1], [1, 1]]


def test_kinds_filter():
    data = encode(KIND_REQUEST, {})
    assert decode(data, kinds={KIND_REQUEST}).kind == KIND_REQUEST
    with pytest.raises(CodecError):
        decode(data, kinds={KIND_COMMAND, KIND_SNAPSHOT})


def test_auto_keeps_shuffle_lz4_only_when_it_pays():
    compressible = np.zeros(4096, np.float32)
    noise = np.frombuffer(np.random.default_rng(0).bytes(4096 * 4), np.float32)
    assert _codec_codes(encode(KIND_REQUEST, {}, [compressible, noise], codec="auto")) == [2, 0]


def _codec_codes(data: bytes) -> list[int]:
    _, _, _, _, meta_len, n, _ = struct.unpack_from("<4sBBHIII", data)
    pos, codes = 20 + meta_len, []
    for _ in range(n):
        _, codec, ndim = struct.unpack_from("<BBB", data, pos)
        codes.append(codec)
        pos += 24 + 8 * ndim
    return codes


# ------------------------------------------------------------------------------- encoder refusals


@pytest.mark.parametrize(
    "arrays",
    [
        [np.zeros(2, np.uint16)],  # plain uint16 is ambiguous: bf16 must be marked
        [np.zeros(2, np.complex64)],
        [np.zeros(2, np.int16)],
        [np.zeros(2, object)],
        [np.zeros(2, [("a", "<f4")])],
        [Bf16(np.zeros(2, np.float16))],
        [[1.0, 2.0]],
        [np.zeros((1,) * 33)],
    ],
)
def test_encoder_refuses_what_the_format_cannot_carry(arrays):
    with pytest.raises(CodecError):
        encode(KIND_REQUEST, {}, arrays)


@pytest.mark.parametrize("meta", [[1], "x", {"a": float("nan")}, {"a": float("inf")}, {"a": object()}, {"a": b"x"}])
def test_encoder_refuses_non_json_meta(meta):
    with pytest.raises(CodecError):
        encode(KIND_REQUEST, meta)


@pytest.mark.parametrize("kind, codec", [(0, "none"), (5, "none"), (1, "zstd"), (1, "")])
def test_encoder_refuses_unknown_kind_or_codec(kind, codec):
    with pytest.raises(CodecError):
        encode(kind, {}, [np.zeros(1)], codec=codec)


# ------------------------------------------------------------------------------- documented layout


def test_hand_built_frame_in_the_documented_layout_decodes():
    """Built with struct from the module docstring, not with encode: docs and code agree."""
    meta = b'{"type":"set"}'
    payload = np.array([[1.5, -2.0, 3.25]], dtype="<f4").tobytes()
    descr = struct.pack("<BBBxIQQ", 1, 0, 2, zlib.crc32(payload), 12, 12) + struct.pack("<QQ", 1, 3)
    header = struct.pack("<4sBBHIII", b"KVPF", 1, 3, 0, len(meta), 1, zlib.crc32(meta + descr))
    got = decode(header + meta + descr + payload)
    assert got.kind == KIND_COMMAND and got.meta == {"type": "set"}
    assert got.arrays[0].tolist() == [[1.5, -2.0, 3.25]]


def test_hand_built_xxh3_frame_in_the_documented_layout_decodes():
    """FLAG_XXH3: every u32 sum is the low 32 bits of XXH3-64 of the same bytes as CRC-32's."""
    import xxhash

    def x32(b: bytes) -> int:
        return xxhash.xxh3_64_intdigest(b) & 0xFFFFFFFF

    meta = b'{"type":"set"}'
    payload = np.array([[1.5, -2.0, 3.25]], dtype="<f4").tobytes()
    descr = struct.pack("<BBBxIQQ", 1, 0, 2, x32(payload), 12, 12) + struct.pack("<QQ", 1, 3)
    header = struct.pack("<4sBBHIII", b"KVPF", 1, 3, FLAG_XXH3, len(meta), 1, x32(meta + descr))
    got = decode(header + meta + descr + payload)
    assert got.arrays[0].tolist() == [[1.5, -2.0, 3.25]]
    # the flag names the checksum: the same bytes labelled CRC-32 are refused, not misread
    relabelled = header[:6] + struct.pack("<H", 0) + header[8:]
    with pytest.raises(CodecError, match="checksum"):
        decode(relabelled + meta + descr + payload)


def test_unaligned_meta_from_another_encoder_decodes():
    """Padding is an encoder nicety, not a format rule: compact meta must still decode."""
    meta = b'{"a":1}'
    payload = lz4_block(bytes(64))
    descr = struct.pack("<BBBxIQQ", 7, 1, 1, zlib.crc32(payload), 64, len(payload)) + struct.pack("<Q", 64)
    header = struct.pack("<4sBBHIII", b"KVPF", 1, 2, 0, len(meta), 1, zlib.crc32(meta + descr))
    got = decode(header + meta + descr + payload)
    assert got.arrays[0].tolist() == [0] * 64


def lz4_block(raw: bytes) -> bytes:
    import lz4.block

    return lz4.block.compress(raw, store_size=False)


def test_supported_versions_table_keeps_v1():
    assert 1 in frame._DECODERS


def test_delta_package_is_pure_core():
    forbidden = {"asyncio", "socket", "time", "random", "threading", "torch"}
    for path in pathlib.Path(frame.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not {n.split(".")[0] for n in names} & forbidden, (path.name, names)


# ------------------------------------------------------------------------------- golden files


def _golden_cases() -> dict[str, tuple[int, dict, list, str]]:
    """name -> (kind, meta, arrays, codec). Never edit a case: add a new file instead."""
    nan_payload = np.array([0x7FC00001, 0xFF800000, 0x80000000, 0x00000001], dtype="<u4").view("<f4")
    ramp = (np.arange(256, dtype="<f4") * 0.25 - 8.0).reshape(16, 16)
    return {
        "empty": (KIND_REQUEST, {}, [], "none"),
        "all_dtypes": (
            KIND_COMMAND,
            {"type": "push", "now": 1.5, "key": "w\u00e9", "nested": {"a": [1, None, True, -2.5e-3]}},
            [
                nan_payload,
                np.array([[1.0, -0.0], [1e300, -np.inf]], "<f8"),
                np.array([1.0, 65504.0, -0.5], "<f2"),
                Bf16(np.array([0x3F80, 0xC000, 0x7FC0], "<u2")),
                np.array([-(2**31), 0, 2**31 - 1], "<i4"),
                np.array(-(2**63), "<i8"),
                np.zeros((2, 0, 3), "u1"),
                np.array([True, False, True]),
            ],
            "none",
        ),
        "lz4": (KIND_RESPONSE, {"versions": [3, 4]}, [np.arange(64, dtype="<i8")], "lz4"),
        "shuffle_lz4": (KIND_SNAPSHOT, {"shard": 2}, [ramp, np.arange(10, dtype="<i4")], "shuffle-lz4"),
    }


def _expected(arr) -> np.ndarray:
    return np.asarray(arr.array if isinstance(arr, Bf16) else arr)


def _check_golden(path, kind, meta, arrays) -> bytes:
    data = path.read_bytes()
    assert data[:6] == b"KVPF\x01" + bytes([kind])
    got = decode(data)
    assert got.kind == kind and got.meta == meta
    assert len(got.arrays) == len(arrays)
    for arr, want in zip(got.arrays, arrays, strict=True):
        assert_bit_exact(arr, _expected(want))
    return data


@pytest.mark.parametrize("name", sorted(_golden_cases()))
def test_golden_crc32_frames_still_decode_exactly(name):
    """Frames written before FLAG_XXH3 (flags 0, CRC-32 sums: old Raft logs, snapshots) decode
    bit-exactly forever. These files are never regenerated."""
    kind, meta, arrays, _codec = _golden_cases()[name]
    data = _check_golden(GOLDEN / f"frame_v1_{name}.bin", kind, meta, arrays)
    assert struct.unpack_from("<H", data, 6)[0] == 0


@pytest.mark.parametrize("name", sorted(_golden_cases()))
def test_golden_xxh3_frames_decode_exactly_and_raw_ones_encode_identically(name):
    kind, meta, arrays, codec = _golden_cases()[name]
    path = GOLDEN / f"frame_v1_xxh3_{name}.bin"
    if os.environ.get("KVPS_REGEN_GOLDEN") == "1":
        GOLDEN.mkdir(exist_ok=True)
        path.write_bytes(encode(kind, meta, arrays, codec=codec))
    data = _check_golden(path, kind, meta, arrays)
    assert struct.unpack_from("<H", data, 6)[0] == FLAG_XXH3
    if codec == "none":  # raw frames are fully pinned; lz4 output may vary across lz4 releases
        assert encode(kind, meta, arrays, codec=codec) == data


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), codec=st.sampled_from(["none", "lz4"]))
def test_verified_digest_checks_every_byte_once_and_identifies_the_frame(seed, codec):
    """One pass: the digest of a good frame is that of its head (which carries the arrays'
    checksums); any byte flipped, in the head or in an array, gives None or another digest;
    decode(verify=False) then reads what decode reads."""
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(int(rng.integers(1, 300))).astype(np.float32),
              rng.integers(0, 9, int(rng.integers(0, 40))).astype(np.int64)]
    data = frame.encode(frame.KIND_COMMAND, {"seed": seed}, arrays, codec=codec)
    digest = frame.verified_digest(data)
    assert digest is not None, seed
    assert digest == frame.verified_digest(bytearray(data))  # the bytes, not the object
    trusted = frame.decode(data, verify=False)
    checked = frame.decode(data)
    assert all(np.array_equal(a, b) for a, b in zip(trusted.arrays, checked.arrays)), seed
    at = int(rng.integers(0, len(data)))
    bad = bytearray(data)
    bad[at] ^= 1 << int(rng.integers(0, 8))
    assert frame.verified_digest(bad) != digest, (seed, at)  # None, or another frame's
    assert frame.verified_digest(b"not a frame at all") is None
    assert frame.verified_digest(data[:-1]) is None, seed


def test_a_remembered_checksum_never_outlives_the_bytes_it_was_taken_of():
    """Read-only arrays of 64 KiB or more have their checksum remembered (a block pulled by
    every worker is summed once; a checked gradient is not summed again in its Raft command):
    a block value rewritten in place through kvps.dense.Slots, or any writeable array changed
    between encodes, still encodes with the checksum of its bytes now."""
    from kvps.dense import Slots, frozen

    n = 64 * 1024 // 4
    calls = []
    real = frame._xxh3_32

    def counting(data):
        calls.append(len(data))
        return real(data)

    value = frozen(np.arange(n, dtype=np.float32))
    first = frame.encode(frame.KIND_RESPONSE, {}, [value])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(frame, "_xxh3_32", counting)
        again = frame.encode(frame.KIND_RESPONSE, {}, [value])
        assert again == first and n * 4 not in calls  # remembered: not summed again
        decoded = frame.decode(first).arrays[0]  # checked on receipt ...
        calls.clear()
        frame.encode(frame.KIND_COMMAND, {}, [decoded])
        assert n * 4 not in calls  # ... and not summed again when it travels on
    slots = Slots()
    ident = id(value)
    slots.retire(value)
    del value, again, decoded
    reused = slots.take((n,), np.dtype(np.float32))
    assert reused is not None and id(reused) == ident  # the same array object, rewritten
    reused[:] = 7.0
    frozen(reused)
    out = frame.decode(frame.encode(frame.KIND_RESPONSE, {}, [reused])).arrays[0]
    assert np.array_equal(out, np.full(n, 7.0, np.float32))
    mutable = np.zeros(n, np.float32)  # a caller's array: never remembered
    frame.encode(frame.KIND_REQUEST, {}, [mutable])
    mutable += 1
    assert np.array_equal(frame.decode(frame.encode(frame.KIND_REQUEST, {}, [mutable])).arrays[0], mutable)
