"""An embedding table's rows on one shard: lazily created, each with its version, step count,
optimizer state, last push time and push count, and (``kvps.lifecycle``) admitted, capped and
evicted by rules applied from the log alone.

Rows live in growable numpy arrays (capacity grows by 1.25x, never past the row cap) indexed by an
open-addressing ``id -> slot`` hash index (``kvps.rows``): no Python object per row. A row that is
not stored (never pushed, not admitted yet, or evicted) reads as ``init.rows([id])`` (a pure
function of seed and id) at version ``floor``: 0 until a row is evicted, then one more than any
evicted row's version, so a client caching an evicted row sees its version move forward and pulls
it again. Updates are planned first (pure: nothing changes, any failure leaves the table as it was)
and then committed (assignments only; eviction happens there), so ``ShardState.apply`` can
validate and compute everything before it mutates anything.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from kvps.command import CreateTable
from kvps.errors import KvpsError, ShapeMismatch
from kvps.initializer import Initializer, initializer_from_dict
from kvps.lifecycle import CountAdmission, Lifecycle, Pending, ProbabilityAdmission, least, lifecycle_from_dict
from kvps.optimizer import Optimizer, fitted_state, optimizer_from_dict
from kvps.rows import RowIndex

__all__ = ["RECORD_BYTES", "RowUpdate", "Table"]

_MIN_CAPACITY = 16
# per stored row beyond values and optimizer state: id, version, step, count (int64), last push
# (float64), and the index's entry (4 bytes at load >= 0.5, counted as 8 in the accounting)
RECORD_BYTES = 8 * 5
INDEX_BYTES = 8
_EMPTY = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True, eq=False)
class RowUpdate:
    """A planned update of rows ``ids`` (slot -1: a row created by this update)."""

    ids: np.ndarray  # (n,) int64
    slots: np.ndarray  # (n,) int64
    values: np.ndarray  # (n, dim)
    state: dict[str, np.ndarray]  # name -> (n, *state_row): (n, dim), or (n, 1) for row-wise
    versions: np.ndarray  # (n,) int64
    steps: np.ndarray  # (n,) int64
    pushes: np.ndarray  # (n,) int64 pushes counted for each row (LFU)
    now: float = 0.0  # the cluster time the update happens at
    # CountAdmission: ids leaving the pending counters (admitted), ids counted but not admitted
    admitted: np.ndarray = field(default_factory=lambda: _EMPTY)
    pending_ids: np.ndarray = field(default_factory=lambda: _EMPTY)
    pending_counts: np.ndarray = field(default_factory=lambda: _EMPTY)

    @property
    def new_rows(self) -> int:
        return int((self.slots < 0).sum())


class Table:
    kind = "table"

    def __init__(self, key: str, dim: int, dtype: str, optimizer: dict, init: dict, merge: str,
                 lifecycle: dict | None = None) -> None:
        self.key = key
        self.dim = dim
        self.dtype = np.dtype(dtype)
        self.optimizer_dict = optimizer
        self.init_dict = init
        self.merge = merge
        self.optimizer: Optimizer = optimizer_from_dict(optimizer)
        self.init: Initializer = initializer_from_dict(init)
        self.lifecycle: Lifecycle | None = lifecycle_from_dict(lifecycle)
        # one row's optimizer state: (dim,), or (1,) for an optimizer that keeps a number per row
        self.state_row = self.optimizer.state_shape((0, dim))[1:]
        self.pending = Pending()
        self.index = RowIndex()
        self.n = 0
        self.max_version = 0
        self.floor = 0  # the version of rows not stored (moves past every evicted row's)
        self._allocate(0)

    def definition(self) -> dict:
        out = {"kind": self.kind, "dim": self.dim, "dtype": self.dtype.name,
               "optimizer": self.optimizer_dict, "init": self.init_dict, "merge": self.merge}
        if self.lifecycle is not None:  # only when set: tables without one keep their bytes
            out["lifecycle"] = self.lifecycle.to_dict()
        return out

    @property
    def row_bytes(self) -> int:
        """Accounted bytes of one stored row: values, optimizer state, record and index entry."""
        state = len(self.optimizer.state_names()) * math.prod(self.state_row)
        return (self.dim + state) * self.dtype.itemsize + RECORD_BYTES + INDEX_BYTES

    def nbytes(self, update: RowUpdate | None = None) -> int:
        """Accounted bytes of the rows and pending counters, now or after ``update``."""
        rows, pending = self.n, self.pending.n
        if update is not None:
            rows += update.new_rows
            pending += len(update.pending_ids)
        cap = self.lifecycle.cap if self.lifecycle is not None else None
        if cap is not None:
            rows, pending = min(rows, cap), min(pending, cap)
        return rows * self.row_bytes + pending * (Pending.ENTRY_BYTES + INDEX_BYTES)

    def _allocate(self, capacity: int) -> None:
        self.ids = np.zeros(capacity, dtype=np.int64)  # (cap,) slot -> id
        self.values = np.zeros((capacity, self.dim), dtype=self.dtype)  # (cap, dim)
        self.versions = np.zeros(capacity, dtype=np.int64)  # (cap,)
        self.steps = np.zeros(capacity, dtype=np.int64)  # (cap,)
        self.last = np.zeros(capacity, dtype=np.float64)  # (cap,) cluster time of the last push
        self.count = np.zeros(capacity, dtype=np.int64)  # (cap,) pushes applied to the row
        self.state = {name: np.zeros((capacity, *self.state_row), dtype=self.dtype)
                      for name in self.optimizer.state_names()}  # name -> (cap, *state_row)

    def _columns(self) -> list[np.ndarray]:
        return [self.ids, self.values, self.versions, self.steps, self.last, self.count,
                *self.state.values()]

    def _reserve(self, needed: int) -> None:
        """Grow to hold ``needed`` rows. New arrays replace the old ones (never resized in place),
        so a reader holding the old arrays sees consistent, if stale, data."""
        capacity = len(self.ids)
        if needed <= capacity:
            return
        new_capacity = max(_MIN_CAPACITY, capacity + capacity // 4, needed)
        cap = self.lifecycle.cap if self.lifecycle is not None else None
        if cap is not None:  # a capped table never holds more than its cap between pushes
            new_capacity = max(needed, min(new_capacity, cap))
        old = self._columns()
        self._allocate(new_capacity)
        for new, arr in zip(self._columns(), old):
            new[:self.n] = arr[:self.n]

    def check_rows(self, ids: np.ndarray, grads: object) -> KvpsError | None:
        """Are ``grads`` (len(ids), dim) in the table's dtype?"""
        want = (len(ids), self.dim)
        if isinstance(grads, np.ndarray) and grads.shape == want and grads.dtype == self.dtype:
            return None
        actual = ({"shape": list(grads.shape), "dtype": grads.dtype.name} if isinstance(grads, np.ndarray)
                  else {"type": type(grads).__name__})
        return ShapeMismatch(self.key, {"shape": list(want), "dtype": self.dtype.name}, actual)

    def slots_of(self, ids: np.ndarray) -> np.ndarray:
        """(n,) int64 slots of ``ids``; -1 for rows not stored."""
        return self.index.find(ids.astype(np.int64, copy=False), self.ids)[0]

    def read(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(values (n, dim) copy, versions (n,) int64); rows not stored: init value, ``floor``."""
        slots = self.slots_of(ids)
        stored = slots >= 0
        values = np.empty((len(ids), self.dim), dtype=self.dtype)  # (n, dim)
        values[stored] = self.values[slots[stored]]
        values[~stored] = self.init.rows(ids[~stored], self.dim, self.dtype)
        versions = np.full(len(ids), self.floor, dtype=np.int64)  # (n,)
        versions[stored] = self.versions[slots[stored]]
        return values, versions

    def versions_of(self, ids: np.ndarray) -> np.ndarray:
        """(n,) int64 versions of rows ``ids``; rows not stored: ``floor``."""
        slots = self.slots_of(ids)
        return np.where(slots >= 0, self.versions[np.maximum(slots, 0)], self.floor) if self.n else \
            np.full(len(ids), self.floor, dtype=np.int64)

    def stored(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids sorted, values) of the stored rows (copies)."""
        order = np.argsort(self.ids[:self.n], kind="stable")
        return self.ids[order], self.values[order]

    def plan(self, ids: np.ndarray, grads: np.ndarray, counts: np.ndarray, now: float = 0.0) -> RowUpdate:
        """One optimizer step for rows ``ids`` (sorted, unique), without changing the table. Ids
        the admission rule does not admit yet change nothing but their pending count."""
        slots, stored = self._locate(ids)
        pushes = counts.astype(np.int64)
        admitted = pending_ids = pending_counts = _EMPTY
        admit = self.lifecycle.admit if self.lifecycle is not None else None
        if isinstance(admit, CountAdmission):
            totals = self.pending.counts_of(ids) + pushes  # (n,)
            ok = stored | (totals >= admit.min_count)
            admitted = ids[~stored & ok]
            pending_ids, pending_counts = ids[~ok], totals[~ok]
            pushes = np.where(stored, pushes, totals)
        elif isinstance(admit, ProbabilityAdmission):
            ok = stored | admit.admitted(ids)
        else:
            ok = np.ones(len(ids), dtype=bool)
        if not ok.all():
            ids, grads, counts, slots, stored, pushes = (a[ok] for a in (ids, grads, counts, slots, stored, pushes))
        fresh = self.init.rows(ids[~stored], self.dim, self.dtype)  # (new, dim)
        values = np.empty((len(ids), self.dim), dtype=self.dtype)  # (n, dim)
        values[stored], values[~stored] = self.values[slots[stored]], fresh
        state, steps, versions = self._row_state(slots, stored, fresh)
        new_values, new_state = self.optimizer.step(values, grads, state, steps + 1)
        return RowUpdate(ids, slots, new_values.astype(self.dtype, copy=False), new_state,
                         versions + counts, steps + 1, pushes, now, admitted, pending_ids, pending_counts)

    def plan_set(self, ids: np.ndarray, values: np.ndarray, now: float = 0.0) -> RowUpdate:
        """Rows ``ids`` set to ``values`` (optimizer state and steps kept; new rows start fresh)."""
        slots, stored = self._locate(ids)
        state, steps, versions = self._row_state(slots, stored, values[~stored])
        return RowUpdate(ids, slots, values.astype(self.dtype), state, versions + 1, steps,
                         np.ones(len(ids), dtype=np.int64), now)

    def _locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        slots = self.slots_of(ids)
        return slots, slots >= 0

    def _row_state(self, slots: np.ndarray, stored: np.ndarray,
                   fresh: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
        """Optimizer state, steps and versions of the rows at ``slots``; rows not stored yet
        (``~stored``) get the optimizer's initial state for values ``fresh``."""
        picked = slots[stored]
        fresh_state = self.optimizer.init_state(fresh)
        state = {}
        for name in self.optimizer.state_names():
            rows = np.empty((len(slots), *self.state_row), dtype=self.dtype)  # (n, *state_row)
            rows[stored], rows[~stored] = self.state[name][picked], fresh_state[name]
            state[name] = rows
        steps = np.zeros(len(slots), dtype=np.int64)
        steps[stored] = self.steps[picked]
        versions = np.full(len(slots), self.floor, dtype=np.int64)
        versions[stored] = self.versions[picked]
        return state, steps, versions

    def commit(self, update: RowUpdate) -> None:
        """Apply ``update``: rows already stored first, then (with a lifecycle) eviction makes room,
        then new rows go in, so the arrays never grow past the cap for room that is freed anyway."""
        old, new = np.flatnonzero(update.slots >= 0), np.flatnonzero(update.slots < 0)
        self._write(update, old, update.slots[old])
        if self.lifecycle is not None:
            self._enforce(update.now, update.slots[old], len(new))
        self._reserve(self.n + len(new))
        slots = np.arange(self.n, self.n + len(new), dtype=np.int64)
        self.ids[slots] = update.ids[new]
        self.index.insert(update.ids[new], slots, self.ids)
        self.n += len(new)
        self.count[slots] = 0  # a reused slot may hold an evicted row's count
        self._write(update, new, slots)
        if len(update.versions):
            self.max_version = max(self.max_version, int(update.versions.max()))
        if self.lifecycle is not None:
            if self.lifecycle.cap is not None and self.n > self.lifecycle.cap:  # the push alone overflows
                here = self.slots_of(update.ids)
                self._enforce(update.now, here[here >= 0], 0)
            if isinstance(self.lifecycle.admit, CountAdmission):
                self.pending.update(update.admitted, update.pending_ids, update.pending_counts,
                                    update.now, self.lifecycle.cap, self.lifecycle.ttl_s)

    def _write(self, update: RowUpdate, rows: np.ndarray, slots: np.ndarray) -> None:
        """Entries ``rows`` of ``update`` into ``slots``."""
        self.values[slots] = update.values[rows]
        for name, values in update.state.items():
            self.state[name][slots] = values[rows]
        self.versions[slots] = update.versions[rows]
        self.steps[slots] = update.steps[rows]
        self.last[slots] = update.now
        self.count[slots] += update.pushes[rows]

    def _enforce(self, now: float, pushed: np.ndarray, incoming: int) -> None:
        """Evict rows idle past the time-to-live, then, past the cap (counting ``incoming`` rows
        about to be added), the least recently (LRU) or least frequently (LFU; ties: least
        recently) pushed rows, ties by id; rows of this update (``pushed`` slots) go last."""
        life = self.lifecycle
        if life is None:
            return
        n = self.n
        gone = np.zeros(0, dtype=np.int64)
        if life.ttl_s is not None and n:
            gone = np.flatnonzero(now - self.last[:n] > life.ttl_s)
        over = n + incoming - len(gone) - (life.cap if life.cap is not None else n + incoming)
        over = min(over, n - len(gone) - len(pushed)) if incoming else over  # new rows are not here yet
        if over > 0:
            fresh = np.zeros(n, dtype=bool)
            fresh[pushed] = True
            cols = [self.last[:n], self.ids[:n]]  # views: no copy of the rows' columns
            if life.evict == "lfu":
                cols.insert(0, self.count[:n])
            if len(gone):  # candidates: the rows the time-to-live left
                alive = np.ones(n, dtype=bool)
                alive[gone] = False
                cand = np.flatnonzero(alive)
                gone = np.sort(np.concatenate([gone, cand[least([c[cand] for c in cols], over, fresh[cand])]]))
            else:
                gone = least(cols, over, fresh)
        if len(gone):
            self.evict(gone)

    def evict(self, gone: np.ndarray) -> None:
        """Drop the rows at slots ``gone`` (sorted): the last rows move into the holes."""
        self.floor = max(self.floor, int(self.versions[gone].max()) + 1)
        self.max_version = max(self.max_version, self.floor)
        _, where = self.index.find(self.ids[gone], self.ids)
        self.index.remove(where)
        n_after = self.n - len(gone)
        holes = gone[gone < n_after]  # slots to fill
        tail = np.setdiff1d(np.arange(n_after, self.n), gone, assume_unique=True)  # rows to move
        if len(holes):
            _, moved_at = self.index.find(self.ids[tail], self.ids)
            for col in self._columns():
                col[holes] = col[tail]
            self.index.move(moved_at, holes)
        self.n = n_after

    # ---- snapshot form: rows in id order, so equal tables give equal bytes ----------------------

    def bump_versions(self, floor: int) -> None:
        """Add ``floor`` to every stored row's version (a restore moves versions forward)."""
        self.versions = self.versions.copy()
        self.versions[:self.n] += floor
        if self.floor:
            self.floor += floor
        self.max_version = max(int(self.versions[:self.n].max()) if self.n else 0, self.floor)

    def snapshot_parts(self) -> tuple[dict, list[np.ndarray]]:
        order = np.argsort(self.ids[:self.n], kind="stable")  # (n,) slots in id order
        arrays = [self.ids[order], self.values[order], self.versions[order], self.steps[order]]
        arrays += [self.state[name][order] for name in self.optimizer.state_names()]
        meta = {"key": self.key, **self.definition()}
        if self.lifecycle is not None:  # tables without a lifecycle keep their old snapshot bytes
            meta["floor"] = self.floor
            p = self.pending
            arrays += [self.last[order], self.count[order], p.ids, p.counts, p.last]
        return meta, arrays

    @classmethod
    def from_snapshot(cls, meta: dict, arrays: list[np.ndarray]) -> tuple["Table", int]:
        """The table ``snapshot_parts`` described, and how many arrays it used (ValueError if bad)."""
        cmd = CreateTable(meta["key"], meta["dim"], meta["dtype"], meta["optimizer"], meta["init"],
                          meta["merge"], meta.get("lifecycle"))  # validates the definition
        table = cls(cmd.key, cmd.dim, cmd.dtype, cmd.optimizer, cmd.init, cmd.merge, cmd.lifecycle)
        used = 4 + len(table.optimizer.state_names()) + (5 if table.lifecycle is not None else 0)
        if len(arrays) < used:
            raise ValueError("wrong number of table arrays")
        table._load(arrays[:used])
        table.floor = int(meta.get("floor", 0))
        table.max_version = max(table.max_version, table.floor)
        return table, used

    def _load(self, arrays: list[np.ndarray]) -> None:
        k = 4 + len(self.optimizer.state_names())
        ids, values, versions, steps, *state = arrays[:k]
        n = len(ids)
        if ids.dtype != np.int64 or ids.ndim != 1 or versions.dtype != np.int64 or steps.dtype != np.int64:
            raise ValueError("table ids/versions/steps must be 1-d int64")
        if versions.shape != (n,) or steps.shape != (n,) or len(np.unique(ids)) != n:
            raise ValueError("table arrays disagree")
        state = [fitted_state(self.optimizer, arr, (n, self.dim)) for arr in state]  # (n, *state_row)
        if values.shape != (n, self.dim) or any(arr.dtype != self.dtype for arr in (values, *state)):
            raise ValueError("table rows have the wrong shape or dtype")
        self._allocate(n)
        self.ids[:], self.values[:], self.versions[:], self.steps[:] = ids, values, versions, steps
        for name, arr in zip(self.optimizer.state_names(), state):
            self.state[name][:] = arr
        if len(arrays) > k:
            last, count, p_ids, p_counts, p_last = arrays[k:]
            if last.shape != (n,) or count.shape != (n,) or last.dtype != np.float64 or count.dtype != np.int64:
                raise ValueError("table lifecycle arrays disagree")
            if not (p_ids.shape == p_counts.shape == p_last.shape) or p_ids.ndim != 1:
                raise ValueError("table pending arrays disagree")
            self.last[:], self.count[:] = last, count
            self.pending.replace(p_ids.astype(np.int64), p_counts.astype(np.int64), p_last.astype(np.float64))
        self.index = RowIndex(n)
        self.index.insert(self.ids[:n], np.arange(n, dtype=np.int64), self.ids)
        self.n = n
        self.max_version = int(versions.max()) if n else 0
