"""Our Raft journal (pysyncobj's ``journalFile``): checksummed records in preallocated, recycled
segments and an explicit fsync policy, installed in place of pysyncobj's ``FileJournal``.

Why not ``FileJournal`` (pysyncobj 0.3.17): an mmap never fsynced while running; its ``.meta``
written and renamed without fsync; ``deleteEntriesTo`` rewrites the journal in place from offset
0 (a crash in the middle loses entries); no checksums (a torn tail reads back as garbage); and
``add`` copies every command three times (~140 MB/s of 1 MiB commands).

Files, next to each other in the replica's journal directory::

    raft.journal.seg-NNNNNN  fixed-size segments, one record per log entry appended with pwritev
                             (``kvps.raft.segments``, which describes their layout)
    raft.journal.meta        current term, vote, commit index: two slots overwritten in place, in
                             turn (``kvps.raft.meta_file``, which describes its layout)
    raft.journal             only a journal of an earlier kvps (one file): moved into segments
                             at open, then removed

Nothing on the tick thread grows, truncates, renames or unlinks a file: appends fill segments
preallocated once (DESIGN §11: fresh memory is the cost); ``deleteEntriesFrom`` writes an end
marker where the log now ends and frees the segments after it (their headers say so); ``clear``
marks every segment free; ``deleteEntriesTo`` retires whole segments, which a worker thread frees
for reuse (``kvps.raft.segment_pool``). A record is summed with its segment's epoch, bumped on
every reuse, so an earlier use's records never come back.

Opening (``kvps.raft.segments.load``) ends the log at a torn tail, and reports damage in the
middle through ``on_damage`` (``ShardGroup`` then marks the replica *recovering*: no vote until it
has caught up, ``kvps.raft.recovery``) before it drops anything. A wrong magic or version, or a
meta file that fails its checks, is a ``CodecError``: the vote and term cannot be guessed safely.
Records below ``first_index`` (the snapshot's previous entry) are dropped: a segment is retired
only once the snapshot covers all of it, so the first one usually holds older records.

The fsync policy (``RaftConfig.fsync``, README "Durability") says when appends reach stable
storage. Every policy survives ``kill -9`` of any process, because the page cache holds what was
written; they differ on power loss or a kernel crash:

* ``never``    no fsync at all, also not for the meta file or a new segment;
* ``interval`` a background thread fdatasyncs the journal and the meta file every
  ``fsync_interval`` seconds when something changed (term and vote included);
* ``always``   fdatasync after every change, before pysyncobj continues: a follower answers
  append_entries, and the leader counts itself towards a majority, only with the entry on disk.

Term and vote (pysyncobj calls ``setCurrentTerm`` before it sends the vote request or grant that
reflects it) are written in place before ``setCurrentTerm`` returns, so they survive ``kill -9``;
under ``always`` they are also fdatasynced then. Under ``interval`` their fdatasync is the
background thread's, as for appends: a synchronous one on the tick thread waited seconds behind
the device's queued writeback after heavy writes, just as a candidate stood for election (the
cost: a replica that loses power within ``fsync_interval`` of voting may vote again in that term
if the election is still open when it is back, the same window in which ``interval`` may lose
acknowledged appends). A segment retired by a compaction is reused only after the worker
fsynced the directory (the snapshot's rename is durable before the entries it covers can be
overwritten). The commit index is written at most once a second, by a
background thread under those two policies, by pysyncobj's ``onOneSecondTimer`` under ``never``.
Since it may be ahead of what survived in the journal, it is clamped to the journal's last index
when read back (an unclamped one lets a restarted node apply entries nobody committed).

A failed write or fsync is fatal (the entry is in memory, and after a failed fsync the page
cache is untrustworthy): the process exits (``on_io_error``), a crashed replica to Raft.

Memory: an applied entry every follower has keeps only its index and term in memory; its command
is read back from its record if needed (``kvps.raft.log_memory``). Injection: pysyncobj has no
hook for a journal class; ``using_journal`` (around ``SyncObj.__init__``) supplies this one.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from functools import partial
from pathlib import Path
from typing import Any

from pysyncobj.journal import Journal

from kvps.config import FSYNC_POLICIES
from kvps.raft import disk, internals, journal_file, segments
from kvps.raft.journal_file import CHECKED, CRC, MAGIC, RECORD, VERSION, Entry
from kvps.raft.log_memory import LogMemory
from kvps.raft.segment_pool import SegmentPool
from kvps.raft.segments import DATA, SEG_MAGIC, Segment
from kvps.raft.meta_file import META_MAGIC, MetaFile
from kvps.raft.threads import name_native_thread

# MAGIC, META_MAGIC, SEG_MAGIC and VERSION are the formats' own (journal_file, meta_file,
# segments), named here too.
__all__ = ["MAGIC", "META_MAGIC", "RaftJournal", "SEG_MAGIC", "VERSION", "using_journal"]

logger = logging.getLogger("kvps.raft")

_META_PERIOD = 1.0  # seconds between commit index writes (pysyncobj's own cadence)


class RaftJournal(SegmentPool, LogMemory, Journal):
    """pysyncobj's ``Journal`` interface over recycled segments (see the module docstring).

    pysyncobj calls every method on its tick thread, and none of them waits for the disk except
    as the policy says (term and vote under ``interval`` and ``always``; under ``always`` every
    change). Other threads: under ``interval`` and ``always`` one background thread fdatasyncs
    the segments written since the last round (``interval`` only, through duplicates of their
    descriptors taken under ``_lock``) and writes the commit index (``_meta_lock``); under every
    policy the segment worker (``kvps.raft.segment_pool``) frees retired segments and prepares
    the next one. ``_lock`` guards the segment lists, positions and every write to a segment."""

    def __init__(self, path: str | Path, *, fsync: str = "interval", fsync_interval: float = 0.05,
                 first_index: int = 0, segment_bytes: int = 64 << 20,
                 on_io_error: Callable[[OSError, str], None] = disk.exit_on_io_error,
                 on_damage: Callable[[str], None] | None = None,
                 digest: segments.Digest = segments.full_digest) -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync must be one of {FSYNC_POLICIES}, not {fsync!r}")
        if segment_bytes < 2 * DATA:
            raise ValueError(f"segment_bytes must be at least {2 * DATA}, not {segment_bytes}")
        self._path = Path(path)
        self._meta_path = Path(f"{path}.meta")
        self._policy = fsync
        self._segment_bytes = segment_bytes
        self._on_io_error, self._digest = on_io_error, digest  # digest: see segments.py
        self._lock = threading.Lock()
        self._changes = 0  # journal changes made ...
        self._synced = 0  # ... and how many of them an fdatasync has covered
        self._dirty: set[Segment] = set()
        self._stopping = False
        self._closed = False
        for stale in (Path(f"{self._path}.tmp"), Path(f"{self._meta_path}.tmp")):
            if stale.exists():
                logger.warning("raft journal: removing %s left by an interrupted rewrite", stale)
                stale.unlink()
        self._meta = MetaFile(self._meta_path, durable=fsync != "never",
                              fsync=lambda fd: disk.fsync(fd), fdatasync=lambda fd: disk.fdatasync(fd),
                              fsync_dir=disk.fsync_dir)
        self._term, self._voted_for, self._commit_index = \
            self._meta.term, self._meta.voted_for, self._meta.commit_index
        self._meta_dirty = False
        self._meta_lock = threading.Lock()
        legacy = self._path.exists()  # a single-file journal of an earlier kvps: moved over below
        loaded = segments.load(self._path, durable=fsync != "never",
                               first_index=0 if legacy else first_index, on_damage=on_damage,
                               digest=digest)
        self._entries: list[Entry] = loaded.entries  # pysyncobj indexes and slices this
        self._locs: list[tuple[Segment, int]] = loaded.locs  # (segment, offset) of each record
        self._live: list[Segment] = loaded.live
        self._active: Segment | None = None  # every open appends to a fresh segment
        self._start_pool(loaded.free, loaded.epoch, loaded.number)
        self._start_log_memory(on_io_error)
        if legacy:
            self._move_legacy(first_index, on_damage)
        self._stop = threading.Event()
        self._kick = threading.Event()  # something for the background thread to sync or write
        if fsync != "never":
            period = fsync_interval if fsync == "interval" else _META_PERIOD
            threading.Thread(target=_background, args=(weakref.ref(self), self._stop, self._kick, period),
                             name=f"kvps-journal-sync {self._path.parent.name}", daemon=True).start()

    def _move_legacy(self, first_index: int, on_damage: Callable[[str], None] | None) -> None:
        """Copy the records of an earlier kvps's single-file journal (``kvps.raft.journal_file``,
        read with its own checks) into segments, make them durable, then remove that file.
        Segments found beside it are from a move cut short: freed first."""
        logger.warning("raft journal %s: moving a single-file journal into segments", self._path)
        with self._lock:
            self._mark_free_now(self._live)
            self._free += self._live
            self._live = []
            self._drop_entries()
        fd, records = journal_file.open_file(self._path, version=VERSION, durable=self._policy != "never",
                                             first_index=first_index, on_damage=on_damage)
        os.close(fd)
        for entry in records.entries:
            self.add(*entry)
        self._sync(force=True)
        self._path.unlink()
        disk.fsync_dir(self._path.parent)

    # -- the log --------------------------------------------------------------------------------

    def add(self, command: Any, idx: int, term: int) -> None:
        checked = CHECKED.pack(len(command), idx, term)
        digest = self._digest(command) if len(command) else 0  # one pass; outside the lock
        if digest is None:  # bytes failing the checksums they carry: not what the leader sent
            exc = OSError(f"raft entry {idx} (term {term}): its command fails its own checksums")
            self._on_io_error(exc, "checking an entry")
            raise exc
        with self._lock:
            seg = self._active
            if seg is None or not seg.fits(len(command)):
                seg = self._take(len(command))
            crc = segments.record_sum(seg.epoch, checked, command, digest=lambda _: digest,
                                      version=seg.version)
            self._write(seg, [CRC.pack(crc) + checked, command], seg.tail, "append")
            self._entries.append((command, idx, term))
            self._locs.append((seg, seg.tail))
            self._held_added(len(command))
            seg.tail += RECORD.size + len(command)
            seg.first = seg.first or idx
            seg.last = idx
            self._dirty.add(seg)
            self._changes += 1
            if seg.tail * 2 > seg.size and not self._free:
                self._wake.set()  # the worker prepares the next segment
        self._changed()

    def clear(self) -> None:
        """Drop every entry (pysyncobj: a snapshot installed from the leader replaces the log):
        every segment holding entries is marked free now (no entry may come back at open) and
        retired, so none is overwritten before the directory is fsynced."""
        with self._lock:
            self._mark_free_now([*self._retired, *self._live])
            self._retire(self._live)
            self._live, self._active = [], None
            self._drop_entries()
            self._changes += 1
        self._changed()

    def deleteEntriesFrom(self, entryFrom: int) -> None:
        """Drop entries ``[entryFrom:]`` (a follower's conflicting suffix): the segments after
        the one holding that entry are marked free, then an end marker goes where its record
        was; the next append takes a fresh segment. Nothing is truncated."""
        if entryFrom >= len(self._entries):
            return
        with self._lock:
            seg, offset = self._locs[entryFrom]
            k = self._live.index(seg)
            dropped = self._live[k + 1:]
            if offset == DATA:  # no entry left in it either
                dropped.append(seg)
            self._mark_free_now(dropped)  # first: a crash before the marker keeps the old suffix
            if offset != DATA:
                self._write(seg, [segments.marker(seg.epoch, seg.version)], offset,
                            "truncating the journal")
                self._dirty.add(seg)
                seg.tail = offset
                seg.last = self._entries[entryFrom - 1][1]
            self._free += dropped  # holding uncommitted entries only: reusable at once
            self._live = self._live[:k] + ([] if offset == DATA else [seg])
            self._active = None
            self._held_dropping_from(entryFrom)
            del self._entries[entryFrom:]
            del self._locs[entryFrom:]
            self._changes += 1
        self._changed()

    def deleteEntriesTo(self, entryTo: int) -> None:
        """Drop entries ``[:entryTo]`` (after log compaction): the segments holding only those
        are retired (no I/O here: ``kvps.raft.segment_pool``)."""
        if entryTo <= 0:
            return
        with self._lock:
            self._held_dropping_to(entryTo)
            del self._entries[:entryTo]
            del self._locs[:entryTo]
            if not self._entries:
                retired, self._live, self._active = self._live, [], None
            else:
                first = self._entries[0][1]
                retired = [seg for seg in self._live if seg.last < first]
                self._live = self._live[len(retired):]
                self._live[0].first = first
            self._retire(retired)

    def __getitem__(self, item: int | slice) -> Any:
        return self._entries[item]

    def __len__(self) -> int:
        return len(self._entries)

    # -- term, vote, commit index ---------------------------------------------------------------

    def setCurrentTerm(self, term: int, votedForNodeId: str | None) -> None:
        """Written before returning (pysyncobj sends the message that reflects it right after):
        in the page cache under every policy, on disk too under ``always``; under ``interval``
        the background thread fdatasyncs it within ``fsync_interval``, like the appends."""
        self._term, self._voted_for = term, votedForNodeId
        self._write_meta()

    def getCurrentTerm(self) -> int:
        return self._term

    def getVotedForNodeId(self) -> str | None:
        return self._voted_for

    def setRaftCommitIndex(self, raftCommitIndex: int) -> None:
        if raftCommitIndex != self._commit_index:
            self._commit_index = raftCommitIndex
            self._meta_dirty = True
            self._kick.set()

    def getRaftCommitIndex(self) -> int:
        """The stored commit index, clamped to the last journaled index (after a power loss the
        meta file can be ahead of the journal: applying up to it would apply entries that were
        never committed, pysyncobj bakwc/PySyncObj#197)."""
        if self._entries and self._commit_index > self._entries[-1][1]:
            logger.warning("raft journal: commit index %d is past the journal's last entry %d "
                           "(its tail was lost); using %d", self._commit_index,
                           self._entries[-1][1], self._entries[-1][1])
            self._commit_index = self._entries[-1][1]
            self._meta_dirty = True
            self._kick.set()
        return self._commit_index

    def onOneSecondTimer(self) -> None:
        if self._meta_dirty and self._policy == "never":  # otherwise the background thread does
            self._write_meta()

    # -- lifecycle ------------------------------------------------------------------------------

    def flush(self) -> None:
        """Everything written so far to stable storage now, whatever the policy."""
        self._sync(force=True)
        if self._meta_dirty:
            self._write_meta()
        self._sync_meta()

    def _destroy(self) -> None:
        """pysyncobj's close: stop the syncing thread and the segment worker, sync (unless
        ``never``), close."""
        self._stop.set()
        self._kick.set()
        if self._closed:
            return
        self._stopping = True
        self._stop_pool()
        with self._lock:  # a clean stop ends the log with a marker (the next open starts anew)
            seg = self._active
            if seg is not None and seg.tail + RECORD.size <= seg.size:
                self._write(seg, [segments.marker(seg.epoch, seg.version)], seg.tail,
                            "ending a segment")
                self._dirty.add(seg)
        if self._policy != "never":
            self._sync()
        if self._meta_dirty:
            self._write_meta()
        if self._policy != "never":
            self._sync_meta()
        self._meta.close()
        with self._lock:
            self._closed = True
            self._close_segments()

    def __del__(self) -> None:  # a group dropped without stop(): no descriptor leak
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
            self._kick.set()
        self._stopping = True
        if not getattr(self, "_closed", True) and hasattr(self, "_free"):  # (not if open failed)
            self._closed = True
            self._close_segments()

    # -- internals ------------------------------------------------------------------------------

    def _changed(self) -> None:
        """After a change (counted in ``_changes`` under the lock): ``always`` syncs it now,
        ``interval`` wakes the background thread."""
        if self._policy == "always":
            self._sync()
        elif self._policy == "interval":
            self._kick.set()

    def _sync(self, force: bool = False) -> None:
        """fdatasync the segments written since the last one (any thread); ``force``: also
        under ``never``."""
        if self._policy == "never" and not force:
            return
        with self._lock:  # held only to take descriptors: the tick thread never waits for an
            target = self._changes  # fdatasync in flight on the background thread
            if self._closed or not self._dirty:
                self._synced = max(self._synced, target)
                return
            fds = [os.dup(seg.fd) for seg in self._dirty if seg.fd >= 0]
            self._dirty.clear()
            new_file, self._dir_dirty = self._dir_dirty, False
        try:
            if new_file:  # a segment the tick thread created: its name is durable too
                disk.fsync_dir(self._path.parent)
            for fd in fds:
                disk.fdatasync(fd)
        except OSError as exc:
            self._on_io_error(exc, "fdatasync of the journal")
            raise
        finally:
            for fd in fds:
                os.close(fd)
        with self._lock:
            self._synced = max(self._synced, target)

    def _write_meta(self) -> None:
        """Overwrite the meta file's next slot (kvps.raft.meta_file); under ``always`` also
        fdatasync it before returning."""
        with self._meta_lock:  # the tick thread (term, vote) or the background thread (commit)
            self._meta_dirty = False  # before reading: a change made meanwhile stays dirty
            try:
                self._meta.write(self._term, self._voted_for, self._commit_index)
                if self._policy == "always":
                    self._meta.sync()
                elif self._policy == "interval":
                    self._kick.set()  # fdatasync'd within fsync_interval
            except OSError as exc:
                self._on_io_error(exc, f"writing {self._meta_path}")
                raise

    def _sync_meta(self) -> None:
        try:
            self._meta.sync()
        except OSError as exc:
            self._on_io_error(exc, f"fdatasync of {self._meta_path}")
            raise


def _background(ref: weakref.ref, stop: threading.Event, kick: threading.Event, period: float) -> None:
    """Under ``interval``: fdatasync the journal and the meta file within ``period`` of a change;
    under both syncing policies: write the commit index, at most every ``_META_PERIOD``. Sleeps
    until something changes (``kick``: waking every 50 ms for nothing was a third of an idle
    node's CPU here). Holds the journal weakly: one nobody references goes away (``__del__``)."""
    name_native_thread("journal-sync")
    next_meta = time.monotonic() + _META_PERIOD
    while True:
        kick.wait()
        if stop.wait(period):  # what changes within a period is synced together
            return
        kick.clear()  # before syncing: a change made meanwhile kicks again
        journal = ref()
        if journal is None:
            return
        try:
            if journal._meta_dirty:
                if time.monotonic() >= next_meta:
                    next_meta = time.monotonic() + _META_PERIOD
                    journal._write_meta()
                else:
                    kick.set()  # the commit index waits for its turn
            if journal._policy == "interval":
                journal._sync()
                journal._sync_meta()  # term and vote written since the last round
        except OSError:  # reported through on_io_error
            return
        del journal


def using_journal(path: str | Path, *, fsync: str, fsync_interval: float, first_index: int = 0,
                  segment_bytes: int = 64 << 20, on_damage: Callable[[str], None] | None = None,
                  digest: segments.Digest = segments.full_digest) -> AbstractContextManager[None]:
    """While inside, a ``SyncObj`` constructed with ``journalFile=path`` gets a ``RaftJournal``
    with this policy (any other path: pysyncobj's own), dropping records below ``first_index``
    (the dump file's previous entry, 0 without one) and calling ``on_damage`` on damage.
    Raises ``RuntimeError`` if the block ends without pysyncobj asking for it."""
    make = partial(RaftJournal, fsync=fsync, fsync_interval=fsync_interval, first_index=first_index,
                   segment_bytes=segment_bytes, on_damage=on_damage, digest=digest)
    return internals.journal_factory(path, make)
