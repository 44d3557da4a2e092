"""What a table keeps per stored row beyond its values and optimizer state, and the bytes the memory
limit counts for it (``kvps.capacity``).

A row always has its id and its version (the pull protocol: caches, follower reads). The other
columns exist only where the table's definition reads them:

- a step count, for optimizers whose formula reads it (``Optimizer.uses_step``: Adam's bias
  corrections, Adagrad's ``lr_decay``, SGD's first momentum step);
- the cluster time of the row's last push (float64), with a time-to-live or a row cap (LRU order;
  LFU breaks ties with it);
- the pushes applied to the row (int64), for a capped LFU table.

Ids and versions (and steps, which never pass the versions) are uint32 while that holds every
value, and int64 otherwise, chosen from the stored state alone so that a replica that replayed the
log and one that restored a snapshot of it agree, bytes and accounting included:

- ids are int64 while any stored id is outside [0, 2**32) (``far_ids`` counts them; when the last
  one is evicted the column narrows again);
- versions are int64 once the table's ``max_version`` passes 2**32 - 1. ``max_version`` is
  ``max(stored versions, floor)`` after a restore and, replayed, the largest version ever written:
  the same number, because a row only leaves by eviction and the floor moves past every evicted
  row's version. It never decreases, so the column never narrows again. A step count grows by one
  per push entry and a version by at least one (``RowDelta.counts >= 1``; a set adds one to the
  version only), so ``step <= version`` and steps fit wherever versions do.

A value that would not fit widens the column (a new array: readers holding the old one see
consistent, if stale, data) before it is written: nothing wraps. A hot row pushed 10,000 times a
second passes 2**32 after five days; the table then pays 4 bytes more per row from that push on.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["INDEX_BYTES", "RecordLayout", "U32_MAX", "far_ids", "id_dtype", "version_dtype"]

U32_MAX = 2**32 - 1
# The hash index's entry (``kvps.rows``): 4 bytes at a load of at least ``rows.MIN_LOAD`` (0.5)
# while rows are added, so at most 8 a row. Like the row arrays, the index does not shrink when
# rows are evicted.
INDEX_BYTES = 8


def far_ids(ids: np.ndarray) -> int:
    """How many of ``ids`` a uint32 column cannot hold."""
    if ids.dtype == np.uint32 or not len(ids):
        return 0
    return int(np.count_nonzero((ids < 0) | (ids > U32_MAX)))


def id_dtype(far: int) -> np.dtype:
    return np.dtype(np.int64 if far else np.uint32)


def version_dtype(max_version: int) -> np.dtype:
    return np.dtype(np.int64 if max_version > U32_MAX else np.uint32)


@dataclass(frozen=True)
class RecordLayout:
    """Which optional columns a table keeps, fixed by its definition."""

    steps: bool  # a step count per row
    last: bool  # the cluster time of the last push
    count: bool  # pushes applied to the row

    @classmethod
    def of(cls, optimizer: Any, lifecycle: Any) -> "RecordLayout":
        """From the table's creation-time optimizer (schedules never change ``uses_step``,
        ``kvps.hyper`` checks) and its ``Lifecycle`` (or None)."""
        capped = lifecycle is not None and lifecycle.cap is not None
        timed = lifecycle is not None and lifecycle.ttl_s is not None
        return cls(steps=optimizer.uses_step(), last=capped or timed,
                   count=capped and lifecycle.evict == "lfu")

    def bytes(self, far: int, max_version: int) -> int:
        """Accounted bytes of one row's record and index entry, at these widths."""
        ids, versions = id_dtype(far).itemsize, version_dtype(max_version).itemsize
        return ids + versions * (1 + self.steps) + 8 * (self.last + self.count) + INDEX_BYTES
