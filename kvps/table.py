"""An embedding table's rows on one shard: lazily created, each with its version, step count and
optimizer state.

Rows live in growable arrays (capacity doubles) indexed by an ``id -> slot`` dict. A row that was
never pushed is not stored: its value is ``init.rows([id])`` (a pure function of seed and id) and
its version 0. Updates are planned first (pure: nothing changes, any failure leaves the table as
it was) and then committed (assignments only), so ``ShardState.apply`` can validate and compute
everything before it mutates anything.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvps.command import CreateTable
from kvps.errors import KvpsError, ShapeMismatch
from kvps.initializer import Initializer, initializer_from_dict
from kvps.optimizer import Optimizer, optimizer_from_dict

__all__ = ["RowUpdate", "Table"]

_MIN_CAPACITY = 16


@dataclass(frozen=True, eq=False)
class RowUpdate:
    """A planned update of rows ``ids`` (slot -1: a row created by this update)."""

    ids: np.ndarray  # (n,) int64
    slots: np.ndarray  # (n,) int64
    values: np.ndarray  # (n, dim)
    state: dict[str, np.ndarray]  # name -> (n, dim)
    versions: np.ndarray  # (n,) int64
    steps: np.ndarray  # (n,) int64


class Table:
    kind = "table"

    def __init__(self, key: str, dim: int, dtype: str, optimizer: dict, init: dict, merge: str) -> None:
        self.key = key
        self.dim = dim
        self.dtype = np.dtype(dtype)
        self.optimizer_dict = optimizer
        self.init_dict = init
        self.merge = merge
        self.optimizer: Optimizer = optimizer_from_dict(optimizer)
        self.init: Initializer = initializer_from_dict(init)
        self.slots: dict[int, int] = {}
        self.n = 0
        self.max_version = 0
        self._allocate(0)

    def definition(self) -> dict:
        return {"kind": self.kind, "dim": self.dim, "dtype": self.dtype.name,
                "optimizer": self.optimizer_dict, "init": self.init_dict, "merge": self.merge}

    def _allocate(self, capacity: int) -> None:
        self.ids = np.zeros(capacity, dtype=np.int64)  # (cap,) slot -> id
        self.values = np.zeros((capacity, self.dim), dtype=self.dtype)  # (cap, dim)
        self.versions = np.zeros(capacity, dtype=np.int64)  # (cap,)
        self.steps = np.zeros(capacity, dtype=np.int64)  # (cap,)
        self.state = {name: np.zeros((capacity, self.dim), dtype=self.dtype)
                      for name in self.optimizer.state_names()}  # name -> (cap, dim)

    def _reserve(self, needed: int) -> None:
        """Grow to hold ``needed`` rows. New arrays replace the old ones (never resized in place),
        so a reader holding the old arrays sees consistent, if stale, data."""
        capacity = len(self.ids)
        if needed <= capacity:
            return
        new_capacity = max(_MIN_CAPACITY, capacity * 2, needed)
        old = (self.ids, self.values, self.versions, self.steps, self.state)
        self._allocate(new_capacity)
        n = self.n
        self.ids[:n], self.values[:n], self.versions[:n], self.steps[:n] = (a[:n] for a in old[:4])
        for name, arr in old[4].items():
            self.state[name][:n] = arr[:n]

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
        get = self.slots.get
        return np.fromiter((get(i, -1) for i in ids.tolist()), dtype=np.int64, count=len(ids))

    def read(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(values (n, dim) copy, versions (n,) int64); untouched rows: init value, version 0."""
        slots = self.slots_of(ids)
        stored = slots >= 0
        values = np.empty((len(ids), self.dim), dtype=self.dtype)  # (n, dim)
        values[stored] = self.values[slots[stored]]
        values[~stored] = self.init.rows(ids[~stored], self.dim, self.dtype)
        versions = np.zeros(len(ids), dtype=np.int64)  # (n,)
        versions[stored] = self.versions[slots[stored]]
        return values, versions

    def plan(self, ids: np.ndarray, grads: np.ndarray, counts: np.ndarray) -> RowUpdate:
        """One optimizer step for rows ``ids`` (sorted, unique), without changing the table."""
        slots, stored = self._locate(ids)
        fresh = self.init.rows(ids[~stored], self.dim, self.dtype)  # (new, dim)
        values = np.empty((len(ids), self.dim), dtype=self.dtype)  # (n, dim)
        values[stored], values[~stored] = self.values[slots[stored]], fresh
        state, steps, versions = self._row_state(slots, stored, fresh)
        new_values, new_state = self.optimizer.step(values, grads, state, steps + 1)
        return RowUpdate(ids, slots, new_values.astype(self.dtype, copy=False), new_state,
                         versions + counts, steps + 1)

    def plan_set(self, ids: np.ndarray, values: np.ndarray) -> RowUpdate:
        """Rows ``ids`` set to ``values`` (optimizer state and steps kept; new rows start fresh)."""
        slots, stored = self._locate(ids)
        state, steps, versions = self._row_state(slots, stored, values[~stored])
        return RowUpdate(ids, slots, values.astype(self.dtype), state, versions + 1, steps)

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
            rows = np.empty((len(slots), self.dim), dtype=self.dtype)  # (n, dim)
            rows[stored], rows[~stored] = self.state[name][picked], fresh_state[name]
            state[name] = rows
        steps = np.zeros(len(slots), dtype=np.int64)
        steps[stored] = self.steps[picked]
        versions = np.zeros(len(slots), dtype=np.int64)
        versions[stored] = self.versions[picked]
        return state, steps, versions

    def commit(self, update: RowUpdate) -> None:
        slots = update.slots.copy()
        new = np.flatnonzero(slots < 0)
        self._reserve(self.n + len(new))
        slots[new] = np.arange(self.n, self.n + len(new), dtype=np.int64)
        for i, slot in zip(update.ids[new].tolist(), slots[new].tolist()):
            self.slots[i] = slot
        self.ids[slots] = update.ids
        self.n += len(new)
        self.values[slots] = update.values
        for name, rows in update.state.items():
            self.state[name][slots] = rows
        self.versions[slots] = update.versions
        self.steps[slots] = update.steps
        if len(update.versions):
            self.max_version = max(self.max_version, int(update.versions.max()))

    # ---- snapshot form: rows in id order, so equal tables give equal bytes ----------------------

    def bump_versions(self, floor: int) -> None:
        """Add ``floor`` to every stored row's version (a restore moves versions forward)."""
        self.versions = self.versions.copy()
        self.versions[:self.n] += floor
        self.max_version = int(self.versions[:self.n].max()) if self.n else 0

    def snapshot_parts(self) -> tuple[dict, list[np.ndarray]]:
        order = np.argsort(self.ids[:self.n], kind="stable")  # (n,) slots in id order
        arrays = [self.ids[order], self.values[order], self.versions[order], self.steps[order]]
        arrays += [self.state[name][order] for name in self.optimizer.state_names()]
        return {"key": self.key, **self.definition()}, arrays

    @classmethod
    def from_snapshot(cls, meta: dict, arrays: list[np.ndarray]) -> tuple["Table", int]:
        """The table ``snapshot_parts`` described, and how many arrays it used (ValueError if bad)."""
        cmd = CreateTable(meta["key"], meta["dim"], meta["dtype"], meta["optimizer"], meta["init"],
                          meta["merge"])  # validates the definition
        table = cls(cmd.key, cmd.dim, cmd.dtype, cmd.optimizer, cmd.init, cmd.merge)
        used = 4 + len(table.optimizer.state_names())
        if len(arrays) < used:
            raise ValueError("wrong number of table arrays")
        table._load(arrays[:used])
        return table, used

    def _load(self, arrays: list[np.ndarray]) -> None:
        names = self.optimizer.state_names()
        ids, values, versions, steps, *state = arrays
        n = len(ids)
        if ids.dtype != np.int64 or ids.ndim != 1 or versions.dtype != np.int64 or steps.dtype != np.int64:
            raise ValueError("table ids/versions/steps must be 1-d int64")
        if versions.shape != (n,) or steps.shape != (n,) or len(np.unique(ids)) != n:
            raise ValueError("table arrays disagree")
        for arr in (values, *state):
            if arr.shape != (n, self.dim) or arr.dtype != self.dtype:
                raise ValueError("table rows have the wrong shape or dtype")
        self._allocate(n)
        self.ids[:], self.values[:], self.versions[:], self.steps[:] = ids, values, versions, steps
        for name, arr in zip(names, state):
            self.state[name][:] = arr
        self.slots = {i: slot for slot, i in enumerate(ids.tolist())}
        self.n = n
        self.max_version = int(versions.max()) if n else 0
