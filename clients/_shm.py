"""Pulls from a same-host leader's shared-memory mirror (``kvps.delta.mirror``; the writer is
``kvps.replica.mirror``).

A pull on a shard whose replicas are all on this host asks its leader over TCP for the blocks'
places in the leader's mirror too (``"mirror": true``); the next pull of those blocks reads them
from the mirror instead of sending a request, when the mirror is still live (its writer leads,
serves, holds its lease and is alive) and every block of the shard is found. Anything else (a
block not in the mirror yet, a slot being written over and over, a lease run out, a new leader)
sends that shard's request over TCP as before, which also names the places again. Only
``consistency="leader"`` pulls read mirrors: the mirror is the leader's state, under the lease
rule the leader's TCP reads follow.
"""
from __future__ import annotations

import fcntl
import logging
import mmap
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvps.delta.mirror import (
    H_CLOSED, H_DATA_BYTES, H_DATA_OFFSET, H_LAYOUT, H_MAGIC, H_SLOTS, H_UNTIL, HEADER_BYTES, LAYOUT,
    MAGIC, READ_TRIES, S_NBYTES, S_OFFSET, S_SEQ, S_TAG, S_VERSION, SHM_DIR, SLOT_WORDS, is_mirror_path,
    seqlock_safe,
)

__all__ = ["MirrorReader", "SharedPulls", "supported"]

log = logging.getLogger("kvps_client")

# Mirror files that could not be opened before shared-memory pulls are given up for this client
# (a cluster on another host behind a loopback tunnel, another user, a private /dev/shm).
MAX_REFUSALS = 3


def supported() -> bool:
    """Shared-memory pulls work here: x86-64 (the seqlock needs no fences) and a ``/dev/shm``."""
    return seqlock_safe(platform.machine()) and os.path.isdir(SHM_DIR)


class MirrorReader:
    """A client's read-only view of one mirror file."""

    def __init__(self, path: str) -> None:
        if not is_mirror_path(path):
            raise ValueError(f"not a mirror path: {path!r}")
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES:
                raise ValueError(f"{path}: too short for a mirror")
            self._mmap = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self.path = path
        self.closed = False
        hdr = np.frombuffer(self._mmap, np.uint64, 8)
        if int(hdr[H_MAGIC]) != MAGIC or int(hdr[H_LAYOUT]) != LAYOUT:
            del hdr
            self.close()
            raise ValueError(f"{path}: not a mirror of this layout")
        slots, data_offset, data_bytes = int(hdr[H_SLOTS]), int(hdr[H_DATA_OFFSET]), int(hdr[H_DATA_BYTES])
        if data_offset + data_bytes > size or HEADER_BYTES + slots * SLOT_WORDS * 8 > data_offset:
            del hdr
            self.close()
            raise ValueError(f"{path}: inconsistent header")
        self._hdr = hdr
        self._dir = np.frombuffer(self._mmap, np.int64, slots * SLOT_WORDS, HEADER_BYTES).reshape(slots, SLOT_WORDS)
        self._data = np.frombuffer(self._mmap, np.uint8, data_bytes, data_offset)

    def live(self) -> bool:
        """The writer leads, serves and is alive: its lease runs and it holds the file's lock."""
        return self.state() == "live"

    def state(self) -> str:
        """"live"; "expired" (the lease ran out: the writer may renew it); "gone" (closed, or
        its writer died: never live again)."""
        if self.closed or self._hdr[H_CLOSED]:
            return "gone"
        if int(self._hdr[H_UNTIL]) <= time.monotonic_ns():
            return "expired"
        try:
            fcntl.flock(self._fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return "live"  # the writer's exclusive lock: it is alive
        except OSError:
            return "gone"
        fcntl.flock(self._fd, fcntl.LOCK_UN)  # we got it: the writer is gone
        return "gone"

    def read(self, slot: int, tag: int, nbytes: int, have: int | None,
             out: np.ndarray | None = None) -> tuple[int, np.ndarray | None] | None:
        """``(version, bytes)`` of a slot, bytes None when ``have`` is that version already;
        None when the slot is not (or no longer) that block, or a write kept overlapping.
        ``out``: a uint8 array of ``nbytes`` to copy into (returned as the bytes) instead of a
        new one."""
        if not 0 <= slot < self._dir.shape[0]:
            return None
        row = self._dir[slot]
        for _ in range(READ_TRIES):
            seq = int(row[S_SEQ])
            if seq & 1:  # a write in progress, in the writer's process: let it finish
                time.sleep(0)
                continue
            if int(row[S_TAG]) != tag or int(row[S_NBYTES]) != nbytes:
                return None
            version = int(row[S_VERSION])
            off = int(row[S_OFFSET])
            if off < 0 or off + nbytes > self._data.nbytes:
                return None
            if version == have:
                data = None
            elif out is None:
                data = self._data[off:off + nbytes].copy()
            else:
                np.copyto(out, self._data[off:off + nbytes])
                data = out
            if int(row[S_SEQ]) == seq:
                return (version, data) if version >= 0 else None
        return None

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for name in ("_hdr", "_dir", "_data"):
            self.__dict__.pop(name, None)
        try:
            self._mmap.close()
        except BufferError:
            pass
        os.close(self._fd)


@dataclass
class _ShardMirror:
    reader: MirrorReader
    slots: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)  # -> (slot, tag)


class SharedPulls:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and supported()
        self._shards: dict[int, _ShardMirror] = {}
        self._refused: set[str] = set()
        self.blocks_read = 0    # blocks taken from mirrors (copied, or current already)
        self.bytes_read = 0     # bytes copied out of mirrors
        self.fallbacks = 0      # shard pulls a mirror could not serve whole (sent over TCP)
        # why: "place" (a block not in the mirror yet), "slot" (written over and over during the
        # read, or no longer that block), "older" (behind what we hold), "expired" (the lease ran
        # out: the leader has not heard from a majority lately), "gone" (stepped down or died)
        self.reasons: dict[str, int] = {}
        self.reused = 0         # of the blocks copied, those copied into a buffer used before
        self._owned: dict[tuple[str, int], np.ndarray] = {}   # blocks mirror reads made, in caches
        self._spares: dict[tuple[str, int], np.ndarray] = {}  # their previous ones, to read into

    def wanted(self, shard: int, on_host: bool, consistency: str) -> bool:
        """Whether to ask ``shard``'s leader for mirror places in a TCP pull."""
        return self.enabled and on_host and consistency == "leader"

    def read(self, shard: int, items: list[dict], caches: dict[str, Any]) -> bool:
        """Serve a shard's pull ``items`` (``{"key", "blocks", "have"}``) from its mirror into
        ``caches``; False (and nothing changed) unless every block was found and the mirror was
        live after reading them all."""
        mirror = self._shards.get(shard)
        if mirror is None:
            return False
        got: list[tuple[Any, str, int, int, np.ndarray | None]] = []
        spares: dict[tuple[str, int], np.ndarray] = {}  # taken for this read; back if it fails
        try:
            for it in items:
                key, cache = it["key"], caches[it["key"]]
                layout = cache.layout
                dtype = np.dtype(layout.dtype)
                for b, held in zip(it["blocks"], it["have"]):
                    place = mirror.slots.get((key, b))
                    if place is None:
                        return self._fallback("place")
                    shape = layout.block_shape(b)
                    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
                    spare = self._spares.pop((key, b), None)
                    if spare is not None:
                        spares[(key, b)] = spare
                    into = spare.reshape(-1).view(np.uint8) \
                        if spare is not None and spare.dtype == dtype and spare.nbytes == nbytes else None
                    found = mirror.reader.read(place[0], place[1], nbytes,
                                               held if cache.blocks[b] is not None else None, out=into)
                    if found is None:
                        return self._fallback("slot")
                    version, raw = found
                    if held is not None and version < held:  # never older than what we hold
                        return self._fallback("older")
                    value = None if raw is None else raw.view(dtype).reshape(shape)
                    if value is not None and into is not None:
                        spares.pop((key, b), None)  # written into: it is the new value now
                        self.reused += 1
                    got.append((cache, key, b, version, value))
            state = mirror.reader.state()  # checked after reading: live now, so live throughout
            if state != "live":
                if state == "gone":  # its writer stepped down or died: a new leader names another
                    self.forget(shard)
                return self._fallback(state)
        finally:
            self._spares.update(spares)
        for cache, key, b, version, value in got:
            if value is not None:
                self._keep(cache, key, b, value)
                self.bytes_read += value.nbytes
            cache.versions[b] = version
        self.blocks_read += len(got)
        return True

    def _keep(self, cache: Any, key: str, b: int, value: np.ndarray) -> None:
        """Put ``value`` in the cache; the block it replaces becomes the next read's buffer when
        it came from a mirror read and nothing else holds it (``pull_blocks`` hands blocks out):
        a buffer written before costs no page faults, a new one a fault per page."""
        old = cache.blocks[b]
        cache.blocks[b] = value
        if old is not None and self._owned.get((key, b)) is old:
            # referenced by: _owned, ``old`` here, getrefcount's argument
            if sys.getrefcount(old) <= 3:
                self._spares[(key, b)] = old
        self._owned[(key, b)] = value

    def learn(self, shard: int, meta: dict) -> None:
        """Note the mirror and the places a TCP pull reply of ``shard`` named."""
        path = meta.get("mirror")
        if not isinstance(path, str):
            return
        mirror = self._shards.get(shard)
        if mirror is None or mirror.reader.path != path:
            if path in self._refused:
                return
            try:
                reader = MirrorReader(path)
            except (OSError, ValueError) as exc:
                self._refused.add(path)
                if len(self._refused) >= MAX_REFUSALS:
                    self.enabled = False
                    log.info("shared-memory pulls off for this client: %s", exc)
                return
            self.forget(shard)
            mirror = self._shards[shard] = _ShardMirror(reader)
        for entry in meta.get("blocks", ()):
            place = entry.get("mirror")
            if isinstance(place, list) and len(place) == 2:
                mirror.slots[(entry["key"], entry["block"])] = (int(place[0]), int(place[1]))

    def forget(self, shard: int) -> None:
        mirror = self._shards.pop(shard, None)
        if mirror is not None:
            mirror.reader.close()

    def close(self) -> None:
        for shard in list(self._shards):
            self.forget(shard)

    def _fallback(self, reason: str) -> bool:
        self.fallbacks += 1
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        return False
