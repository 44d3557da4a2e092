"""Exact deltas of dense blocks: the XOR of two versions' bit patterns, and its inverse.

A client that holds block version ``v`` gets ``current XOR v`` (bit patterns, as unsigned ints)
instead of the block: after an optimizer step most high-order bytes are unchanged, so the XOR
compresses (shuffle + lz4) where the raw weights do not, and reconstruction is bit-exact. The
encoder (``xor_delta``, the replica) and the decoder (``apply_xor``, the client) sit side by side.
"""
from __future__ import annotations

import numpy as np

__all__ = ["apply_xor", "xor_delta"]

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def xor_delta(new: np.ndarray, old: np.ndarray) -> np.ndarray:
    """Bitwise XOR of two same-shape, same-dtype arrays. The result carries bit patterns in the
    arrays' own dtype (frames move bytes untouched, so any pattern, NaNs included, survives)."""
    u = _UINT[new.dtype.itemsize]
    return np.bitwise_xor(np.ascontiguousarray(new).view(u),
                          np.ascontiguousarray(old).view(u)).view(new.dtype)


def apply_xor(old: np.ndarray, delta: np.ndarray) -> np.ndarray:
    """``old`` advanced by ``delta`` (the inverse of :func:`xor_delta`), bit-exact."""
    u = _UINT[old.dtype.itemsize]
    return np.bitwise_xor(np.ascontiguousarray(old).view(u), delta.view(u)).view(old.dtype)
