"""An open-addressing hash index ``row id -> slot`` in numpy, for a table's rows on one shard.

No per-row Python object: the index is one int32 array holding slots (``EMPTY`` = -1, ``TOMB`` =
-2 for a removed entry), probed linearly from ``splitmix64(id)`` mapped onto the array by a multiply
and shift (Lemire's fastrange), so the array can have any size, not only a power of two. The ids
themselves live in the caller's ``ids`` array (slot -> id), so an entry is 4 bytes and the index
costs 4 / load bytes per row. A rebuild sizes the array for ``MIN_LOAD`` and entries (tombstones
included) are added up to ``MAX_LOAD``, so while rows are added the index costs 4 / 0.75 to
4 / 0.5 = 5.3-8 bytes per row (``kvps.record.INDEX_BYTES`` counts 8; power-of-two sizes let the load
fall to 0.25, 16 bytes); like the row arrays it does not shrink when rows are evicted. Lookups,
inserts and removals take a whole batch of ids at once, one numpy pass per ``WINDOW`` positions of
the batch's longest probe sequence (not per position: at a load of 0.75 the longest of a few
hundred new ids runs ~100 positions). Every outcome is a pure function of the ids and the order of
operations, so replicas applying the same log hold the same index (which, besides, decides nothing
but where an entry sits; snapshots do not hold it).
"""
from __future__ import annotations

import math

import numpy as np

from kvps.initializer import splitmix64

__all__ = ["EMPTY", "MAX_LOAD", "MIN_LOAD", "PLACE_RUN", "RowIndex", "WINDOW"]

EMPTY = -1
TOMB = -2
_MIN_SIZE = 16
WINDOW = 8  # positions probed per numpy pass
_STEPS = np.arange(WINDOW, dtype=np.int64)
PLACE_RUN = 1 << 16  # ids placed per run: (run, WINDOW) work arrays of a few MiB
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

    def _windows(self, pos: np.ndarray) -> np.ndarray:
        """(n, WINDOW) int64: the ``WINDOW`` positions probed from each of ``pos``, wrapping."""
        win = pos[:, None] + _STEPS
        win[win >= len(self.table)] -= len(self.table)  # the size is at least WINDOW: one wrap at most
        return win

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
            win = self._windows(pos[todo])
            s = self.table[win].astype(np.int64)  # (m, WINDOW)
            hit = (s >= 0) & (keys[np.maximum(s, 0)] == ids[todo, None])
            # an id sits before the first EMPTY of its probe sequence (removals leave TOMB), so a
            # hit is always ahead of an EMPTY in the same window
            found = hit.any(axis=1)
            at = hit.argmax(axis=1)[found]
            rows = np.flatnonzero(found)
            slots[todo[found]] = s[rows, at]
            where[todo[found]] = win[rows, at]
            more = ~found & ~(s == EMPTY).any(axis=1)
            todo = todo[more]
            pos[todo] = win[more, -1] + 1
            pos[pos == len(self.table)] = 0
        return slots, where

    def insert(self, ids: np.ndarray, slots: np.ndarray, keys: np.ndarray) -> None:
        """Index ``ids`` (unique, none indexed yet) at ``slots``; ``keys`` must hold them already."""
        if self.used + len(ids) > MAX_LOAD * len(self.table):
            self.rebuild(keys, self.live + len(ids))
        self._place(ids, slots)
        self.live += len(ids)
        self.used += len(ids)

    def _place(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Each id into the first free (EMPTY or TOMB) position of its probe sequence, so every
        position between an id's start and its own is occupied when it is placed (what ``find``
        relies on); ids wanting the same position: the first in batch order takes it, the others
        probe on from the next one. In runs of ``PLACE_RUN`` ids, in order: a rebuild places
        every live id, and (n, WINDOW) work arrays for 1 M of them were ~140 MiB at once."""
        for lo in range(0, len(ids), PLACE_RUN):
            self._place_run(ids[lo:lo + PLACE_RUN], slots[lo:lo + PLACE_RUN])

    def _place_run(self, ids: np.ndarray, slots: np.ndarray) -> None:
        pos = self._start(ids)
        todo = np.arange(len(ids))
        while len(todo):
            win = self._windows(pos[todo])
            free = self.table[win] < 0  # (m, WINDOW)
            has = free.any(axis=1)
            want = win[np.arange(len(todo)), free.argmax(axis=1)]  # (m,) where has
            cand = np.flatnonzero(has)
            _, first = np.unique(want[cand], return_index=True)  # the first in batch order wins
            won = cand[first]
            self.table[want[won]] = slots[todo[won]]
            lost = np.ones(len(todo), dtype=bool)
            lost[won] = False
            # a loser probes on after the position it lost; a full window: after the window
            nxt = np.where(has, want + 1, win[:, -1] + 1)
            nxt[nxt == len(self.table)] = 0
            pos[todo[lost]] = nxt[lost]
            todo = todo[lost]

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
