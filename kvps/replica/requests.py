"""Reading a data-plane request's meta: every accessor returns the field checked, or raises
``InvalidRequest`` naming it (malformed input never surfaces as a KeyError or TypeError)."""
from __future__ import annotations

from typing import Any

import numpy as np

from kvps.delta import frame, pack
from kvps.errors import InvalidRequest

__all__ = ["array", "blocks", "client_ids", "field", "items", "key", "packed"]


def field(meta: dict, name: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    if name not in meta:
        if default is ...:
            raise InvalidRequest(f"missing field {name!r}", field=name)
        return default
    value = meta[name]
    if isinstance(value, bool) and kind in (int, float):
        raise InvalidRequest(f"field {name!r} must be {getattr(kind, '__name__', kind)}", field=name)
    if not isinstance(value, kind):
        raise InvalidRequest(f"field {name!r} has the wrong type", field=name)
    return value


def array(req: frame.Frame, index: Any) -> np.ndarray:
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(req.arrays):
        raise InvalidRequest(f"bad array index {index!r}")
    return req.arrays[index]


def key(meta: dict) -> str:
    key = field(meta, "key", str)
    if not key or len(key) > 1024:
        raise InvalidRequest("key must be 1-1024 characters", field="key")
    return key


def items(meta: dict, name: str) -> list[dict]:
    items = field(meta, name, list, [])
    if not all(isinstance(it, dict) for it in items):
        raise InvalidRequest(f"{name!r} must be a list of objects", field=name)
    return items


def blocks(req: frame.Frame, meta: dict | None = None) -> tuple[tuple[int, np.ndarray], ...]:
    """``(block, array)`` pairs of ``meta["blocks"]`` (the request's meta, or one item of it); a
    block names its array by ``array``, or by ``packed`` / ``at`` / ``shape`` (``packed``)."""
    return tuple((field(it, "block", int), packed(req, it) if "packed" in it else array(req, it.get("array")))
                 for it in items(req.meta if meta is None else meta, "blocks"))


def client_ids(meta: dict) -> tuple[str, int, int]:
    client = field(meta, "client", str)
    seq, floor = field(meta, "seq", int), field(meta, "floor", int)
    if not client or len(client) > 128 or seq < 0 or floor < 0 or floor > seq:
        raise InvalidRequest("bad push id (client, seq, floor)")
    return client, seq, floor


def packed(req: frame.Frame, it: dict) -> np.ndarray:
    """The block an item names by ``packed`` (an array's index), ``at`` and ``shape``
    (``kvps.delta.pack``): a read-only view of that array."""
    try:
        return pack.view(req.arrays, [it.get("packed"), it.get("at"), it.get("shape")])
    except ValueError as exc:
        raise InvalidRequest(f"bad packed block: {exc}") from None
