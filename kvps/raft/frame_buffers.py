"""The recycled buffers large peer frames are received into: one ``kvps.buffers`` pool per tick
thread (a pool is one thread's), so every group ticked by a process's ticker shares one."""
from __future__ import annotations

import threading
import weakref

from kvps.buffers import RecycledBuffers

__all__ = ["frame_buffer_stats", "frame_buffers"]

STAGING_BYTES = 256 * 1024  # kvps.raft.connection's staging buffer: larger frames come here

_POOLS = threading.local()
_EVERY_POOL: "weakref.WeakSet[RecycledBuffers]" = weakref.WeakSet()


def frame_buffers() -> RecycledBuffers:
    """This thread's pool."""
    pool = getattr(_POOLS, "pool", None)
    if pool is None:
        pool = _POOLS.pool = RecycledBuffers(min_bytes=STAGING_BYTES)
        _EVERY_POOL.add(pool)
    return pool


def frame_buffer_stats() -> dict[str, int]:
    """Large frames received into a recycled buffer / into a new one, and the bytes kept, over
    this process's tick threads together."""
    pools = list(_EVERY_POOL)
    return {"reused": sum(p.reused for p in pools), "allocated": sum(p.allocated for p in pools),
            "kept_bytes": sum(p.kept for p in pools)}
