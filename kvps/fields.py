"""Checks of command fields: each returns the field, normalised, or raises ``InvalidRequest``
naming it. Commands (``kvps.command``) run them when built, on the leader and on every replica
decoding a log entry alike."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from kvps.errors import InvalidRequest
from kvps.placement import VALUE_DTYPES

__all__ = ["array", "bad", "blocks", "float_array", "int64_array", "integer", "is_value_array", "string",
           "time_stamp", "value_dtype"]


def bad(name: str, what: str) -> InvalidRequest:
    return InvalidRequest(f"{name} must be {what}", field=name)


def integer(value: Any, name: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise bad(name, f"an int >= {low}")
    return int(value)


def string(value: Any, name: str, cap: int) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= cap:
        raise bad(name, f"a string of 1-{cap} characters")
    return value


def time_stamp(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad("now", "a finite number")
    return float(value)


def array(value: Any, name: str, kinds: str = "f") -> np.ndarray:
    if isinstance(value, np.generic):  # a numpy scalar is a 0-d value
        value = np.asarray(value)
    if not isinstance(value, np.ndarray) or value.dtype.kind not in kinds:
        raise bad(name, f"a numpy array of kind {kinds!r}")
    return value


_VALUE_DTYPES = frozenset(np.dtype(n) for n in VALUE_DTYPES)  # native byte order
_BY_NAME = {n: np.dtype(n) for n in VALUE_DTYPES}


def value_dtype(name: str) -> np.dtype | None:
    """The native dtype of value dtype ``name`` (None for any other name)."""
    return _BY_NAME.get(name)


def float_array(value: Any, name: str) -> np.ndarray:
    arr = array(value, name)
    # dtype.name is computed in Python (~9 us): 4 of these per gradient block per push (the
    # leader's merge and 3 replicas' decodes) cost more than the block's optimizer step
    if arr.dtype not in _VALUE_DTYPES and arr.dtype.name not in VALUE_DTYPES:
        raise bad(name, f"one of {VALUE_DTYPES}")
    return arr


def is_value_array(value: Any) -> bool:
    """Is ``value`` an ndarray of a value dtype in native byte order (what ``float_array``
    returns as it is)? A quick check for the common case; False says nothing."""
    return type(value) is np.ndarray and value.dtype in _VALUE_DTYPES


def int64_array(value: Any, name: str) -> np.ndarray:
    arr = array(value, name, "i")
    if arr.dtype != np.int64 or arr.ndim != 1:
        raise bad(name, "a 1-d int64 array")
    return arr


def blocks(value: Any) -> tuple[tuple[int, np.ndarray], ...]:
    if not isinstance(value, (tuple, list)):
        raise bad("blocks", "a sequence of (block, array)")
    out = []
    for item in value:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise bad("blocks", "a sequence of (block, array)")
        out.append((integer(item[0], "block"), float_array(item[1], "blocks")))
    if len({b for b, _ in out}) != len(out):
        raise InvalidRequest("a block appears twice", field="blocks")
    return tuple(out)
