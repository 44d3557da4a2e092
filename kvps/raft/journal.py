"""Our Raft journal (pysyncobj's ``journalFile``): checksummed records, crash-safe rewrites and an
explicit fsync policy, installed in place of pysyncobj's ``FileJournal``.

Why not ``FileJournal`` (pysyncobj 0.3.17): it is an mmap that is never fsynced while running; its
``.meta`` (term, vote, commit index) is written and renamed without fsync; ``deleteEntriesTo``
(after every log compaction) rewrites the journal in place from offset 0, so a crash in the middle
loses entries; records carry no checksum, so a torn tail is read back as garbage; and ``add``
copies every command three times (``struct.pack`` + ``to_bytes`` + concatenation, then the mmap
slice), which shows at ~140 MB/s of 1 MiB commands.

Files, next to each other in the replica's journal directory::

    raft.journal        header, then one record per log entry, appended with pwritev
    raft.journal.meta   current term, vote, commit index: two slots overwritten in place, in turn
                        (``kvps.raft.meta_file``, which describes its layout)
    *.tmp               only while the journal is rewritten (or an older meta file converted);
                        a stale one is removed at open

Opening the file (``kvps.raft.journal_file``) truncates a torn tail, and reports damage in the
middle through ``on_damage`` (``ShardGroup`` then marks the replica *recovering*: no vote until it
has caught up, ``kvps.raft.recovery``) before it drops anything. A wrong magic or version, or a
meta file that fails its checks, is a ``CodecError``: the vote and term cannot be guessed safely.

The fsync policy (``RaftConfig.fsync``, README "Durability") says when appends reach stable
storage. Every policy survives ``kill -9`` of any process, because the page cache holds what was
written; they differ on power loss or a kernel crash:

* ``never``    no fsync at all, also not for the meta file or a compaction rewrite;
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
acknowledged appends). Compaction rewrites are fsynced by the thread that does them
(``kvps.raft.journal_rewrite``). The commit index is written at most once a second, by a
background thread under those two policies, by pysyncobj's ``onOneSecondTimer`` under ``never``.
Since it may be ahead of what survived in the journal, it is clamped to the journal's last index
when read back (an unclamped one lets a restarted node apply entries nobody committed).

A failed write or fsync of the journal is fatal: the entry is already in pysyncobj's memory, and
after a failed fsync the page cache cannot be trusted to still hold it. The process logs the
error as critical and exits (``on_io_error``), and Raft treats it as any crashed replica.

Injection: pysyncobj has no configuration hook for a journal class. ``using_journal(path, ...)``
has ``kvps.raft.internals.journal_factory`` give a ``SyncObj`` constructed inside it with
``journalFile=path`` a ``RaftJournal`` with this policy (any other path keeps pysyncobj's own
journal); ``ShardGroup`` uses it around its ``SyncObj.__init__`` call only.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from functools import partial
from pathlib import Path
from typing import Any

from pysyncobj.journal import Journal

from kvps.config import FSYNC_POLICIES
from kvps.raft import disk, internals, journal_file
from kvps.raft.journal_file import CHECKED, CRC, HEADER, MAGIC, RECORD, VERSION, Entry, record_sum
from kvps.raft.journal_rewrite import NOT_TRUNCATED, JournalRewrite
from kvps.raft.meta_file import META_MAGIC, MetaFile
from kvps.raft.threads import name_native_thread

# MAGIC, META_MAGIC and VERSION are the formats' own (journal_file, meta_file), named here too.
__all__ = ["MAGIC", "META_MAGIC", "RaftJournal", "VERSION", "using_journal"]

logger = logging.getLogger("kvps.raft")

_EX_IOERR = 74  # sysexits.h: an input/output error
_META_PERIOD = 1.0  # seconds between commit index writes (pysyncobj's own cadence)


def _exit_on_io_error(exc: OSError, what: str) -> None:
    logger.critical("raft journal: %s failed: %s; exiting (the entry is in memory but maybe not on "
                    "disk, and a failed fsync leaves the page cache untrustworthy)", what, exc)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(_EX_IOERR)


class RaftJournal(JournalRewrite, Journal):
    """pysyncobj's ``Journal`` interface over our own file format (see the module docstring).

    pysyncobj calls every method on its tick thread, and none of them waits for the disk except
    as the policy says (term and vote under ``interval`` and ``always``; under ``always`` every
    change, and a rewrite's last fsyncs, made under ``_lock``). Other threads: under
    ``interval`` and ``always`` one background thread fdatasyncs the journal (``interval`` only,
    through a duplicate of the descriptor taken under ``_lock``) and writes the commit index
    (``_meta_lock``); under every policy a rewriter thread, while one is needed, rewrites the file
    after ``deleteEntriesTo`` (``kvps.raft.journal_rewrite``).

    Positions: ``_offsets``, ``_end`` and ``_cut`` are byte positions in the log as if no record
    had ever been removed from the front of the file; the journal file (``_fd``) holds positions
    ``[_shift + header size, _end)`` at file offsets ``[header size, _end - _shift)``. Dropping
    the front of the file changes ``_shift``, not every offset. ``_lock`` guards ``_fd``,
    ``_shift``, ``_end`` and the rewrite's state (``_cut``, ``_epoch``, ``_truncated``,
    ``_rewriter``); every write to the file happens under it."""

    def __init__(self, path: str | Path, *, fsync: str = "interval", fsync_interval: float = 0.05,
                 first_index: int = 0,
                 on_io_error: Callable[[OSError, str], None] = _exit_on_io_error,
                 on_damage: Callable[[str], None] | None = None) -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync must be one of {FSYNC_POLICIES}, not {fsync!r}")
        self._path = Path(path)
        self._meta_path = Path(f"{path}.meta")
        self._policy = fsync
        self._on_io_error = on_io_error
        self._entries: list[Entry] = []  # pysyncobj indexes and slices this through __getitem__
        self._offsets: list[int] = []  # position of each entry's record
        self._end = HEADER.size  # position after the last record
        self._shift = 0  # position - _shift = offset in the journal file
        self._cut = HEADER.size  # position the file should start at (its first record still kept)
        self._epoch = 0  # bumped by clear(): a rewrite copying the records it removed is void
        self._truncated = NOT_TRUNCATED  # lowest position truncated to since the rewriter's copy
        self._rewriter: threading.Thread | None = None  # running while _cut is ahead of the file
        self._lock = threading.Lock()
        self._changes = 0  # journal changes made ...
        self._synced = 0  # ... and how many of them an fdatasync has covered
        self._fd = -1
        self._version = VERSION  # of the file, once opened (an existing one keeps its own)
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
        self._fd, records = journal_file.open_file(self._path, version=self._version,
                                                   durable=fsync != "never",
                                                   first_index=first_index, on_damage=on_damage)
        self._version, self._entries, self._end = records.version, records.entries, records.end
        self._offsets = records.offsets
        self._cut = self._offsets[0] if self._offsets else self._end
        self._stop = threading.Event()
        if fsync != "never":
            period = fsync_interval if fsync == "interval" else _META_PERIOD
            threading.Thread(target=_background, args=(weakref.ref(self), self._stop, period),
                             name=f"kvps-journal-sync {self._path.parent.name}", daemon=True).start()
        if self._cut != HEADER.size:  # records the snapshot covers were dropped at open
            with self._lock:
                rewriter = self._start_rewriter()
            rewriter.start()

    # -- the log --------------------------------------------------------------------------------

    def add(self, command: Any, idx: int, term: int) -> None:
        checked = CHECKED.pack(len(command), idx, term)
        crc = record_sum(self._version, checked, command)
        with self._lock:
            self._write([CRC.pack(crc) + checked, command], self._end - self._shift, "append")
            self._entries.append((command, idx, term))
            self._offsets.append(self._end)
            self._end += RECORD.size + len(command)
            self._changes += 1
        self._changed()

    def clear(self) -> None:
        """Drop every entry (pysyncobj: a snapshot installed from the leader replaces the log)."""
        with self._lock:
            self._truncate(HEADER.size)
            self._shift = self._end - HEADER.size
            self._cut = self._end
            self._epoch += 1  # a rewrite in flight copies records that are gone: it gives up
            self._entries = []
            self._offsets = []
            self._changes += 1
        self._changed()

    def deleteEntriesFrom(self, entryFrom: int) -> None:
        """Drop entries ``[entryFrom:]`` (a follower's conflicting suffix): truncate the file."""
        if entryFrom >= len(self._entries):
            return
        with self._lock:
            at = self._offsets[entryFrom]
            self._truncate(at - self._shift)
            self._end = at
            self._truncated = min(self._truncated, at)  # the rewriter copies from here again
            del self._entries[entryFrom:]
            del self._offsets[entryFrom:]
            self._changes += 1
        self._changed()

    def deleteEntriesTo(self, entryTo: int) -> None:
        """Drop entries ``[:entryTo]`` (after log compaction): trims memory and moves ``_cut`` on
        the tick thread; the rewriter thread rewrites the file (``kvps.raft.journal_rewrite``)."""
        if entryTo <= 0:
            return
        with self._lock:
            del self._entries[:entryTo]
            del self._offsets[:entryTo]
            self._cut = self._offsets[0] if self._offsets else self._end
            rewriter = self._start_rewriter() if self._rewriter is None else None
        if rewriter is not None:
            rewriter.start()

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
        return self._commit_index

    def onOneSecondTimer(self) -> None:
        if self._meta_dirty and self._policy == "never":  # otherwise the background thread does
            self._write_meta()

    # -- lifecycle ------------------------------------------------------------------------------

    def flush(self) -> None:
        """Everything written so far to stable storage now, whatever the policy (waits for a
        pending compaction rewrite: not for the tick thread)."""
        self._wait_rewritten()
        self._sync()
        if self._meta_dirty:
            self._write_meta()
        self._sync_meta()

    def _destroy(self) -> None:
        """pysyncobj's close: finish a pending rewrite (a clean stop leaves a clean journal), stop
        the syncing thread, sync (unless ``never``), close."""
        self._stop.set()
        self._wait_rewritten()
        if self._fd < 0:
            return
        if self._policy != "never":
            self._sync()
        if self._meta_dirty:
            self._write_meta()
        if self._policy != "never":
            self._sync_meta()
        self._meta.close()
        with self._lock:
            fd, self._fd = self._fd, -1
        os.close(fd)

    def __del__(self) -> None:  # a group dropped without stop(): no descriptor leak
        stop = getattr(self, "_stop", None)  # (a running rewriter holds a reference: not then)
        if stop is not None:
            stop.set()
        if getattr(self, "_fd", -1) >= 0:
            os.close(self._fd)
        self._fd = -1

    # -- internals ------------------------------------------------------------------------------

    def _changed(self) -> None:
        """After a change (counted in ``_changes`` under the lock): ``always`` syncs it now."""
        if self._policy == "always":
            self._sync()

    def _sync(self) -> None:
        """fdatasync the journal if anything changed since the last one (any thread)."""
        with self._lock:  # held only to read the descriptor: the tick thread never waits for an
            target = self._changes  # fdatasync in flight on the background thread
            if self._fd < 0 or target == self._synced:
                return
            fd = os.dup(self._fd)
        try:
            disk.fdatasync(fd)
        except OSError as exc:
            self._on_io_error(exc, "fdatasync of the journal")
            raise
        finally:
            os.close(fd)
        with self._lock:
            self._synced = max(self._synced, target)

    # -- file access ----------------------------------------------------------------------------

    def _write(self, buffers: Sequence[Any], offset: int, what: str) -> None:
        try:
            disk.pwrite_all(self._fd, buffers, offset)
        except OSError as exc:
            self._on_io_error(exc, what)
            raise

    def _truncate(self, size: int) -> None:
        try:
            os.ftruncate(self._fd, size)
        except OSError as exc:
            self._on_io_error(exc, "truncating the journal")
            raise

    def _write_meta(self) -> None:
        """Overwrite the meta file's next slot (kvps.raft.meta_file); under ``always`` also
        fdatasync it before returning."""
        with self._meta_lock:  # the tick thread (term, vote) or the background thread (commit)
            self._meta_dirty = False  # before reading: a change made meanwhile stays dirty
            try:
                self._meta.write(self._term, self._voted_for, self._commit_index)
                if self._policy == "always":
                    self._meta.sync()
            except OSError as exc:
                self._on_io_error(exc, f"writing {self._meta_path}")
                raise

    def _sync_meta(self) -> None:
        try:
            self._meta.sync()
        except OSError as exc:
            self._on_io_error(exc, f"fdatasync of {self._meta_path}")
            raise


def _background(ref: weakref.ref, stop: threading.Event, period: float) -> None:
    """Under ``interval``: fdatasync the journal and the meta file every ``period``; under both
    syncing policies: write the commit index, at most every ``_META_PERIOD``. Holds the journal
    only weakly, so a journal nobody references any more (its group dropped without ``stop()``)
    still goes away."""
    name_native_thread("journal-sync")
    next_meta = time.monotonic() + _META_PERIOD
    while not stop.wait(period):
        journal = ref()
        if journal is None:
            return
        try:
            if journal._meta_dirty and time.monotonic() >= next_meta:
                next_meta = time.monotonic() + _META_PERIOD
                journal._write_meta()
            if journal._policy == "interval":
                journal._sync()
                journal._sync_meta()  # term and vote written since the last round
        except OSError:  # reported through on_io_error
            return
        del journal


def using_journal(path: str | Path, *, fsync: str, fsync_interval: float, first_index: int = 0,
                  on_damage: Callable[[str], None] | None = None) -> AbstractContextManager[None]:
    """While inside, a ``SyncObj`` constructed with ``journalFile=path`` gets a ``RaftJournal``
    with this policy, dropping records below ``first_index`` (the index of the dump file's
    previous entry, 0 without one: see ``kvps.raft.journal_file``) and calling ``on_damage`` if
    it finds damage. Raises ``RuntimeError`` if the block ends without pysyncobj asking for it."""
    make = partial(RaftJournal, fsync=fsync, fsync_interval=fsync_interval, first_index=first_index,
                   on_damage=on_damage)
    return internals.journal_factory(path, make)
