"""Receive buffers that are reused once nothing refers to them (DESIGN §11: fresh memory is the cost).

A large frame (a follower's append_entries, a client's push body) is received with ``recv_into``
into a buffer of its own, and what is decoded from it stays a view of it: log entries, gradients.
``np.empty`` for every frame put each received byte into memory the process had not touched
since the allocator last gave it back to the host. ``RecycledBuffers.take(length)`` hands out a
view of a buffer the pool keeps, once nothing refers to that buffer any more (its reference
count: no view, no memoryview, no buffer export is left), so the pages are already faulted in;
the bytes a reader still holds are never overwritten.

Not thread-safe: each user keeps its own pool on its own thread (one per Raft tick thread, one per
wire server). At most ``max_bytes`` are kept; a frame the pool cannot hold (too big, or every
buffer still in use and no room) gets a buffer of its own, as before.
"""
from __future__ import annotations

import sys

import numpy as np

__all__ = ["RecycledBuffers"]

MiB = 1024 * 1024


class RecycledBuffers:
    def __init__(self, max_bytes: int = 64 * MiB, min_bytes: int = 64 * 1024) -> None:
        self.max_bytes = max_bytes
        self.min_bytes = min_bytes  # smaller frames are not worth a pooled buffer
        self._free: list[np.ndarray] = []  # every pooled buffer, least recently used first
        self.kept = 0  # bytes in pooled buffers
        self.reused = 0  # takes served by a pooled buffer
        self.allocated = 0  # takes that needed a new buffer

    def take(self, length: int) -> np.ndarray:
        """A writable uint8 array of ``length`` bytes whose contents are undefined."""
        if length < self.min_bytes:
            return np.empty(length, np.uint8)
        pool = self._free
        for i in range(len(pool)):
            buf = pool[i]
            # held by the list, this name and the call's argument only: nothing else refers to it
            if length <= len(buf) <= 2 * length + MiB and sys.getrefcount(buf) == 3:
                pool.append(pool.pop(i))  # most recently used last
                self.reused += 1
                return buf[:length]
        buf = None  # (the loop's name would count as a reference below)
        self.allocated += 1
        size = -(-length // MiB) * MiB  # whole MiB, so that frames of similar sizes share
        if size > self.max_bytes:
            return np.empty(length, np.uint8)
        while self.kept + size > self.max_bytes and self._drop_one():
            pass
        if self.kept + size > self.max_bytes:
            return np.empty(length, np.uint8)
        buf = np.empty(size, np.uint8)
        pool.append(buf)
        self.kept += size
        return buf[:length]

    def _drop_one(self) -> bool:
        """Stop keeping the least recently used buffer nothing refers to; False if none."""
        pool = self._free
        for i in range(len(pool)):
            if sys.getrefcount(pool[i]) == 2:  # the list and the argument
                self.kept -= len(pool.pop(i))
                return True
        return False
