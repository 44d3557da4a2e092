"""The lossy push codecs, encoder and decoder side by side: fp16, bf16, top-k.

The client encodes a gradient (``kvps_client``'s ``LossyEncoder`` adds error feedback: what a codec
drops waits in a residual for the next push); the leader decodes it back to the key's dtype before
anything else sees it. Pure: no I/O. Bounds per value sent (``tests/unit/test_delta.py``):

- fp16: relative error <= 2**-11 for normal numbers (|x| in [6.1e-5, 65504]; larger overflows);
- bf16: relative error <= 2**-8 (round to nearest even); carried as the top 16 bits of a float32;
- top-k: the ``k`` largest-magnitude entries exactly (flat indices + values), the rest zero.
"""
from __future__ import annotations

import numpy as np

from kvps.errors import InvalidRequest

__all__ = ["bf16_round", "bf16_widen", "topk_expand", "topk_select", "widen"]


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def bf16_widen(q: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32, exactly."""
    return (q.astype(np.uint32) << np.uint32(16)).view(np.float32)


def widen(arr: np.ndarray, encoding: str, dtype: np.dtype, what: str) -> np.ndarray:
    """An fp16 or bf16 gradient back in ``dtype`` (``what`` names it in errors)."""
    if encoding == "fp16" and arr.dtype == np.float16:
        return arr.astype(dtype)
    if encoding == "bf16" and arr.dtype == np.uint16:
        return bf16_widen(arr).astype(dtype)
    raise InvalidRequest(f"{encoding!r} gradient for {what} must be sent as its carrier dtype")


def topk_select(flat: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` largest-magnitude entries of a flat array: (sorted int64 indices, values)."""
    if k <= 0:
        return np.zeros(0, np.int64), flat[:0]
    idx = np.sort(np.argpartition(np.abs(flat), flat.size - k)[flat.size - k:]).astype(np.int64)
    return idx, flat[idx]


def topk_expand(idx: np.ndarray, values: np.ndarray, shape: tuple[int, ...], dtype: np.dtype,
                what: str) -> np.ndarray:
    """The dense gradient a top-k part stands for (zeros elsewhere); checked before it is used."""
    dense = np.zeros(shape, dtype=dtype)
    if idx.dtype != np.int64 or idx.ndim != 1 or values.shape != idx.shape or values.dtype != dense.dtype:
        raise InvalidRequest(f"top-k push of {what} needs int64 indices and values of its dtype")
    if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= dense.size):
        raise InvalidRequest(f"top-k index out of range for {what}")
    dense.reshape(-1)[idx] = values
    return dense
