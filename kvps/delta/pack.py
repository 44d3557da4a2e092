"""Small blocks packed: many blocks of one dtype travel as one frame array, each named by
``packed`` (the array's index), ``at`` (its first element) and ``shape``.

A frame array costs ~10 us to encode and as much to decode (descriptor, checksum, numpy view);
with 10,000 keys of 1 KiB that was most of a pull or a push. Push requests pack their small raw
gradients; a pull reply packs its small full blocks for a client that asks (``"packed": true``).
Deltas and compressed blocks travel as arrays of their own.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvps.errors import CodecError

__all__ = ["PACK_MAX_BYTES", "pack", "pack_into", "unpack", "view"]

PACK_MAX_BYTES = 64 << 10  # a block up to this size is packed


def pack(values: Sequence[np.ndarray]) -> tuple[list[list], list[np.ndarray]]:
    """Each value's ``[pack, at, shape]`` and the packs: one 1-d array per dtype, in the order
    the dtypes first appear, each value at element ``at`` of its pack. Copies the values once."""
    parts: dict[np.dtype, list[np.ndarray]] = {}
    sizes: dict[np.dtype, int] = {}
    order: dict[np.dtype, int] = {}
    refs = []
    for value in values:
        dt = value.dtype
        if dt not in order:
            order[dt], parts[dt], sizes[dt] = len(order), [], 0
        refs.append([order[dt], sizes[dt], list(value.shape)])
        parts[dt].append(value.reshape(-1))
        sizes[dt] += value.size
    return refs, [np.concatenate(p) for p in parts.values()]


def pack_into(entries: list[dict], values: list[np.ndarray], arrays: list) -> int:
    """``pack`` for a frame's items: the packs appended to ``arrays``, each entry given
    ``packed`` (the array's index), ``at`` and ``shape``; returns how many arrays were appended."""
    refs, packs = pack(values)
    for entry, (p, at, shape) in zip(entries, refs):
        entry.update(packed=len(arrays) + p, at=at, shape=shape)
    arrays += packs
    return len(packs)


def view(packs: Sequence[np.ndarray], ref: Any) -> np.ndarray:
    """The value ``ref`` (``[pack, at, shape]``) names: a view of its pack. ``ValueError`` when
    the reference is malformed or reaches outside a 1-d pack (callers raise their own error)."""
    if type(ref) is list and len(ref) == 3:  # the common case, checked in fewer steps: 1-d values
        p, at, shape = ref
        if (type(p) is int and type(at) is int and type(shape) is list and len(shape) == 1
                and type(shape[0]) is int and 0 <= p < len(packs) and at >= 0 and shape[0] >= 0):
            arr, n = packs[p], shape[0]
            if arr.ndim == 1 and at + n <= arr.shape[0]:
                return arr[at:at + n]
    if not (isinstance(ref, (list, tuple)) and len(ref) == 3 and isinstance(ref[2], list)):
        raise ValueError(f"a packed reference is [pack, at, shape], not {ref!r}")
    p, at, shape = ref
    if not (_count(p) and _count(at) and len(shape) <= 8 and all(_count(d) for d in shape)):
        raise ValueError(f"packed {p!r}, at {at!r}, shape {shape!r}")
    if p >= len(packs) or packs[p].ndim != 1:
        raise ValueError(f"packed {p} is not a 1-d array of the {len(packs)}")
    n = math.prod(shape)
    if at + n > packs[p].size:
        raise ValueError(f"[{at}, {at + n}) lies outside its array of {packs[p].size}")
    return packs[p][at:at + n].reshape(shape)


def unpack(arrays: tuple[np.ndarray, ...], entry: dict) -> np.ndarray:
    """The block ``entry`` names, as a read-only array of its own (a view would keep the whole
    packed array alive for as long as any one of its blocks is held)."""
    try:
        value = view(arrays, [entry.get("packed"), entry.get("at"), entry.get("shape")]).copy()
    except ValueError as exc:
        raise CodecError(f"bad packed block: {exc}") from None
    value.flags.writeable = False
    return value


def _count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0
