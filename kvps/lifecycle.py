"""The rules of a table's row lifecycle: admission, the row cap, eviction order and time-to-live.

``Lifecycle`` is part of a table's definition (``create_table``'s ``lifecycle``) and travels in the
log as a small dict. Every decision is a pure function of the log: admission of an id depends on
the id (``ProbabilityAdmission``: ``splitmix64(seed, id) < p``) or on how many pushes of it were
applied (``CountAdmission``); eviction order on the pushes' leader-stamped ``now`` and counts, ties
broken by id; the time-to-live on the cluster time carried by push commands, never a clock.

``CountAdmission``'s counters of ids not admitted yet live in ``Pending`` (ids, counts and last
push times in numpy arrays behind a ``RowIndex``), capped like the rows: past the table's per-shard
cap the least recently pushed counters are dropped.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvps.errors import InvalidRequest
from kvps.initializer import splitmix64
from kvps.rows import RowIndex

__all__ = ["Admission", "CountAdmission", "EVICT_POLICIES", "Lifecycle", "Pending", "ProbabilityAdmission",
           "Scratch", "admission_to_dict", "least", "lifecycle_from_dict"]

EVICT_POLICIES = ("lru", "lfu")


@dataclass(frozen=True)
class CountAdmission:
    """A row is created by the ``min_count``-th push of its id; earlier pushes only count."""

    min_count: int

    def __post_init__(self) -> None:
        if isinstance(self.min_count, bool) or not isinstance(self.min_count, int) or self.min_count < 1:
            raise InvalidRequest("min_count must be an int >= 1", field="admit")


@dataclass(frozen=True)
class ProbabilityAdmission:
    """An id is admitted iff a hash of (seed, id) falls below ``p``: the same ids on every replica
    and every run; pushes of other ids are dropped (pulls see the initializer)."""

    p: float
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.p, (int, float)) or not 0.0 <= float(self.p) <= 1.0:
            raise InvalidRequest("p must be a number in [0, 1]", field="admit")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**64:
            raise InvalidRequest("seed must be an int in [0, 2**64)", field="admit")

    def admitted(self, ids: np.ndarray) -> np.ndarray:
        """(n,) bool: which ``ids`` are admitted."""
        base = splitmix64(np.array([self.seed], dtype=np.uint64))  # (1,)
        h = splitmix64(base ^ ids.astype(np.int64).view(np.uint64))  # (n,) uint64
        return (h >> np.uint64(11)).astype(np.float64) < float(self.p) * 2.0**53


Admission = CountAdmission | ProbabilityAdmission


def admission_to_dict(admit: Admission | None) -> dict | None:
    if admit is None:
        return None
    if isinstance(admit, CountAdmission):
        return {"name": "count", "min_count": admit.min_count}
    return {"name": "probability", "p": float(admit.p), "seed": admit.seed}


def _admission_from_dict(data: Any) -> Admission | None:
    if data is None:
        return None
    if not isinstance(data, dict):
        raise InvalidRequest("admit must be an object with a 'name'", field="admit")
    if data.get("name") == "count":
        return CountAdmission(data.get("min_count"))  # type: ignore[arg-type]
    if data.get("name") == "probability":
        return ProbabilityAdmission(data.get("p"), data.get("seed", 0))  # type: ignore[arg-type]
    raise InvalidRequest("admit must be 'count' or 'probability'", field="admit")


@dataclass(frozen=True)
class Lifecycle:
    """``max_rows`` for the whole table, split over ``shards`` (each holds ceil(max_rows / shards))."""

    max_rows: int | None = None
    shards: int = 1
    evict: str = "lru"
    ttl_s: float | None = None
    admit: Admission | None = None

    @property
    def cap(self) -> int | None:
        return None if self.max_rows is None else -(-self.max_rows // self.shards)

    def to_dict(self) -> dict:
        return {"max_rows": self.max_rows, "shards": self.shards, "evict": self.evict,
                "ttl_s": self.ttl_s, "admit": admission_to_dict(self.admit)}


def lifecycle_from_dict(data: Any) -> Lifecycle | None:
    """The lifecycle ``data`` describes (None: rows live forever); ``InvalidRequest`` if bad."""
    if data is None:
        return None
    if not isinstance(data, dict) or set(data) - {"max_rows", "shards", "evict", "ttl_s", "admit"}:
        raise InvalidRequest("lifecycle must be an object of max_rows, shards, evict, ttl_s, admit",
                             field="lifecycle")
    max_rows, shards = data.get("max_rows"), data.get("shards", 1)
    if max_rows is not None and (isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1):
        raise InvalidRequest("max_rows must be None or an int >= 1", field="max_rows")
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise InvalidRequest("shards must be an int >= 1", field="shards")
    if data.get("evict", "lru") not in EVICT_POLICIES:
        raise InvalidRequest(f"evict must be one of {EVICT_POLICIES}", field="evict")
    ttl = data.get("ttl_s")
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float))
                            or not math.isfinite(ttl) or ttl <= 0):
        raise InvalidRequest("ttl_s must be None or a positive number", field="ttl_s")
    return Lifecycle(max_rows, shards, data.get("evict", "lru"), None if ttl is None else float(ttl),
                     _admission_from_dict(data.get("admit")))


class Scratch:
    """Work arrays kept between pushes. Past its cap a table runs ``least`` over all its rows on
    every push; fresh row-sized temporaries each time (a copy and a partition of a column, masks:
    1-16 MiB at 1 M rows) were freed into the heap a replica keeps (``HeapTrimmer`` says why).
    One buffer per purpose and dtype, grown by 1.25x."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[str, np.dtype], np.ndarray] = {}

    def take(self, name: str, n: int, dtype: Any) -> np.ndarray:
        """``n`` entries of the ``name`` buffer (contents undefined)."""
        dtype = np.dtype(dtype)
        buf = self._bufs.get((name, dtype))
        if buf is None or len(buf) < n:
            buf = self._bufs[(name, dtype)] = np.empty(max(n, n + n // 4), dtype=dtype)
        return buf[:n]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._bufs.values())


def least(columns: list[np.ndarray], k: int, after: np.ndarray | None = None,
          scratch: Scratch | None = None) -> np.ndarray:
    """Indices of the ``k`` smallest entries in the lexicographic order of ``columns`` (the last
    column unique, e.g. ids), entries flagged in ``after`` (bool) ordered after every other one,
    sorted; O(n) per column (partition, then only the ties go on). ``scratch``: work arrays to
    reuse (else fresh ones); the columns are never written."""
    scratch = scratch if scratch is not None else Scratch()
    idx = None  # None: every entry (the first column is read where it is)
    out = []
    for j, col in enumerate(columns):
        if k <= 0:
            break
        m = len(col) if idx is None else len(idx)
        vals = col if idx is None else np.take(col, idx, out=scratch.take("vals", m, col.dtype))
        if k >= m:
            out.append(np.arange(m) if idx is None else idx)
            k = 0
            break
        flagged = j == 0 and after is not None and bool(after.any())
        top = np.inf if vals.dtype.kind == "f" else np.iinfo(vals.dtype).max
        part = scratch.take("part", m, vals.dtype)
        np.copyto(part, vals)
        if flagged:  # flagged entries count as the dtype's top value, so they come last
            part[after] = top
        part.partition(k - 1)
        t = part[k - 1]
        mask = scratch.take("mask", m, bool)
        np.less(vals, t, out=mask)
        if flagged:
            mask[after] = False
        below = np.flatnonzero(mask)
        np.equal(vals, t, out=mask)
        if flagged:
            mask[after] = t == top
        tied = np.flatnonzero(mask)
        if idx is not None:
            below, tied = idx[below], idx[tied]
        out.append(below)
        k -= len(below)
        idx = tied
        if flagged and t == top:  # the rest come from the flagged: in their own order
            out.append(tied[least([c[tied] for c in columns], k, scratch=scratch)])
            k = 0
            break
    if k > 0 and idx is not None:  # only if the last column was not unique
        out.append(idx[:k])
    return np.sort(np.concatenate(out)) if out else np.zeros(0, dtype=np.int64)


class Pending:
    """Push counts of ids not admitted yet (``CountAdmission``): ids, counts, last push times."""

    ENTRY_BYTES = 8 + 8 + 8

    def __init__(self) -> None:
        self.ids = np.zeros(0, dtype=np.int64)  # (n,)
        self.counts = np.zeros(0, dtype=np.int64)  # (n,)
        self.last = np.zeros(0, dtype=np.float64)  # (n,)
        self.index = RowIndex()

    @property
    def n(self) -> int:
        return len(self.ids)

    @property
    def nbytes(self) -> int:
        return self.n * self.ENTRY_BYTES + self.index.nbytes

    def counts_of(self, ids: np.ndarray) -> np.ndarray:
        if not self.n:
            return np.zeros(len(ids), dtype=np.int64)
        slots, _ = self.index.find(ids, self.ids)
        return np.where(slots >= 0, self.counts[np.maximum(slots, 0)], 0)

    def replace(self, ids: np.ndarray, counts: np.ndarray, last: np.ndarray) -> None:
        """Hold exactly these entries (sorted by id): arrays replaced, index rebuilt. Pending
        entries are small and few next to rows, so rebuilding keeps this simple."""
        order = np.argsort(ids, kind="stable")
        self.ids, self.counts, self.last = ids[order], counts[order], last[order]
        self.index = RowIndex(len(self.ids))
        self.index.insert(self.ids, np.arange(len(self.ids), dtype=np.int64), self.ids)

    def update(self, drop: np.ndarray, ids: np.ndarray, counts: np.ndarray, now: float,
               cap: int | None, ttl_s: float | None) -> None:
        """Forget ``drop`` (admitted ids), set ``ids``' counts to ``counts`` at ``now``, drop
        counters idle past ``ttl_s``, then the least recently pushed past ``cap``."""
        if not len(drop) and not len(ids) and not (ttl_s is not None and self.n):
            return
        keep = ~np.isin(self.ids, np.concatenate([drop, ids]))
        all_ids = np.concatenate([self.ids[keep], ids])
        all_counts = np.concatenate([self.counts[keep], counts])
        all_last = np.concatenate([self.last[keep], np.full(len(ids), now)])
        if ttl_s is not None:
            alive = now - all_last <= ttl_s
            all_ids, all_counts, all_last = all_ids[alive], all_counts[alive], all_last[alive]
        if cap is not None and len(all_ids) > cap:
            gone = least([all_last, all_ids], len(all_ids) - cap)
            alive = np.ones(len(all_ids), dtype=bool)
            alive[gone] = False
            all_ids, all_counts, all_last = all_ids[alive], all_counts[alive], all_last[alive]
        self.replace(all_ids, all_counts, all_last)
