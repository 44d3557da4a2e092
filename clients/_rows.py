"""The embedding rows a client holds, with their versions, for incremental row pulls."""
from __future__ import annotations

import numpy as np

__all__ = ["RowCache"]


class RowCache:
    def __init__(self, dim: int, dtype: np.dtype) -> None:
        self.ids = np.empty(0, dtype=np.int64)            # (n,) sorted
        self.versions = np.empty(0, dtype=np.int64)       # (n,)
        self.values = np.empty((0, dim), dtype=dtype)     # (n, dim)

    def _positions(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        pos = np.searchsorted(self.ids, ids)
        found = pos < len(self.ids)
        found[found] = self.ids[pos[found]] == ids[found]
        return pos, found

    def have(self, ids: np.ndarray) -> np.ndarray:
        """(m,) versions held for sorted unique ``ids``; -1 where not held."""
        pos, found = self._positions(ids)
        out = np.full(len(ids), -1, dtype=np.int64)
        out[found] = self.versions[pos[found]]
        return out

    def update(self, ids: np.ndarray, versions: np.ndarray, values: np.ndarray) -> None:
        """Store rows (ids sorted unique), replacing held ones and inserting new ones."""
        if not len(ids):
            return
        pos, found = self._positions(ids)
        self.versions[pos[found]] = versions[found]
        self.values[pos[found]] = values[found]
        new = ~found
        if new.any():
            ids_all = np.concatenate([self.ids, ids[new]])
            order = np.argsort(ids_all, kind="stable")
            self.ids = ids_all[order]
            self.versions = np.concatenate([self.versions, versions[new]])[order]
            self.values = np.concatenate([self.values, values[new]])[order]

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """(m, dim) rows for sorted unique ``ids``, all of which must be held."""
        pos, found = self._positions(ids)
        if not found.all():
            raise KeyError("rows not held")
        return self.values[pos]

    @property
    def nbytes(self) -> int:
        return self.ids.nbytes + self.versions.nbytes + self.values.nbytes
