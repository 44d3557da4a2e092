"""The writer of a shard leader's shared-memory mirror (its layout and what it is for:
``kvps.delta.mirror``; the reader: ``kvps_client._shm``), and ``LeaderMirror``, when a replica has
one and how long readers may trust it.

The leader's state lock serialises every change (``kvps.replica.host``); ``renew`` may come from
any thread. The file is readable by its owner only (mode 0600: the server's user, as its journal)
and the writer holds an exclusive ``flock`` on it for its life, which is how readers tell a dead
writer; ``sweep`` removes the files of writers that died.
"""
from __future__ import annotations

import fcntl
import logging
import mmap
import os
import platform
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from kvps.delta.mirror import (
    H_CLOSED, H_DATA_BYTES, H_DATA_OFFSET, H_LAYOUT, H_MAGIC, H_SLOTS, H_UNTIL, HEADER_BYTES, LAYOUT,
    MAGIC, PREFIX, S_NBYTES, S_OFFSET, S_SEQ, S_TAG, S_VERSION, SHM_DIR, SLOT_WORDS, align,
    seqlock_safe,
)
from kvps.raft.failover import majority_heard_at

__all__ = ["LeaderMirror", "MirrorFull", "MirrorWriter", "now_ns", "supported", "sweep"]

log = logging.getLogger("kvps.replica")

def supported() -> bool:
    """Whether this machine's memory model lets the seqlock work without fences (x86-64), and
    there is a shared-memory directory to put mirrors in."""
    return seqlock_safe(platform.machine()) and os.path.isdir(SHM_DIR)


def now_ns() -> int:
    return time.monotonic_ns()


def sweep(directory: Path = Path(SHM_DIR)) -> int:
    """Remove mirror files no live writer holds (their writers died). Returns how many."""
    removed = 0
    try:
        names = [p for p in directory.iterdir() if p.name.startswith(PREFIX)]
    except OSError:
        return 0
    for path in names:
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            continue
        try:
            # shared, as readers test it: an exclusive lock here would make a reader testing the
            # file meanwhile take a dead writer for a live one
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:  # a live writer holds it
            os.close(fd)
            continue
        try:
            if os.fstat(fd).st_size >= HEADER_BYTES:
                with mmap.mmap(fd, HEADER_BYTES) as m:
                    hdr = np.frombuffer(m, np.uint64, 8)
                    hdr[H_UNTIL] = 0
                    hdr[H_CLOSED] = 1
                    del hdr
            path.unlink(missing_ok=True)
            removed += 1
        except (OSError, ValueError):
            pass
        finally:
            os.close(fd)
    return removed


class MirrorFull(Exception):
    """No slot or no arena space left: the writer starts a new file."""


class MirrorWriter:
    """One leadership's mirror (the leader's state lock serialises every call but ``renew``)."""

    def __init__(self, *, data_bytes: int, slots: int = 1 << 16, directory: Path = Path(SHM_DIR)) -> None:
        name = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.path = directory / name
        # made under another name and locked before it takes its own: a sweep in another process
        # never sees it unlocked
        making = directory / f".{name}"
        dir_bytes = align(slots * SLOT_WORDS * 8)
        self._data_offset = HEADER_BYTES + dir_bytes
        self._size = self._data_offset + align(data_bytes)
        fd = os.open(making, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, self._size)  # sparse: pages are taken as blocks are written
            self._mmap = mmap.mmap(fd, self._size)
            os.rename(making, self.path)  # the lock is the file's: it stays
        except BaseException:
            os.close(fd)
            making.unlink(missing_ok=True)
            raise
        self._fd = fd
        self._hdr = np.frombuffer(self._mmap, np.uint64, 8)
        self._dir = np.frombuffer(self._mmap, np.int64, slots * SLOT_WORDS, HEADER_BYTES).reshape(slots, SLOT_WORDS)
        self._data = np.frombuffer(self._mmap, np.uint8, self._size - self._data_offset, self._data_offset)
        self._slots: dict[tuple[str, int], int] = {}
        self._by_key: dict[str, list[tuple[int, int]]] = {}  # key -> [(block, slot)]
        self._next_slot = 0
        self._next_byte = 0
        self._tags = 0
        self.closed = False
        hdr = self._hdr
        hdr[H_SLOTS], hdr[H_DATA_OFFSET], hdr[H_DATA_BYTES] = slots, self._data_offset, self._size - self._data_offset
        hdr[H_LAYOUT] = LAYOUT
        hdr[H_MAGIC] = MAGIC

    @property
    def capacity(self) -> int:
        return self._dir.shape[0]

    def renew(self, until_ns: int) -> None:
        """Readers may trust the mirror until ``until_ns`` (``CLOCK_MONOTONIC``). Any thread: one
        racing ``close`` may write into a closed mirror, whose ``closed`` word readers check first."""
        hdr = getattr(self, "_hdr", None)
        if hdr is not None and not self.closed:
            try:
                hdr[H_UNTIL] = until_ns
            except (ValueError, TypeError):  # unmapped meanwhile
                pass

    def slot(self, key: str, block: int) -> tuple[int, int] | None:
        """``(slot, tag)`` of a published block, or None."""
        i = self._slots.get((key, block))
        return None if i is None else (i, int(self._dir[i, S_TAG]))

    def version(self, key: str, block: int) -> int | None:
        i = self._slots.get((key, block))
        return None if i is None else int(self._dir[i, S_VERSION])

    def publish(self, key: str, block: int, version: int, value: np.ndarray) -> tuple[int, int]:
        """Write ``value`` as ``version`` of the block; ``(slot, tag)``. Raises ``MirrorFull``."""
        raw = np.ascontiguousarray(value).reshape(-1).view(np.uint8)
        i = self._slots.get((key, block))
        if i is not None and self._dir[i, S_NBYTES] != raw.nbytes:
            self._kill(i)  # the block changed size: a reader holding the old place finds nobody
            i = None
        if i is None:
            i = self._allocate(key, block, raw.nbytes)
        row = self._dir[i]
        seq = int(row[S_SEQ])
        row[S_SEQ] = seq + 1  # odd: readers keep nothing they read now
        off = int(row[S_OFFSET])
        self._data[off:off + raw.nbytes] = raw
        row[S_VERSION] = version
        row[S_SEQ] = seq + 2
        return i, int(row[S_TAG])

    def forget_key(self, key: str) -> None:
        """The key is gone: its slots read as nobody's (their space is not reused)."""
        for block, i in self._by_key.pop(key, ()):
            self._kill(i)
            self._slots.pop((key, block), None)

    def _kill(self, i: int) -> None:
        """Slot ``i`` reads as nobody's from now on."""
        row = self._dir[i]
        seq = int(row[S_SEQ])
        row[S_SEQ] = seq + 1
        row[S_TAG] = 0
        row[S_SEQ] = seq + 2

    def close(self) -> None:
        """Readers stop trusting it at once; the file goes (mapped readers keep their pages)."""
        if self.closed:
            return
        self.closed = True
        self._hdr[H_UNTIL] = 0
        self._hdr[H_CLOSED] = 1
        self.path.unlink(missing_ok=True)
        del self._hdr, self._dir, self._data
        try:
            self._mmap.close()
        except BufferError:  # a view still exported somewhere: the mapping goes with it
            pass
        os.close(self._fd)  # releases the flock

    def _allocate(self, key: str, block: int, nbytes: int) -> int:
        if self._next_slot >= self.capacity or self._next_byte + nbytes > self._data.nbytes:
            raise MirrorFull(f"{self.path}: {self._next_slot} slots, {self._next_byte} bytes")
        i, self._next_slot = self._next_slot, self._next_slot + 1
        self._tags += 1
        row = self._dir[i]
        row[S_SEQ] = 1
        row[S_OFFSET], row[S_NBYTES], row[S_VERSION] = self._next_byte, nbytes, -1
        row[S_TAG] = self._tags
        row[S_SEQ] = 2
        self._next_byte += align(nbytes)
        self._slots[(key, block)] = i
        self._by_key.setdefault(key, []).append((block, i))
        return i


class LeaderMirror:
    """One replica's mirror over its life: made on the first pull that asks while it leads
    (``open``), closed when its role changes away from leader or it stops (``close``), its lease
    renewed on every tick of its group and when a pull asks (``renew``: half the shortest election
    timeout past the last time a majority answered it, only while it leads and serves) and ended
    when it holds writes for a hand-off (``suspend``). The mirror itself lives in the state host,
    whose lock orders every change of it with the applies."""

    _swept = False  # whether this process removed dead writers' files yet

    def __init__(self, host: Any, shard: int, *, mirror_bytes: int, lease_s: float) -> None:
        self.enabled = mirror_bytes > 0 and supported()
        self._host, self._shard = host, shard
        self._bytes, self._lease = mirror_bytes, lease_s
        self._group: Any = None
        self._leadership: Any = None

    def attach(self, group: Any, leadership: Any) -> None:
        """The replica's Raft group and leadership, once built."""
        self._group, self._leadership = group, leadership
        if self.enabled:
            group.addOnTickCallback(self.renew)  # pysyncobj's extension point: every tick

    def open(self) -> MirrorWriter | None:
        """The mirror same-host readers of this leader use (loop thread, after ``ensure_serving``),
        made now if there is none; None where mirrors are off or cannot be made."""
        if not self.enabled:
            return None
        try:
            mirror = self._host.open_mirror(self._make)
        except OSError as exc:
            log.warning("shard %d: no shared-memory mirror (%s); same-host pulls use TCP", self._shard, exc)
            self.enabled = False
            return None
        self.renew()
        return mirror

    def renew(self) -> None:
        """Extend the lease (any thread), if this replica leads and serves."""
        mirror = self._host.mirror
        if mirror is None or self._leadership is None or not self._leadership.may_serve_reads():
            return
        heard = majority_heard_at(self._group)
        if heard > 0:
            mirror.renew(int((heard + self._lease) * 1e9))

    def suspend(self) -> None:
        """Writes are held (a hand-off): readers stop trusting the mirror now."""
        mirror = self._host.mirror
        if mirror is not None:
            mirror.renew(0)

    def close(self) -> None:
        self._host.close_mirror()

    def _make(self) -> MirrorWriter:
        if not LeaderMirror._swept:
            LeaderMirror._swept = True
            removed = sweep()
            if removed:
                log.info("removed %d shared-memory mirrors of processes that died", removed)
        mirror = MirrorWriter(data_bytes=self._bytes)
        log.info("shard %d: shared-memory mirror %s", self._shard, mirror.path)
        return mirror
