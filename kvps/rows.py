"""An open-addressing hash index ``row id -> slot`` in numpy, for a table's rows on one shard.

No per-row Python object: the index is one int32 array holding slots (``EMPTY`` = -1, ``TOMB`` =
-2 for a removed entry), probed linearly from ``splitmix64(id)`` mapped onto the array by a multiply
and shift (Lemire's fastrange), so the array can have any size, not only a power of two. The ids
themselves live in the caller's ``ids`` array (slot -> id), so an entry is 4 bytes and the index
costs 4 / load bytes per row. A rebuild sizes the array for ``MIN_LOAD`` and entries (tombstones
included) are added up to ``MAX_LOAD``, so while rows are added the index costs 4 / 0.75 to
4 / 0.5 = 5.3-8 bytes per row (``kvps.record.INDEX_BYTES`` counts 8; power-of-two sizes let the load
fall to 0.25, 16 bytes); like the row arrays it does not shrink when rows are evicted. Lookups,
inserts and removals take a whole batch of ids at once (one numpy pass per probe step); every
outcome is a pure function of the ids and the order of operations, so replicas applying the same
log hold the same index (which, besides, decides nothing but where an entry sits).
"""
from __future__ import annotations

import math

import numpy as np

from kvps.initializer import splitmix64

__all__ = ["EMPTY", "MAX_LOAD", "MIN_LOAD", "RowIndex"]

EMPTY = -1
TOMB = -2
_MIN_SIZE = 16
# Live + removed entries over size: past MAX_LOAD the index is rebuilt, MIN_LOAD full. Linear
# probing's expected probes grow as 1 / (1 - load)^2 for an id not stored (a new row): 8.5 at
# 0.75, 13 at 0.8, 50 at 0.9, so 0.75 stays the ceiling; 0.5 keeps a rebuild every 1.5x of growth.
MAX_LOAD = 0.75
MIN_LOAD = 0.5


def _size_for(rows: int) -> int:
    return max(_MIN_SIZE, math.ceil(rows / MIN_LOAD))


class RowIndex:
    """``id -> slot`` for ids held in an external ``keys`` array (slot -> id)."""

    def __init__(self, rows: int = 0) -> None:
        self.table = np.full(_size_for(rows), EMPTY, dtype=np.int32)  # (size,) slot or EMPTY/TOMB
        self.live = 0
        self.used = 0  # live + tombstones

    @property
    def nbytes(self) -> int:
        return self.table.nbytes

    def _start(self, ids: np.ndarray) -> np.ndarray:
        """(n,) int64 first positions: the hash's high 32 bits times the size, over 2**32 (the
        size is below 2**31, so the product fits in 64 bits)."""
        high = splitmix64(ids.astype(np.int64).view(np.uint64)) >> np.uint64(32)
        return ((high * np.uint64(len(self.table))) >> np.uint64(32)).astype(np.int64)

    def _next(self, pos: np.ndarray) -> np.ndarray:
        pos = pos + 1
        pos[pos == len(self.table)] = 0
        return pos

    def find(self, ids: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(slots (n,) int64, positions (n,) int64) of ``ids``; -1 for ids not indexed."""
        n = len(ids)
        slots = np.full(n, -1, dtype=np.int64)
        where = np.full(n, -1, dtype=np.int64)
        if n == 0 or self.live == 0:
            return slots, where
        pos = self._start(ids)
        todo = np.arange(n)
        while len(todo):
            s = self.table[pos[todo]].astype(np.int64)
            hit = (s >= 0) & (keys[np.maximum(s, 0)] == ids[todo])
            slots[todo[hit]] = s[hit]
            where[todo[hit]] = pos[todo[hit]]
            todo = todo[~hit & (s != EMPTY)]
            pos[todo] = self._next(pos[todo])
        return slots, where

    def insert(self, ids: np.ndarray, slots: np.ndarray, keys: np.ndarray) -> None:
        """Index ``ids`` (unique, none indexed yet) at ``slots``; ``keys`` must hold them already."""
        if self.used + len(ids) > MAX_LOAD * len(self.table):
            self.rebuild(keys, self.live + len(ids))
        self._place(ids, slots)
        self.live += len(ids)
        self.used += len(ids)

    def _place(self, ids: np.ndarray, slots: np.ndarray) -> None:
        pos = self._start(ids)
        todo = np.arange(len(ids))
        while len(todo):
            free = self.table[pos[todo]] < 0
            cand = todo[free]
            # several ids may want the same free position: the first in batch order takes it
            _, first = np.unique(pos[cand], return_index=True)
            won = cand[np.sort(first)]
            self.table[pos[won]] = slots[won]
            lost = np.ones(len(todo), dtype=bool)
            lost[np.searchsorted(todo, won)] = False
            todo = todo[lost]
            pos[todo] = self._next(pos[todo])

    def remove(self, positions: np.ndarray) -> None:
        """Forget the entries at ``positions`` (from ``find``)."""
        self.table[positions] = TOMB
        self.live -= len(positions)

    def move(self, positions: np.ndarray, slots: np.ndarray) -> None:
        """The entries at ``positions`` now point at ``slots`` (rows moved in the caller's arrays)."""
        self.table[positions] = slots

    def rebuild(self, keys: np.ndarray, rows: int) -> None:
        """A fresh index sized for ``rows`` holding every live entry (tombstones dropped)."""
        live = self.table[self.table >= 0].astype(np.int64)
        live.sort()  # slot order: the rebuilt layout does not depend on the old one
        self.table = np.full(_size_for(rows), EMPTY, dtype=np.int32)
        self._place(keys[live], live)
        self.used = self.live = len(live)
