"""Small blocks packed: many blocks of one dtype travel as one frame array, each named by
``packed`` (the array's index), ``at`` (its first element) and ``shape``.

A frame array costs ~10 us to encode and as much to decode (descriptor, checksum, numpy view);
with 10,000 keys of 1 KiB that was most of a pull or a push. Push requests pack their small raw
gradients; a pull reply packs its small full blocks for a client that asks (``"packed": true``).
Deltas and compressed blocks travel as arrays of their own.
"""
from __future__ import annotations

import math

import numpy as np

from kvps.errors import CodecError

__all__ = ["PACK_MAX_BYTES", "pack", "unpack"]

PACK_MAX_BYTES = 64 << 10  # a block up to this size is packed


def pack(entries: list[dict], values: list[np.ndarray], arrays: list) -> int:
    """Point each entry at its value inside one concatenated array per dtype, appended to
    ``arrays``; returns how many arrays were appended. Copies the (small) values once."""
    by_dtype: dict[np.dtype, list[tuple[dict, np.ndarray]]] = {}
    for entry, value in zip(entries, values):
        by_dtype.setdefault(value.dtype, []).append((entry, value))
    for group in by_dtype.values():
        index, at = len(arrays), 0
        for entry, value in group:
            entry.update(packed=index, at=at, shape=list(value.shape))
            at += value.size
        arrays.append(np.concatenate([v.reshape(-1) for _, v in group]))
    return len(by_dtype)


def unpack(arrays: tuple[np.ndarray, ...], entry: dict) -> np.ndarray:
    """The block ``entry`` names, as a read-only array of its own (a view would keep the whole
    packed array alive for as long as any one of its blocks is held)."""
    try:
        index, at, shape = entry["packed"], entry["at"], entry["shape"]
        if not (_count(index) and _count(at) and isinstance(shape, list) and len(shape) <= 8
                and all(_count(d) for d in shape)):
            raise ValueError(f"packed {index!r}, at {at!r}, shape {shape!r}")
        arr, n = arrays[index], math.prod(shape)
        if arr.ndim != 1 or at + n > arr.size:
            raise ValueError(f"[{at}, {at + n}) of a {arr.ndim}-d array of {arr.size}")
        value = arr[at:at + n].reshape(shape).copy()
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise CodecError(f"bad packed block: {exc}") from None
    value.flags.writeable = False
    return value


def _count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0
