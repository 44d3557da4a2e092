"""The one binary frame format: data-plane bodies, Raft log commands and snapshots.

Wire layout, all little-endian (format version 1)::

    header   '<4sBBHIII'  magic b'KVPF', format version (1), kind (u8), flags (u16),
                          meta_len (u32), n_arrays (u32),
                          header_sum (u32: checksum of the meta bytes + the descriptor bytes)
    meta     meta_len bytes of UTF-8 JSON, an object (cap 16 MiB); the encoder writes
             json.dumps(meta, sort_keys=True, separators=(",", ":"), allow_nan=False) followed by
             0-7 spaces so that the payload starts 8-byte aligned (JSON ignores trailing spaces)
    descr    n_arrays x ( '<BBB' dtype code, codec code, ndim ; 'x' pad ;
                          '<IQQ' checksum of the wire bytes, raw_size, wire_size ;
                          ndim x '<Q' dims )          (cap 65536 arrays, ndim <= 32)
    payload  the wire bytes of each array, concatenated in order

Flags: 0, or ``FLAG_XXH3`` (1). They name the checksum of every ``u32`` sum field: flags 0 is
zlib's CRC-32 (every frame written before the flag existed: old logs, snapshots, golden files),
``FLAG_XXH3`` the low 32 bits of XXH3-64 (what the encoder writes). XXH3 runs at ~12 GB/s here
against CRC-32's ~3.5 GB/s, and a 1 MiB push is checksummed ~8 times between client, leader and
followers. Both catch torn or corrupted buffers; neither is a defence against an adversary (the
token and the cluster secret are).

Dtype codes: 1 float32, 2 float64, 3 float16, 4 bfloat16, 5 int32, 6 int64, 7 uint8, 8 bool.
bfloat16 has no numpy dtype: the caller passes the raw 2-byte words as ``Bf16(uint16_array)`` and
gets a uint16 array back (a uint16 array in a decoded frame always means bfloat16, since plain
uint16 is not allowed). Codec codes: 0 none, 1 lz4 block, 2 byte-shuffle + lz4 block.

The decoder checks every declared size against the buffer and the caller's cap *before* it
allocates, and turns every malformed input into ``CodecError``. Encoding is deterministic: the
Raft log and snapshots rely on identical input giving identical bytes.

Pure core: no I/O, no clock, no randomness. A little past the house's ~450 lines on purpose: the
encoder and the decoder of one format stay in one module, so their layouts cannot drift apart.
"""
from __future__ import annotations

import json
import struct
import weakref
import zlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from kvps.delta import codec as _codec
from kvps.errors import CodecError

__all__ = [
    "Bf16",
    "DEFAULT_MAX_RAW_BYTES",
    "FLAG_XXH3",
    "FORMAT_VERSION",
    "Frame",
    "FrameParts",
    "KIND_COMMAND",
    "KIND_REQUEST",
    "KIND_RESPONSE",
    "KIND_SNAPSHOT",
    "MAGIC",
    "array_checksum",
    "decode",
    "encode",
    "encode_parts",
    "forget_sum",
    "head_size",
    "verified_digest",
]

KIND_REQUEST = 1
KIND_RESPONSE = 2
KIND_COMMAND = 3
KIND_SNAPSHOT = 4
_KINDS = frozenset((KIND_REQUEST, KIND_RESPONSE, KIND_COMMAND, KIND_SNAPSHOT))

MAGIC = b"KVPF"
FORMAT_VERSION = 1
DEFAULT_MAX_RAW_BYTES = 256 * 2**20  # one request/response body; callers raise it for snapshots
MAX_META_BYTES = 16 * 2**20  # meta is small structured data; big things travel as arrays
MAX_ARRAYS = 65536
MAX_NDIM = 32  # numpy's own limit (64 in numpy 2) is looser; 32 is plenty and bounds parsing
_PAYLOAD_ALIGN = 8  # so the first array decodes as an aligned zero-copy view
FLAG_XXH3 = 0x1  # the u32 sums are XXH3-64's low 32 bits (without it: CRC-32)
_MASK32 = 0xFFFFFFFF


def _xxh3_32(data) -> int:
    return xxhash.xxh3_64_intdigest(data) & _MASK32


# The checksums of read-only arrays of 64 KiB or more that travel uncompressed, by id() with a weak
# reference to tell a reused id apart: a shard's block value is summed once however many workers
# pull it, and a gradient checked on receipt is not summed again in the Raft command that carries
# it. Read-only arrays do not change (a dense block's value is rewritten only once nothing refers
# to it, and kvps.dense.Slots calls forget_sum first); a writeable one (a caller's) is summed
# every time.
_SUM_MIN_BYTES = 64 * 1024
_NONE = _codec.CODEC_NONE
_known_sums: dict[int, tuple[weakref.ref, int]] = {}


def _remember_sum(arr: np.ndarray, crc: int) -> None:
    key = id(arr)

    def gone(ref: weakref.ref, key: int = key) -> None:  # runs before the id can be reused
        known = _known_sums.get(key)
        if known is not None and known[0] is ref:
            _known_sums.pop(key, None)
    try:
        _known_sums[key] = (weakref.ref(arr, gone), crc)
    except TypeError:  # an object without weak references: summed every time
        pass


def _remembered(arr: np.ndarray) -> bool:
    return not arr.flags.writeable and arr.nbytes >= _SUM_MIN_BYTES


def _array_sum(arr: np.ndarray, codec_code: int, wire) -> int:
    if codec_code != _NONE or not _remembered(arr):
        return _xxh3_32(wire)
    known = _known_sums.get(id(arr))
    if known is not None and known[0]() is arr:
        return known[1]
    crc = _xxh3_32(wire)
    _remember_sum(arr, crc)
    return crc


def array_checksum(arr: np.ndarray) -> int:
    """The low 32 bits of XXH3-64 of ``arr``'s bytes in C order: the checksum a frame carries for
    it uncompressed. Not computed again for a read-only array of 64 KiB or more whose sum is
    known (a raw array checked on receipt, a block value already sent)."""
    if _remembered(arr):
        known = _known_sums.get(id(arr))
        if known is not None and known[0]() is arr:
            return known[1]
    return _xxh3_32(np.ascontiguousarray(arr).view(np.uint8))


def forget_sum(arr: np.ndarray) -> None:
    """Before a read-only array is made writeable and rewritten: its remembered checksum goes."""
    _known_sums.pop(id(arr), None)


_CHECKSUMS = {0: zlib.crc32, FLAG_XXH3: _xxh3_32}  # flags -> the checksum of every u32 sum field

_HEADER = struct.Struct("<4sBBHIII")
_DESCR = struct.Struct("<BBBxIQQ")
_DIM = struct.Struct("<Q")

# dtype code <-> little-endian numpy dtype. Keyed by (kind, itemsize) so any byte order or
# platform alias (e.g. 'l' vs 'q') maps to the same code.
_BF16 = 4
_DTYPES: dict[int, np.dtype] = {
    1: np.dtype("<f4"),
    2: np.dtype("<f8"),
    3: np.dtype("<f2"),
    _BF16: np.dtype("<u2"),
    5: np.dtype("<i4"),
    6: np.dtype("<i8"),
    7: np.dtype("u1"),
    8: np.dtype("?"),
}
_CODE_OF = {(dt.kind, dt.itemsize): code for code, dt in _DTYPES.items() if code != _BF16}


@dataclass(frozen=True)
class Bf16:
    """Marks a uint16 array as bfloat16 bit patterns (numpy has no bfloat16 dtype)."""

    array: np.ndarray


@dataclass(frozen=True, eq=False)  # eq=False: comparing tuples of arrays elementwise is ambiguous
class Frame:
    kind: int
    meta: dict  # a JSON object
    arrays: tuple[np.ndarray, ...]  # C-contiguous, little-endian, read-only; raw ones view the input


# ---------------------------------------------------------------------------------------- encode


def _normalize(item) -> tuple[int, np.ndarray]:
    """(dtype code, C-contiguous little-endian array) for one allowed input array."""
    if isinstance(item, Bf16):
        arr = item.array
        if not isinstance(arr, np.ndarray) or (arr.dtype.kind, arr.dtype.itemsize) != ("u", 2):
            raise CodecError(f"Bf16 needs a uint16 numpy array, got {getattr(arr, 'dtype', type(arr))}")
        code = _BF16
    elif isinstance(item, (np.ndarray, np.generic)):  # a numpy scalar travels as a 0-d array
        arr = np.asarray(item)
        code = _CODE_OF.get((arr.dtype.kind, arr.dtype.itemsize))
        if code is None or arr.dtype.fields is not None:
            raise CodecError(f"dtype {arr.dtype} is not allowed in a frame")
    else:
        raise CodecError(f"frame arrays must be numpy arrays, numpy scalars or Bf16, got {type(item).__name__}")
    # asarray (not ascontiguousarray) keeps 0-d arrays 0-d; copies only when order/byte order differ.
    return code, np.asarray(arr, dtype=_DTYPES[code], order="C")


def _meta_bytes(meta: dict, head_len: int, at: int = 0) -> bytes:
    if not isinstance(meta, dict):
        raise CodecError(f"meta must be a dict, got {type(meta).__name__}")
    try:
        text = json.dumps(meta, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise CodecError(f"meta is not JSON-serialisable: {exc}") from exc
    raw = text.encode("utf-8")
    raw += b" " * (-(at + _HEADER.size + len(raw) + head_len) % _PAYLOAD_ALIGN)
    if len(raw) > MAX_META_BYTES:
        raise CodecError(f"meta is {len(raw)} bytes, cap {MAX_META_BYTES}")
    return raw


class FrameParts(list):
    """:func:`encode_parts`'s buffers, and ``digest``: what :func:`verified_digest` returns for
    their join, known without a pass over the payload. Every array's checksum in the head was
    computed here from its bytes or checked against them on receipt (``array_checksum``), so the
    frame holds by construction; a Raft leader journals its own proposal with it (one checksum
    per hop: the followers still check every byte on receipt)."""

    digest: int


def encode_parts(
    kind: int, meta: dict, arrays: Sequence = (), *, codec: str | Sequence[str] = "none", at: int = 0
) -> FrameParts:
    """The frame as a list of buffers; ``b"".join`` of them is :func:`encode`'s output.

    ``at``: the offset the frame will start at in the buffer that holds it (a Raft entry puts a
    2-byte prefix before its command): the payload is aligned in that buffer, so the arrays
    decode there as zero-copy views. Misaligned, every array is copied on decode (a Push entry's
    gradients, on every replica, into fresh memory).

    ``codec`` is one codec for every array, or one per array (a delta compresses, a weight
    block does not: compression is applied only where it pays).
    Raw (``none``) payloads are zero-copy memoryviews of the (normalised) input arrays: write
    or join the parts before mutating those arrays.
    """
    if kind not in _KINDS:
        raise CodecError(f"unknown frame kind {kind!r}")
    codecs = [codec] * len(arrays) if isinstance(codec, str) else list(codec)
    if len(codecs) != len(arrays):
        raise CodecError(f"{len(codecs)} codecs for {len(arrays)} arrays")
    for c in set(codecs):
        if c not in _codec.CODEC_CODES and c != _codec.CODEC_AUTO:
            raise CodecError(f"unknown codec {c!r}")
    if len(arrays) > MAX_ARRAYS:
        raise CodecError(f"{len(arrays)} arrays, cap {MAX_ARRAYS}")
    descr: list[bytes] = []
    wires: list[bytes | memoryview] = []
    for item, array_codec in zip(arrays, codecs):
        code, arr = _normalize(item)
        if arr.ndim > MAX_NDIM:
            raise CodecError(f"array has {arr.ndim} dims, cap {MAX_NDIM}")
        codec_code, wire = _codec.compress(arr, array_codec)
        crc = _array_sum(arr, codec_code, wire)
        descr.append(_DESCR.pack(code, codec_code, arr.ndim, crc, arr.nbytes, len(wire)))
        descr.extend(_DIM.pack(d) for d in arr.shape)
        wires.append(wire)
    descr_bytes = b"".join(descr)
    meta_raw = _meta_bytes(meta, len(descr_bytes), at)
    header_sum = _xxh3_32(meta_raw + descr_bytes)  # both small: the arrays are not in it
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, kind, FLAG_XXH3, len(meta_raw), len(wires), header_sum)
    head = header + meta_raw + descr_bytes
    parts = FrameParts((head, *wires))
    parts.digest = xxhash.xxh3_64_intdigest(head)  # verified_digest's, over the same head
    return parts


def encode(kind: int, meta: dict, arrays: Sequence = (), *, codec: str | Sequence[str] = "none") -> bytes:
    """One frame as bytes. Deterministic: identical input gives identical bytes."""
    return b"".join(encode_parts(kind, meta, arrays, codec=codec))


# ---------------------------------------------------------------------------------------- decode


@dataclass(frozen=True)
class _Descr:
    dtype_code: int
    codec_code: int
    crc: int
    raw_size: int
    wire_size: int
    shape: tuple[int, ...]


def _as_bytes_view(data) -> memoryview:
    try:
        view = memoryview(data)
    except TypeError as exc:
        raise CodecError(f"frame must be bytes-like, got {type(data).__name__}") from exc
    if view.format == "B" and view.ndim == 1 and view.c_contiguous:
        return view
    try:
        return view.cast("B")  # e.g. a memoryview of an int array, or a 2-d buffer
    except (TypeError, ValueError) as exc:  # non-contiguous or exotic-format buffers
        raise CodecError("frame buffer is not a contiguous byte buffer") from exc


def _parse_descriptors(view: memoryview, pos: int, n_arrays: int) -> tuple[list[_Descr], int]:
    """Structural parse only (bounds); returns the descriptors and the payload offset."""
    out = []
    for _ in range(n_arrays):  # stops at the first descriptor past the buffer, whatever n_arrays says
        if pos + _DESCR.size > len(view):
            raise CodecError("truncated descriptor")
        dtype_code, codec_code, ndim, crc, raw_size, wire_size = _DESCR.unpack_from(view, pos)
        pos += _DESCR.size
        if ndim > MAX_NDIM:
            raise CodecError(f"array has {ndim} dims, cap {MAX_NDIM}")
        if pos + ndim * _DIM.size > len(view):
            raise CodecError("truncated dims")
        shape = struct.unpack_from(f"<{ndim}Q", view, pos)
        pos += ndim * _DIM.size
        out.append(_Descr(dtype_code, codec_code, crc, raw_size, wire_size, shape))
    return out, pos


def _check_descriptor(d: _Descr) -> None:
    dtype = _DTYPES.get(d.dtype_code)
    if dtype is None:
        raise CodecError(f"unknown dtype code {d.dtype_code}")
    if d.codec_code not in _codec.CODEC_CODES.values():
        raise CodecError(f"unknown codec code {d.codec_code}")
    count = 1
    for dim in d.shape:  # Python ints: no overflow, however large the forged dims
        count *= dim
    if count * dtype.itemsize != d.raw_size:
        raise CodecError(f"shape {d.shape} of {dtype} needs {count * dtype.itemsize} bytes, declared {d.raw_size}")


def _decode_array(d: _Descr, wire: memoryview, array_sum) -> np.ndarray:
    if array_sum is not None and array_sum(wire) != d.crc:
        raise CodecError("array checksum mismatch")
    dtype = _DTYPES[d.dtype_code]
    raw = _codec.decompress(d.codec_code, wire, d.raw_size, dtype.itemsize)
    try:
        arr = np.frombuffer(raw, dtype=dtype).reshape(d.shape)
    except ValueError as exc:  # an empty shape whose other dims exceed numpy's signed 64-bit sizes
        raise CodecError(f"unrepresentable shape {d.shape}") from exc
    if not arr.flags.aligned:  # a misaligned view is legal numpy but slow and awkward downstream
        arr = arr.copy()
    if d.dtype_code == 8 and arr.size and arr.view(np.uint8).max() > 1:
        raise CodecError("bool array holds bytes other than 0 and 1")
    arr.flags.writeable = False  # uniform: views on the input must not be mutated through us
    if array_sum is _CHECKSUMS[FLAG_XXH3] and d.codec_code == _NONE and _remembered(arr):
        # checked against its XXH3: encoding it again (a push's Raft command) skips the sum
        _remember_sum(arr, d.crc)
    return arr


def _no_constants(name: str):
    raise ValueError(f"{name} is not JSON")  # NaN / Infinity: Python's json accepts them by default


_JSON = json.JSONDecoder(parse_constant=_no_constants)  # built once: json.loads(**kw) builds one per call


def _decode_meta(raw: memoryview) -> dict:
    try:
        meta = _JSON.decode(str(raw, "utf-8"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise CodecError(f"meta is not valid JSON: {exc}") from exc
    if not isinstance(meta, dict):
        raise CodecError(f"meta must be a JSON object, got {type(meta).__name__}")
    return meta


def _decode_v1(view: memoryview, kind: int, flags: int, meta_len: int, n_arrays: int,
               header_crc: int, max_raw_bytes: int, verify: bool = True) -> Frame:
    meta_start = _HEADER.size
    if meta_len > MAX_META_BYTES or n_arrays > MAX_ARRAYS:
        raise CodecError(f"meta_len {meta_len} / n_arrays {n_arrays} over the cap")
    if meta_start + meta_len > len(view):
        raise CodecError("truncated meta")
    descrs, payload = _parse_descriptors(view, meta_start + meta_len, n_arrays)
    if _CHECKSUMS[flags](view[meta_start:payload]) != header_crc:
        raise CodecError("header checksum mismatch")
    for d in descrs:
        _check_descriptor(d)
    total_raw = sum(d.raw_size for d in descrs)
    if total_raw > max_raw_bytes:
        raise CodecError(f"frame declares {total_raw} raw bytes, cap {max_raw_bytes}")
    if sum(d.wire_size for d in descrs) != len(view) - payload:
        raise CodecError("wire sizes do not add up to the payload length")
    meta = _decode_meta(view[meta_start : meta_start + meta_len])
    arrays = []
    array_sum = _CHECKSUMS[flags] if verify else None
    for d in descrs:
        arrays.append(_decode_array(d, view[payload : payload + d.wire_size], array_sum))
        payload += d.wire_size
    return Frame(kind, meta, tuple(arrays))


# A future v2 adds its decoder here; v1 frames (golden files, old logs and snapshots) keep decoding.
_DECODERS = {1: _decode_v1}


def decode(data, *, max_raw_bytes: int = DEFAULT_MAX_RAW_BYTES,
           kinds: Collection[int] | None = None, verify: bool = True) -> Frame:
    """Parse and verify one frame. Every malformed input raises ``CodecError``, nothing else.

    ``max_raw_bytes`` caps the sum of the arrays' decoded sizes, checked before allocating.
    ``kinds`` restricts the accepted frame kinds (default: all four).
    ``verify=False`` skips the arrays' checksums (the header's is still checked): only for bytes
    :func:`verified_digest` has passed since they last moved (a Raft entry the journal
    checked when it wrote or read the entry), or a leader's own proposal (``FrameParts``).
    """
    view = _as_bytes_view(data)
    if len(view) < _HEADER.size:
        raise CodecError(f"truncated: {len(view)} bytes, header needs {_HEADER.size}")
    magic, version, kind, flags, meta_len, n_arrays, header_crc = _HEADER.unpack_from(view, 0)
    if magic != MAGIC:
        raise CodecError(f"bad magic {magic!r}")
    decoder = _DECODERS.get(version)
    if decoder is None:
        raise CodecError(f"unsupported frame version {version}")
    if kind not in (_KINDS if kinds is None else kinds):
        raise CodecError(f"unexpected frame kind {kind}")
    if flags not in _CHECKSUMS:
        raise CodecError(f"unknown frame flags {flags:#x}")
    return decoder(view, kind, flags, meta_len, n_arrays, header_crc, max_raw_bytes, verify)


def verified_digest(data) -> int | None:
    """XXH3-64 of the frame's head (header, meta, descriptors: every array's checksum is in it)
    once every array matches its checksum and the head its own; ``None`` for bytes that are not
    such a frame. One pass over the payload: the whole frame's check and digest at once (the
    Raft journal's record checksum on every replica, ``kvps.raft.segments``)."""
    try:
        view = _as_bytes_view(data)
        if len(view) < _HEADER.size:
            return None
        magic, version, _kind, flags, meta_len, n_arrays, header_crc = _HEADER.unpack_from(view, 0)
        if magic != MAGIC or version not in _DECODERS or flags not in _CHECKSUMS \
                or meta_len > MAX_META_BYTES or n_arrays > MAX_ARRAYS \
                or _HEADER.size + meta_len > len(view):
            return None
        descrs, payload = _parse_descriptors(view, _HEADER.size + meta_len, n_arrays)
        array_sum = _CHECKSUMS[flags]
        if array_sum(view[_HEADER.size:payload]) != header_crc \
                or sum(d.wire_size for d in descrs) != len(view) - payload:
            return None
        at = payload
        for d in descrs:
            if array_sum(view[at:at + d.wire_size]) != d.crc:
                return None
            at += d.wire_size
        return xxhash.xxh3_64_intdigest(view[:payload])
    except CodecError:
        return None


def head_size(data) -> int:
    """Bytes before the payload (header, meta, descriptors): the part that carries every array's
    CRC, so a digest of it identifies the whole frame. ``CodecError`` if it does not parse."""
    view = _as_bytes_view(data)
    if len(view) < _HEADER.size:
        raise CodecError(f"truncated: {len(view)} bytes, header needs {_HEADER.size}")
    magic, version, _kind, _flags, meta_len, n_arrays, _crc = _HEADER.unpack_from(view, 0)
    if magic != MAGIC or version not in _DECODERS:
        raise CodecError("not a kvps frame")
    if meta_len > MAX_META_BYTES or n_arrays > MAX_ARRAYS or _HEADER.size + meta_len > len(view):
        raise CodecError("truncated or oversized frame head")
    return _parse_descriptors(view, _HEADER.size + meta_len, n_arrays)[1]
