"""Lossless array codecs for frame buffers: none, lz4 (block) and byte-shuffle + lz4.

Byte shuffle groups byte 0 of every element, then byte 1, ...: float weights share their sign and
exponent bytes, so the shuffled stream has long runs that lz4 can find. The lz4 block format is
used without its size prefix because the frame descriptor already carries ``raw_size``; the
decoder passes that size to lz4 as the output buffer size, so a bomb cannot allocate more.

Pure core: no I/O, no clock, no randomness.
"""
from __future__ import annotations

import lz4.block
import numpy as np

from kvps.errors import CodecError

__all__ = [
    "CODEC_AUTO",
    "CODEC_CODES",
    "CODEC_LZ4",
    "CODEC_NONE",
    "CODEC_SHUFFLE_LZ4",
    "LZ4_MAX_RATIO",
    "compress",
    "decompress",
    "shuffle",
    "unshuffle",
]

CODEC_NONE = 0
CODEC_LZ4 = 1
CODEC_SHUFFLE_LZ4 = 2
CODEC_AUTO = "auto"  # an encoder choice, never on the wire

CODEC_CODES: dict[str, int] = {"none": CODEC_NONE, "lz4": CODEC_LZ4, "shuffle-lz4": CODEC_SHUFFLE_LZ4}

# An lz4 block sequence is a token, a 2-byte offset and one extension byte per 255 more bytes of
# match, so its output is always < 255 × its input: a larger declared raw size is a forgery, and
# the decoder refuses it before allocating anything.
LZ4_MAX_RATIO = 255

# lz4.block refuses inputs above LZ4_MAX_INPUT_SIZE (0x7E000000 bytes).
_LZ4_MAX_INPUT = 0x7E000000

# auto keeps shuffle-lz4 only when wire * 20 <= raw * 19, i.e. it saves at least 5 %.
_AUTO_KEEP_NUM, _AUTO_KEEP_DEN = 19, 20


_WORDS = {2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}
_SMALL = 1 << 16  # bytes; below this per-call overhead beats per-byte speed


def _as_u8(buf) -> np.ndarray:
    """A flat uint8 view of any C-contiguous bytes-like object (no copy)."""
    try:
        return np.frombuffer(buf, dtype=np.uint8)
    except (TypeError, ValueError) as exc:
        raise CodecError(f"not a contiguous byte buffer: {type(buf).__name__}") from exc


def shuffle(buf, itemsize: int) -> bytes:
    """Byte-shuffle ``buf`` (n elements of ``itemsize`` bytes) into itemsize planes of n bytes."""
    u8 = _as_u8(buf)
    if itemsize < 1 or u8.size % itemsize:
        raise CodecError(f"buffer of {u8.size} bytes is not a whole number of {itemsize}-byte items")
    if itemsize == 1:
        return u8.tobytes()
    return u8.reshape(-1, itemsize).T.tobytes()  # (itemsize, n): one copy, in C order


def unshuffle(buf, itemsize: int) -> memoryview:
    """Inverse of :func:`shuffle`, as a read-only byte view of a fresh buffer."""
    u8 = _as_u8(buf)
    if itemsize < 1 or u8.size % itemsize:
        raise CodecError(f"buffer of {u8.size} bytes is not a whole number of {itemsize}-byte items")
    planes = u8.reshape(itemsize, -1)  # (itemsize, n)
    word = _WORDS.get(itemsize)
    if word is None or u8.size < _SMALL:
        out = np.ascontiguousarray(planes.T)  # (n, itemsize): one strided byte copy
    else:
        # Rebuild little-endian words with vectorised shift/or: ~3x faster than the strided byte
        # transpose on big buffers (it costs 2 * itemsize numpy calls, hence the small cutoff).
        out = planes[-1].astype(word)  # (n,)
        for plane in planes[-2::-1]:
            out <<= 8
            out |= plane
    out = out.reshape(-1).view(np.uint8)
    out.flags.writeable = False
    return memoryview(out)


def _lz4(buf) -> bytes:
    if len(buf) > _LZ4_MAX_INPUT:
        raise CodecError(f"lz4 block input of {len(buf)} bytes exceeds {_LZ4_MAX_INPUT}")
    return lz4.block.compress(buf, store_size=False)


def compress(array: np.ndarray, codec: str) -> tuple[int, bytes | memoryview]:
    """Encode one C-contiguous little-endian array; returns ``(codec_code, wire_bytes)``.

    ``none`` returns a zero-copy memoryview of the array's bytes. Empty arrays are always stored
    raw (there is nothing to compress). ``auto`` tries shuffle-lz4 and keeps it only when it
    saves at least 5 %; otherwise (and when the array is too large for one lz4 block) the
    array is stored raw.
    """
    raw = memoryview(array.reshape(-1).view(np.uint8))
    if codec == "none" or raw.nbytes == 0:
        return CODEC_NONE, raw
    if codec == "lz4":
        return CODEC_LZ4, _lz4(raw)
    if codec == "shuffle-lz4":
        return CODEC_SHUFFLE_LZ4, _lz4(shuffle(raw, array.itemsize))
    if codec == CODEC_AUTO:
        if raw.nbytes > _LZ4_MAX_INPUT:
            return CODEC_NONE, raw
        wire = _lz4(shuffle(raw, array.itemsize))
        if len(wire) * _AUTO_KEEP_DEN <= raw.nbytes * _AUTO_KEEP_NUM:
            return CODEC_SHUFFLE_LZ4, wire
        return CODEC_NONE, raw
    raise CodecError(f"unknown codec {codec!r}; expected one of {sorted([*CODEC_CODES, CODEC_AUTO])}")


def decompress(codec_code: int, wire, raw_size: int, itemsize: int) -> bytes | memoryview:
    """Decode one buffer; the result is exactly ``raw_size`` bytes or ``CodecError`` is raised.

    ``none`` returns ``wire`` itself (zero copy). lz4 is given ``raw_size`` as its output buffer,
    so corrupt or hostile input can never make it allocate more than the declared size.
    """
    if codec_code == CODEC_NONE:
        if len(wire) != raw_size:
            raise CodecError(f"raw buffer is {len(wire)} bytes, declared {raw_size}")
        return wire
    if codec_code not in (CODEC_LZ4, CODEC_SHUFFLE_LZ4):
        raise CodecError(f"unknown codec code {codec_code}")
    if raw_size > LZ4_MAX_RATIO * len(wire):
        raise CodecError(f"declared raw size {raw_size} is impossible for {len(wire)} lz4 bytes")
    try:
        raw = lz4.block.decompress(wire, uncompressed_size=raw_size)
    except lz4.block.LZ4BlockError as exc:
        raise CodecError(f"corrupt lz4 block: {exc}") from exc
    if len(raw) != raw_size:
        raise CodecError(f"lz4 block decoded to {len(raw)} bytes, declared {raw_size}")
    if codec_code == CODEC_SHUFFLE_LZ4:
        return unshuffle(raw, itemsize)
    return raw
