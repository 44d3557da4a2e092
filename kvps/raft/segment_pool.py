"""The journal's segments in use and in reserve (``SegmentPool``, a base class of ``RaftJournal``).

The tick thread appends to the *active* segment; when a record does not fit it writes the active
segment's end marker and takes a free one (``_take``): a new epoch in its header, appends from
its first record on. Only when no free segment is left (the log is longer than ever before) does
it create one itself (fsynced there under ``always``; under ``interval`` the sync thread fsyncs
the directory in its next round).

Retiring (``deleteEntriesTo`` after a compaction, ``clear``) moves segments onto ``_retired``
without any I/O on the tick thread. The worker thread (``journal-segments``) then

* fsyncs the directory (unless ``never``: the snapshot renamed into place just before is durable
  before a segment holding the entries it covers is overwritten), marks each retired segment free
  in its header and puts it on the free list; a segment of another size than
  ``journal_segment_bytes`` (made for one oversized record), and any beyond the most segments the
  log has held at once, is closed and unlinked instead;
* creates the next segment ahead of time (allocated, and read once: its pages are then in the
  page cache, with no disk write) once the active one is half full and no free one is left, and
  (``reserve``) as many as the log is expected to span at its longest.

``reserve(n)``: the owner's estimate of the most segments its log spans at once (from its
compaction interval, ``kvps.raft.group``), given once the log first reaches a compaction. The
worker creates segments until the pool holds ``n``, so a journal reaches its size in the first
seconds of sustained writes instead of one new segment per new longest log over minutes (each
one 16 MiB of page cache and page faults in the middle of a training run); an idle journal or
one that never compacts creates none.

A retired segment whose free mark a crash lost is still live at open: its entries lie below the
snapshot's (``first_index``) and it is freed then (``kvps.raft.segments``).
"""
from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from pathlib import Path

from kvps.raft import disk, segments
from kvps.raft.journal_file import RECORD
from kvps.raft.segments import DATA, FREE, LIVE, Segment
from kvps.raft.threads import name_native_thread

__all__ = ["SegmentPool"]

_ROUND = 1 << 20  # an oversized record's segment is a whole number of these


class SegmentPool:
    """The segment half of ``RaftJournal``: it shares the journal's lock and segment lists."""

    _lock: threading.Lock
    _path: Path
    _policy: str
    _segment_bytes: int
    _live: list[Segment]  # the segments holding the log, in log order
    _active: Segment | None  # the last of them while appends go to it
    _dirty: set[Segment]  # written since the last fdatasync
    _on_io_error: Callable[[OSError, str], None]

    def _start_pool(self, free: list[Segment], epoch: int, number: int) -> None:
        self._free = free  # marked free, ready for the next use
        self._retired: list[Segment] = []  # free once the worker has marked them
        self._epoch = epoch  # the highest epoch given to a segment so far
        self._number = number  # the highest segment file number
        self._peak = max(2, len(self._live) + 1)  # most segments the log has used at once
        self._reserve = 0  # segments the pool is to hold (``reserve``)
        self._busy = False
        self._dir_dirty = False  # a segment created on the tick thread, its directory unsynced
        self._wake = threading.Event()
        self._worker = threading.Thread(target=_work, args=(weakref.ref(self), self._wake),
                                        name=f"kvps-journal-segments {self._path.parent.name}",
                                        daemon=True)
        self._worker.start()

    def reserve(self, count: int) -> None:
        """Have the pool hold at least ``count`` segments of ``journal_segment_bytes`` (live, free
        and being freed), created by the worker thread; never shrinks an earlier reserve."""
        with self._lock:
            if count <= self._reserve:
                return
            self._reserve = count
            self._peak = max(self._peak, count)
        self._wake.set()

    def _take(self, length: int) -> Segment:
        """With ``_lock`` held, on the tick thread: end the active segment and start appending
        to a free one (created if none is left) that a record of ``length`` bytes fits."""
        old = self._active
        if old is not None and old.tail + RECORD.size <= old.size:
            self._write(old, [segments.marker(old.epoch, old.version)], old.tail,
                        "ending a segment")
            self._dirty.add(old)
        size = self._segment_bytes
        if DATA + 2 * RECORD.size + length > size:  # a segment of its own, unlinked when retired
            size = -(-(DATA + 2 * RECORD.size + length) // _ROUND) * _ROUND
        if size == self._segment_bytes and self._free:
            seg = self._free.pop()
        else:
            self._number += 1
            try:  # (under ``interval`` the sync thread fsyncs the directory: _dir_dirty)
                seg = segments.create(self._path, self._number, size,
                                      durable=self._policy == "always", prefault=False)
                self._dir_dirty = self._policy == "interval"
            except OSError as exc:
                self._on_io_error(exc, "creating a journal segment")
                raise
        self._epoch += 1
        try:
            segments.write_header(seg, LIVE, self._epoch)
        except OSError as exc:
            self._on_io_error(exc, "starting a journal segment")
            raise
        seg.tail, seg.first, seg.last = DATA, 0, 0
        self._live.append(seg)
        self._active = seg
        self._dirty.add(seg)
        self._peak = max(self._peak, len(self._live))
        self._wake.set()
        return seg

    def _retire(self, retired: list[Segment]) -> None:
        """With ``_lock`` held: these segments' entries are gone; the worker frees them."""
        self._retired += retired
        if retired:
            self._wake.set()

    def _mark_free_now(self, marked: list[Segment]) -> None:
        """With ``_lock`` held: mark these segments free in their headers before returning (their
        records must not come back at open); (``always``: fdatasynced with the next change)."""
        for seg in marked:
            try:
                segments.write_header(seg, FREE, seg.epoch)
            except OSError as exc:
                self._on_io_error(exc, "freeing a journal segment")
                raise
            self._dirty.add(seg)

    def _settle(self) -> None:
        """Wait until the worker has nothing left to do (tests, and shutdown)."""
        while True:
            with self._lock:
                if not self._retired and not self._busy and not self._spare_wanted():
                    return
            self._wake.set()
            threading.Event().wait(0.005)

    def _spare_wanted(self) -> bool:
        seg = self._active
        if seg is None or seg.fd < 0:
            return False
        if len(self._live) + len(self._free) + len(self._retired) < self._reserve:
            return True
        return not self._free and seg.tail * 2 > seg.size

    def _pool_round(self) -> bool:
        """One round of the worker's work (module docstring); whether there was any."""
        with self._lock:
            retired = list(self._retired)
            spare = self._spare_wanted()
            if spare:
                self._number += 1
            number = self._number
            self._busy = bool(retired or spare)
        if not self._busy:
            return False
        doomed: list[Segment] = []
        try:
            if retired and self._policy != "never":
                disk.fsync_dir(self._path.parent)
            with self._lock:
                for seg in retired:
                    self._retired.remove(seg)
                    if seg.size == self._segment_bytes and len(self._free) < self._peak:
                        segments.write_header(seg, FREE, seg.epoch)
                        self._free.append(seg)
                    else:
                        self._dirty.discard(seg)
                        doomed.append(seg)
            for seg in doomed:
                seg.close()
                seg.path.unlink(missing_ok=True)
            if spare:
                seg = segments.create(self._path, number, self._segment_bytes,
                                      durable=self._policy != "never", prefault=True)
                with self._lock:
                    self._free.append(seg)
        except OSError as exc:
            self._on_io_error(exc, "recycling journal segments")
            raise
        finally:
            with self._lock:
                self._busy = False
        return True

    def _stop_pool(self) -> None:
        """Stop the worker (``_stopping`` set by the caller) and wait for it."""
        self._wake.set()
        if self._worker is not threading.current_thread():
            self._worker.join()

    def _close_segments(self) -> None:
        """With ``_lock`` held: close every segment's descriptor."""
        for seg in [*self._live, *self._free, *self._retired]:
            seg.close()

    def _write(self, seg: Segment, buffers: list, offset: int, what: str) -> None:
        try:
            disk.pwrite_all(seg.fd, buffers, offset)
        except OSError as exc:
            self._on_io_error(exc, what)
            raise


def _work(ref: weakref.ref, wake: threading.Event) -> None:
    """The worker thread: a round whenever woken (or every second). Holds the journal only
    weakly between rounds, so a journal nobody references any more still goes away."""
    name_native_thread("journal-segments")
    while True:
        wake.wait(1.0)
        wake.clear()
        pool = ref()
        if pool is None or pool._stopping:
            return
        try:
            while pool._pool_round():
                pass
        except OSError:  # reported through on_io_error
            return
        del pool
