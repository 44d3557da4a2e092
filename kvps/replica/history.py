"""Recent versions of dense blocks, kept by each replica so pulls can send exact deltas.

A client that holds block version ``v`` gets ``current XOR v`` (``kvps.delta.xor``) instead of the
block. Blocks
are immutable arrays in the shard state, so the history holds references, not copies; it is
bounded per block (``depth``) and in total bytes (oldest entries go first). Not replicated: it
is a cache of the replica's own past states; a miss just means a full block.
"""
from __future__ import annotations

from collections import OrderedDict, deque

import numpy as np

__all__ = ["BlockHistory"]

class BlockHistory:
    def __init__(self, *, depth: int = 4, max_bytes: int = 256 << 20) -> None:
        self.depth = depth
        self.max_bytes = max_bytes
        self._blocks: dict[tuple[str, int], deque[tuple[int, np.ndarray]]] = {}
        self._order: OrderedDict[tuple[str, int, int], int] = OrderedDict()  # oldest first
        self._bytes = 0

    def add(self, key: str, block: int, version: int, value: np.ndarray) -> None:
        versions = self._blocks.setdefault((key, block), deque())
        if versions and versions[-1][0] == version:
            return
        versions.append((version, value))
        self._order[(key, block, version)] = value.nbytes
        self._bytes += value.nbytes
        while len(versions) > self.depth:
            self._forget(key, block, versions.popleft()[0])
        while self._bytes > self.max_bytes and self._order:
            (k, b, v), _ = next(iter(self._order.items()))
            kept = self._blocks[(k, b)]
            if kept and kept[0][0] == v:
                kept.popleft()
            self._forget(k, b, v)

    def _forget(self, key: str, block: int, version: int) -> None:
        nbytes = self._order.pop((key, block, version), None)
        if nbytes is not None:
            self._bytes -= nbytes

    def get(self, key: str, block: int, version: int) -> np.ndarray | None:
        for v, value in self._blocks.get((key, block), ()):
            if v == version:
                return value
        return None

    def drop_key(self, key: str) -> None:
        for (k, b) in [kb for kb in self._blocks if kb[0] == key]:
            for v, _ in self._blocks.pop((k, b)):
                self._forget(k, b, v)

    @property
    def nbytes(self) -> int:
        return self._bytes
