"""An embedding table's rows on one shard: lazily created, each with its version, optimizer state
and the record columns its definition reads (``kvps.record``: step count, last push time, push
count), and (``kvps.lifecycle``) admitted, capped and evicted by rules applied from the log alone.

Rows live in growable numpy arrays (capacity grows by 1.25x; a capped table's jumps to its cap
once halfway there and never passes it) indexed by an
open-addressing ``id -> slot`` hash index (``kvps.rows``): no Python object per row. A row that is
not stored (never pushed, not admitted yet, or evicted) reads as ``init.rows([id])`` (a pure
function of seed and id) at version ``floor``: 0 until a row is evicted, then one more than any
evicted row's version, so a client caching an evicted row sees its version move forward and pulls
it again. Updates are planned first (pure: nothing changes, any failure leaves the table as it was)
and then committed (assignments only; eviction happens there), so ``ShardState.apply`` can
validate and compute everything before it mutates anything.

Snapshots (``snapshot_parts``) hold the rows in id order. Layout 2 (meta ``"layout": 2``) holds
the columns the table keeps (ids, versions and steps as int64 whatever their width in memory: frames
carry no uint32, and the widths follow from the values); layout 1 (no ``"layout"``: every row with
int64 id, version and step, and with a lifecycle float64 last push and int64 count) is still read,
the columns the table does not keep dropped.

Past 450 lines: planning, committing and evicting share the columns and their widths, which is
the point of one class; the snapshot form (~90 lines) is the part that could move out next.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from kvps.command import CreateTable
from kvps.errors import KvpsError, ShapeMismatch
from kvps.initializer import Initializer, initializer_from_dict
from kvps.lifecycle import (
    CountAdmission, Lifecycle, Pending, ProbabilityAdmission, Scratch, least, lifecycle_from_dict,
)
from kvps.optimizer import Optimizer, fitted_state, optimizer_from_dict
from kvps.record import INDEX_BYTES, RecordLayout, far_ids, id_dtype, version_dtype
from kvps.rows import RowIndex

__all__ = ["LAYOUT", "RowUpdate", "Table"]

LAYOUT = 2  # the snapshot layout written (see the module's docstring)
_MIN_CAPACITY = 16
_EMPTY = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True, eq=False)
class RowUpdate:
    """A planned update of rows ``ids`` (slot -1: a row created by this update)."""

    ids: np.ndarray  # (n,) int64
    slots: np.ndarray  # (n,) int64
    values: np.ndarray  # (n, dim)
    state: dict[str, np.ndarray]  # name -> (n, *state_row): (n, dim), or (n, 1) for row-wise
    versions: np.ndarray  # (n,) int64
    steps: np.ndarray  # (n,) int64 (ones when the table keeps no steps)
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
        self.record = RecordLayout.of(self.optimizer, self.lifecycle)
        self.pending = Pending()
        self.index = RowIndex()
        self.n = 0
        self.far = 0  # stored ids outside [0, 2**32): the ids column is int64 while there are any
        self.max_version = 0  # the versions (and steps) column is int64 once this passes 2**32 - 1
        self.floor = 0  # the version of rows not stored (moves past every evicted row's)
        self._scratch = Scratch()  # eviction's work arrays, kept (not state)
        # rows a capped (or expiring) table added or evicted since this process built it (not state)
        self.churned = 0
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
        return self._row_bytes(self.far, self.max_version)

    def _row_bytes(self, far: int, max_version: int) -> int:
        state = len(self.optimizer.state_names()) * math.prod(self.state_row)
        return (self.dim + state) * self.dtype.itemsize + self.record.bytes(far, max_version)

    def nbytes(self, update: RowUpdate | None = None) -> int:
        """Accounted bytes of the rows and pending counters, now or after ``update`` (at the
        widths its new ids and versions need, before eviction may narrow them again)."""
        rows, pending, far, top = self.n, self.pending.n, self.far, self.max_version
        if update is not None:
            rows += update.new_rows
            pending += len(update.pending_ids)
            far += far_ids(update.ids[update.slots < 0])
            top = max(top, int(update.versions.max()) if len(update.versions) else 0)
        cap = self.lifecycle.cap if self.lifecycle is not None else None
        if cap is not None:
            rows, pending = min(rows, cap), min(pending, cap)
        return rows * self._row_bytes(far, top) + pending * (Pending.ENTRY_BYTES + INDEX_BYTES)

    def _allocate(self, capacity: int) -> None:
        ids, counter, keep = id_dtype(self.far), version_dtype(self.max_version), self.record
        self.ids = np.zeros(capacity, dtype=ids)  # (cap,) slot -> id
        self.values = np.zeros((capacity, self.dim), dtype=self.dtype)  # (cap, dim)
        self.versions = np.zeros(capacity, dtype=counter)  # (cap,)
        self.steps = np.zeros(capacity, dtype=counter) if keep.steps else None  # (cap,)
        # (cap,) cluster time of the last push; (cap,) pushes applied to the row
        self.last = np.zeros(capacity, dtype=np.float64) if keep.last else None
        self.count = np.zeros(capacity, dtype=np.int64) if keep.count else None
        self.state = {name: np.zeros((capacity, *self.state_row), dtype=self.dtype)
                      for name in self.optimizer.state_names()}  # name -> (cap, *state_row)

    def _columns(self) -> list[np.ndarray]:
        cols = [self.ids, self.values, self.versions, self.steps, self.last, self.count, *self.state.values()]
        return [c for c in cols if c is not None]

    def _fit_widths(self) -> None:
        """Ids, versions and steps in the widths ``far`` and ``max_version`` call for (new arrays
        where they change, never written in place: readers may hold the old ones)."""
        ids, counter = id_dtype(self.far), version_dtype(self.max_version)
        if self.ids.dtype != ids:
            self.ids = self.ids.astype(ids)  # narrowing: every stored id fits (far == 0)
        if self.versions.dtype != counter:  # only ever widens: max_version never decreases
            self.versions = self.versions.astype(counter)
            self.steps = self.steps.astype(counter) if self.steps is not None else None

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
            if 2 * new_capacity >= cap:  # once halfway, the cap at once: pages untouched cost no
                new_capacity = max(needed, cap)  # memory, and no later growth holds old + new
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
        if stored.all():  # every row stored: two gathers
            return self.values[slots], self.versions[slots].astype(np.int64)
        values = np.empty((len(ids), self.dim), dtype=self.dtype)  # (n, dim)
        values[stored] = self.values[slots[stored]]
        values[~stored] = self.init.rows(ids[~stored], self.dim, self.dtype)
        versions = np.full(len(ids), self.floor, dtype=np.int64)  # (n,)
        versions[stored] = self.versions[slots[stored]]
        return values, versions

    def changed(self, ids: np.ndarray, have: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(versions (n,) int64 of rows ``ids``, values (m, dim) of the m rows whose version differs
        from ``have``, in ``ids`` order) from one lookup; rows not stored as in ``read``."""
        slots = self.slots_of(ids)
        stored = slots >= 0
        versions = np.full(len(ids), self.floor, dtype=np.int64)  # (n,)
        versions[stored] = self.versions[slots[stored]]
        diff = versions != have
        slots, stored = slots[diff], stored[diff]
        if stored.all():
            return versions, self.values[slots]
        values = np.empty((len(slots), self.dim), dtype=self.dtype)  # (m, dim)
        values[stored] = self.values[slots[stored]]
        values[~stored] = self.init.rows(ids[diff][~stored], self.dim, self.dtype)
        return versions, values

    def stored(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids sorted (int64), values) of the stored rows (copies)."""
        order = np.argsort(self.ids[:self.n], kind="stable")
        return self.ids[order].astype(np.int64), self.values[order]

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
        if stored.all():  # every row stored (a steady state): no initializer, no masks
            fresh, values = np.empty((0, self.dim), dtype=self.dtype), self.values[slots]  # (0, dim), (n, dim)
        else:
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
        steps = np.zeros(len(slots), dtype=np.int64)  # (n,) all 0 where no steps are kept: unread
        if self.steps is not None:
            steps[stored] = self.steps[picked]
        versions = np.full(len(slots), self.floor, dtype=np.int64)
        versions[stored] = self.versions[picked]
        return state, steps, versions

    def commit(self, update: RowUpdate) -> None:
        """Apply ``update``: rows already stored first, then (with a lifecycle) eviction makes room,
        then new rows go in, so the arrays never grow past the cap for room that is freed anyway."""
        old, new = np.flatnonzero(update.slots >= 0), np.flatnonzero(update.slots < 0)
        if len(update.versions):  # widths first: a version or id that does not fit never wraps
            self.max_version = max(self.max_version, int(update.versions.max()))
        self._fit_widths()
        self._write(update, old, update.slots[old])
        if self.lifecycle is not None:
            self._enforce(update.now, update.slots[old], len(new))
        if not len(new) and self.lifecycle is None:
            return  # nothing to add, nothing to enforce
        self.far += far_ids(update.ids[new])
        self._fit_widths()
        self._reserve(self.n + len(new))
        slots = np.arange(self.n, self.n + len(new), dtype=np.int64)
        self.ids[slots] = update.ids[new]
        self.index.insert(update.ids[new], slots, self.ids)
        self.n += len(new)
        if self.lifecycle is not None:
            self.churned += len(new)
        if self.count is not None:
            self.count[slots] = 0  # a reused slot may hold an evicted row's count
        self._write(update, new, slots)
        if self.lifecycle is not None:
            if self.lifecycle.cap is not None and self.n > self.lifecycle.cap:  # the push alone overflows
                here = self.slots_of(update.ids)
                self._enforce(update.now, here[here >= 0], 0)
            if isinstance(self.lifecycle.admit, CountAdmission):
                self.pending.update(update.admitted, update.pending_ids, update.pending_counts,
                                    update.now, self.lifecycle.cap, self.lifecycle.ttl_s)
            self._fit_widths()  # eviction may have taken the last far id

    def _write(self, update: RowUpdate, rows: np.ndarray, slots: np.ndarray) -> None:
        """Entries ``rows`` of ``update`` into ``slots``."""
        self.values[slots] = update.values[rows]
        for name, values in update.state.items():
            self.state[name][slots] = values[rows]
        self.versions[slots] = update.versions[rows]
        if self.steps is not None:
            self.steps[slots] = update.steps[rows]
        if self.last is not None:
            self.last[slots] = update.now
        if self.count is not None:
            self.count[slots] += update.pushes[rows]

    def _enforce(self, now: float, pushed: np.ndarray, incoming: int) -> None:
        """Evict rows idle past the time-to-live, then, past the cap (counting ``incoming`` rows
        about to be added), the least recently (LRU) or least frequently (LFU; ties: least
        recently) pushed rows, ties by id; rows of this update (``pushed`` slots) go last."""
        life = self.lifecycle
        if life is None:
            return
        n, scratch = self.n, self._scratch
        gone = np.zeros(0, dtype=np.int64)
        if life.ttl_s is not None and n:
            idle = np.subtract(now, self.last[:n], out=scratch.take("idle", n, np.float64))
            gone = np.flatnonzero(np.greater(idle, life.ttl_s, out=scratch.take("expired", n, bool)))
        over = n + incoming - len(gone) - (life.cap if life.cap is not None else n + incoming)
        over = min(over, n - len(gone) - len(pushed)) if incoming else over  # new rows are not here yet
        if over > 0:
            fresh = scratch.take("fresh", n, bool)
            fresh[:] = False
            fresh[pushed] = True
            cols = [self.last[:n], self.ids[:n]]  # views: no copy of the rows' columns
            if life.evict == "lfu":
                cols.insert(0, self.count[:n])
            if len(gone):  # candidates: the rows the time-to-live left
                alive = scratch.take("alive", n, bool)
                alive[:] = True
                alive[gone] = False
                cand = np.flatnonzero(alive)
                chosen = least([c[cand] for c in cols], over, fresh[cand], scratch)
                gone = np.sort(np.concatenate([gone, cand[chosen]]))
            else:
                gone = least(cols, over, fresh, scratch)
        if len(gone):
            self.evict(gone)

    def evict(self, gone: np.ndarray) -> None:
        """Drop the rows at slots ``gone`` (sorted): the last rows move into the holes."""
        self.floor = max(self.floor, int(self.versions[gone].max()) + 1)
        self.max_version = max(self.max_version, self.floor)
        self.far -= far_ids(self.ids[gone])  # the caller narrows the ids column (_fit_widths)
        _, where = self.index.find(self.ids[gone], self.ids)
        self.index.remove(where)
        n_after = self.n - len(gone)
        self.churned += len(gone)
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
        bumped = self.versions[:self.n].astype(np.int64) + floor  # (n,)
        if self.floor:
            self.floor += floor
        self.max_version = max(int(bumped.max()) if self.n else 0, self.floor)
        self.versions = self.versions.copy()  # a new array: readers may hold the old one
        self._fit_widths()
        self.versions[:self.n] = bumped

    def snapshot_parts(self) -> tuple[dict, list[np.ndarray]]:
        order = np.argsort(self.ids[:self.n], kind="stable")  # (n,) slots in id order
        arrays = [self.ids[order].astype(np.int64), self.values[order], self.versions[order].astype(np.int64)]
        arrays += [self.steps[order].astype(np.int64)] if self.steps is not None else []
        arrays += [self.state[name][order] for name in self.optimizer.state_names()]
        arrays += [c[order] for c in (self.last, self.count) if c is not None]
        meta = {"key": self.key, **self.definition(), "layout": LAYOUT}
        if self.lifecycle is not None:
            meta["floor"] = self.floor
            p = self.pending
            arrays += [p.ids, p.counts, p.last]
        return meta, arrays

    @classmethod
    def from_snapshot(cls, meta: dict, arrays: list[np.ndarray]) -> tuple["Table", int]:
        """The table ``snapshot_parts`` described (layout 1 or 2), and how many arrays it used
        (ValueError if bad)."""
        cmd = CreateTable(meta["key"], meta["dim"], meta["dtype"], meta["optimizer"], meta["init"],
                          meta["merge"], meta.get("lifecycle"))  # validates the definition
        table = cls(cmd.key, cmd.dim, cmd.dtype, cmd.optimizer, cmd.init, cmd.merge, cmd.lifecycle)
        layout, keep, life = meta.get("layout", 1), table.record, table.lifecycle is not None
        if layout == 1:  # every column, lifecycle columns with any lifecycle
            has = {"steps": True, "last": life, "count": life}
        elif layout == 2:
            has = {"steps": keep.steps, "last": keep.last, "count": keep.count}
        else:
            raise ValueError(f"unknown table layout {layout!r}")
        k = len(table.optimizer.state_names())
        used = 3 + k + sum(has.values()) + (3 if life else 0)
        if len(arrays) < used:
            raise ValueError("wrong number of table arrays")
        rest = list(arrays[:used])
        ids, values, versions = rest[:3]
        del rest[:3]
        steps = rest.pop(0) if has["steps"] else None
        state, rest = rest[:k], rest[k:]
        last = rest.pop(0) if has["last"] else None
        count = rest.pop(0) if has["count"] else None
        table.floor = int(meta.get("floor", 0))
        table._load(ids, values, versions, steps if keep.steps else None, state,  # layout 1: the
                    last if keep.last else None, count if keep.count else None, rest)  # unread dropped
        return table, used

    def _load(self, ids: np.ndarray, values: np.ndarray, versions: np.ndarray, steps: np.ndarray | None,
              state: list[np.ndarray], last: np.ndarray | None, count: np.ndarray | None,
              pending: list[np.ndarray]) -> None:
        n = len(ids)
        if any(a.dtype != np.int64 or a.shape != (n,) for a in (ids, versions, steps) if a is not None):
            raise ValueError("table ids/versions/steps must be 1-d int64, one per row")
        if len(np.unique(ids)) != n or (n and int(versions.min()) < 0):
            raise ValueError("table ids repeat or versions are negative")
        state = [fitted_state(self.optimizer, arr, (n, self.dim)) for arr in state]  # (n, *state_row)
        if values.shape != (n, self.dim) or any(arr.dtype != self.dtype for arr in (values, *state)):
            raise ValueError("table rows have the wrong shape or dtype")
        for arr, dtype in ((last, np.float64), (count, np.int64)):
            if arr is not None and (arr.shape != (n,) or arr.dtype != dtype):
                raise ValueError("table lifecycle arrays disagree")
        self.far = far_ids(ids)
        self.max_version = max(int(versions.max()) if n else 0, self.floor)
        counter = version_dtype(self.max_version)
        if steps is not None and n and not 0 <= int(steps.min()) <= int(steps.max()) <= np.iinfo(counter).max:
            raise ValueError("table steps out of range (a step never passes its row's version)")
        self._allocate(n)
        self.ids[:], self.values[:], self.versions[:] = ids, values, versions
        for col, arr in ((self.steps, steps), (self.last, last), (self.count, count)):
            if col is not None:
                col[:] = arr
        for name, arr in zip(self.optimizer.state_names(), state):
            self.state[name][:] = arr
        if pending:
            p_ids, p_counts, p_last = pending
            if not (p_ids.shape == p_counts.shape == p_last.shape) or p_ids.ndim != 1:
                raise ValueError("table pending arrays disagree")
            self.pending.replace(p_ids.astype(np.int64), p_counts.astype(np.int64), p_last.astype(np.float64))
        self.index = RowIndex(n)
        self.index.insert(self.ids[:n], np.arange(n, dtype=np.int64), self.ids)
        self.n = n
