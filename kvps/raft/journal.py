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

Layout (little-endian)::

    journal header  '<8sHHI'  magic b"KVPSRJNL", format version (2; 1 is still read), flags (0),
                              reserved (0)
    record          '<IIQQ'   checksum of everything after this field, command length, index,
                              term; then the command bytes. Version 2: the low 32 bits of XXH3-64
                              (~4x cheaper than CRC-32 here, and every replica sums every entry);
                              version 1: CRC-32. A file keeps its version for life: a rewrite
                              copies records, so it writes the header it read.

Opening reads every record and stops at the first one that is torn (shorter than its length says),
fails its CRC, or does not continue the log (index not previous + 1, or term going down); the file
is truncated there with a warning naming how many bytes were dropped. Two cases differ:

* a **torn tail**: the file ends inside that record, or it is the file's last record. Expected
  after a crash: only the last append can be incomplete, and an append is acknowledged only once
  written (what ``fsync`` adds is said below). Truncated, and the replica carries on as a voter.
* **damage**: a complete record that fails its checksum or breaks the sequence with more bytes
  after it. That is not a crash's footprint but a bad disk, a stray write or a bug, and the
  entries after it may have been acknowledged: this replica may have helped commit them and now
  lacks them. Voting at once could elect a member that lacks them too (a lagging one) and lose
  them. So before anything is truncated the journal calls ``on_damage`` (``ShardGroup`` marks the
  replica *recovering*, durably: no vote until it has caught up, ``kvps.raft.recovery``), keeps
  the records before the damage, and saves the bytes it drops beside the journal
  (``raft.journal.damaged-<time>``) for the operator.

A wrong magic or version, or a meta file that fails its checks, is a ``CodecError``: the vote and
term cannot be guessed safely.

Then records with an index below ``first_index`` (the snapshot's previous entry, which the caller
read from the dump file) are dropped: they are what a compaction's rewrite had not yet removed
from the file when the process died. Keeping them would make pysyncobj's ``__loadDumpFile`` see a
journal that does not start at the snapshot's (previous, last) entries, and it then clears the
journal, losing every entry after the snapshot on this replica. The file is rewritten without
them in the background, like after ``deleteEntriesTo``.

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
(``RaftJournal.deleteEntriesTo``). The commit index is written at most once a second, by a
background thread under those two policies, by pysyncobj's ``onOneSecondTimer`` under ``never``.
Since it may be ahead of what survived in the journal, it is clamped to the journal's last index
when read back (an unclamped one lets a restarted node apply entries nobody committed).

A failed write or fsync of the journal is fatal: the entry is already in pysyncobj's memory, and
after a failed fsync the page cache cannot be trusted to still hold it. The process logs the
error as critical and exits (``on_io_error``), and Raft treats it as any crashed replica.

Injection: ``SyncObj.__init__`` builds its journal by calling the module global
``pysyncobj.syncobj.createJournal(conf.journalFile)``; there is no configuration hook for a
journal class. ``using_journal(path, ...)`` replaces that global once (idempotently) with
``_create_journal``, which returns a ``RaftJournal`` for a path registered with its policy and
calls the original for any other path (so a plain ``SyncObj`` in the same process keeps
``FileJournal``). ``ShardGroup`` registers its journal only around its ``SyncObj.__init__`` call,
and ``using_journal`` raises if pysyncobj did not ask for the registered path meanwhile.
``tests/test_raft_pin.py`` fails if pysyncobj stops calling ``createJournal`` that way.
"""
from __future__ import annotations

import errno
import logging
import os
import struct
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pysyncobj.syncobj
import xxhash
from pysyncobj.journal import Journal

from kvps.config import FSYNC_POLICIES
from kvps.errors import CodecError
from kvps.raft.meta_file import META_MAGIC, MetaFile

__all__ = ["MAGIC", "META_MAGIC", "VERSION", "RaftJournal", "using_journal"]

logger = logging.getLogger("kvps.raft")

MAGIC = b"KVPSRJNL"
VERSION = 2  # the journal version new files get (kvps.raft.meta_file has its own)
_JOURNAL_VERSIONS = (1, 2)
_HEADER = struct.Struct("<8sHHI")
_RECORD = struct.Struct("<IIQQ")  # crc, command length, index, term
_CHECKED = struct.Struct("<IQQ")  # the record header fields the crc covers (then the command)
_CRC = struct.Struct("<I")
_EX_IOERR = 74  # sysexits.h: an input/output error
_META_PERIOD = 1.0  # seconds between commit index writes (pysyncobj's own cadence)
_CATCH_UP_BYTES = 1 << 20  # a rewrite switches files (under the lock) once this little is left
_CATCH_UP_ROUNDS = 8  # ... or after this many rounds (appends outpacing the copies)
_NOT_TRUNCATED = 1 << 63  # RaftJournal._truncated when nothing was truncated

# Looked up at call time, so tests can count calls by replacing them.
_fdatasync = os.fdatasync
_fsync = os.fsync

Entry = tuple[Any, int, int]  # (command bytes, index, term), pysyncobj's log entry shape


def name_native_thread(name: str) -> None:
    """Give the calling thread a kernel-visible name (Linux ``comm``, 15 bytes): ``top -H``,
    ``ps -L``, py-spy and ``/proc/<pid>/task/*/stack`` then tell the Raft threads apart."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
            f.write(name[:15])
    except OSError:  # not Linux, or /proc not mounted: names are only for diagnosis
        pass


def _record_sum(version: int, checked: bytes, command: Any) -> int:
    """A record's checksum: over the checked header fields, then the command bytes."""
    if version == 1:
        return zlib.crc32(command, zlib.crc32(checked))
    h = xxhash.xxh3_64(checked)
    h.update(command)
    return h.intdigest() & 0xFFFFFFFF


def _exit_on_io_error(exc: OSError, what: str) -> None:
    logger.critical("raft journal: %s failed: %s; exiting (the entry is in memory but maybe not on "
                    "disk, and a failed fsync leaves the page cache untrustworthy)", what, exc)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(_EX_IOERR)


class RaftJournal(Journal):
    """pysyncobj's ``Journal`` interface over our own file format (see the module docstring).

    pysyncobj calls every method on its tick thread, and none of them waits for the disk except
    as the policy says (term and vote under ``interval`` and ``always``; under ``always`` every
    change, and a rewrite's last fsyncs, made under ``_lock``). Other threads: under
    ``interval`` and ``always`` one background thread fdatasyncs the journal (``interval`` only,
    through a duplicate of the descriptor taken under ``_lock``) and writes the commit index
    (``_meta_lock``); under every policy a rewriter thread, while one is needed, rewrites the file
    after ``deleteEntriesTo`` (see there).

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
        self._on_damage = on_damage
        self._entries: list[Entry] = []  # pysyncobj indexes and slices this through __getitem__
        self._offsets: list[int] = []  # position of each entry's record
        self._end = _HEADER.size  # position after the last record
        self._shift = 0  # position - _shift = offset in the journal file
        self._cut = _HEADER.size  # position the file should start at (its first record still kept)
        self._epoch = 0  # bumped by clear(): a rewrite copying the records it removed is void
        self._truncated = _NOT_TRUNCATED  # lowest position truncated to since the rewriter's copy
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
                              fsync=lambda fd: _fsync(fd), fdatasync=lambda fd: _fdatasync(fd),
                              fsync_dir=_fsync_dir)
        self._term, self._voted_for, self._commit_index = \
            self._meta.term, self._meta.voted_for, self._meta.commit_index
        self._meta_dirty = False
        self._meta_lock = threading.Lock()
        self._fd = self._open_journal(first_index)
        self._stop = threading.Event()
        if fsync != "never":
            period = fsync_interval if fsync == "interval" else _META_PERIOD
            threading.Thread(target=_background, args=(weakref.ref(self), self._stop, period),
                             name=f"kvps-journal-sync {self._path.parent.name}", daemon=True).start()
        if self._cut != _HEADER.size:  # records the snapshot covers were dropped at open
            with self._lock:
                rewriter = self._start_rewriter()
            rewriter.start()

    # -- the log --------------------------------------------------------------------------------

    def add(self, command: Any, idx: int, term: int) -> None:
        checked = _CHECKED.pack(len(command), idx, term)
        crc = _record_sum(self._version, checked, command)
        with self._lock:
            self._write([_CRC.pack(crc) + checked, command], self._end - self._shift, "append")
            self._entries.append((command, idx, term))
            self._offsets.append(self._end)
            self._end += _RECORD.size + len(command)
            self._changes += 1
        self._changed()

    def clear(self) -> None:
        """Drop every entry (pysyncobj: a snapshot installed from the leader replaces the log)."""
        with self._lock:
            self._truncate(_HEADER.size)
            self._shift = self._end - _HEADER.size
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
        """Drop entries ``[:entryTo]`` (after log compaction). On the tick thread this only trims
        the entries in memory (pysyncobj indexes them at once) and moves ``_cut``; the rewriter
        thread then copies the kept records into ``raft.journal.tmp`` and renames it over the
        journal. Copying hundreds of MB and fsyncing them took seconds on a disk busy with other
        replicas' snapshots, and a tick thread waiting for that sends no heartbeats: followers
        started elections after every compaction.

        The rewrite (``_rewrite``): fsync the directory (so the snapshot renamed into place just
        before is durable before this journal's rename can be), copy positions ``[_cut, _end)``
        into the new file as one byte range in the kernel (``copy_file_range``; records do not
        depend on their offset), fdatasync it (unless ``never``), and again for what was appended
        meanwhile, until that is under ``_CATCH_UP_BYTES`` (or ``_CATCH_UP_ROUNDS`` rounds). Then,
        under ``_lock``: copy the rest, (``always``: fdatasync), rename, (``always``: fsync the
        directory), and switch ``_fd``/``_shift`` to the new file. Under ``interval`` the new file
        and directory are fsynced right after, outside the lock. The old descriptor is closed on
        the rewriter thread (the last close frees its blocks, waiting for write-back in flight).

        What the tick thread may do meanwhile, and why the result is still the kept entries:

        * ``add``: appends to the current (old) file under ``_lock``. The rewriter copies up to
          ``_end`` in every round and the rest under the lock as it switches, so the entry is in
          the new file too; after the switch appends go to the new file.
        * ``deleteEntriesFrom``: truncates the current file and lowers ``_truncated``. What the
          rewriter copied past that position may be stale (overwritten by later appends, or read
          while the file was cut): before its next round and before switching it truncates the
          new file there and copies from there again. It cannot cut below ``_cut``: the first
          kept entry is the snapshot's previous entry, which is committed.
        * ``deleteEntriesTo`` again: trims memory and moves ``_cut`` further. The running rewrite
          completes with the start it took (its file begins with records no longer in memory:
          harmless, ``_offsets`` are positions), then the rewriter starts over from the new cut.
        * ``clear``: truncates the current file to its header and bumps ``_epoch``. A rewrite that
          has not switched yet gives up at its next look under the lock and deletes its file; one
          that has switched had its new file truncated by this ``clear``.
        * ``_destroy`` and ``flush`` wait for the rewriter (shutdown and tests only).

        A crash before the rename leaves the old journal, which has every record (and a stale
        ``.tmp``, removed at open); its leading records that the snapshot covers are dropped at
        open (``first_index``). After the rename the new file is the journal. Under ``always``
        nothing acknowledged depends on what is not yet durable: the new file is fdatasynced
        before the rename and the directory after it, before appends go to the new file. Under
        ``interval`` the entries appended after the last round's fdatasync began may be lost on a
        power loss until the fsyncs after the switch: the same exposure as the periodic
        fdatasync. Under ``never`` nothing is fsynced, as everywhere."""
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
            _fdatasync(fd)
        except OSError as exc:
            self._on_io_error(exc, "fdatasync of the journal")
            raise
        finally:
            os.close(fd)
        with self._lock:
            self._synced = max(self._synced, target)

    # -- the compaction rewrite (rewriter thread; see deleteEntriesTo) ---------------------------

    def _start_rewriter(self) -> threading.Thread:
        """With ``_lock`` held: the rewriter thread, registered; the caller starts it after
        releasing the lock."""
        self._rewriter = threading.Thread(target=self._rewrite_all, daemon=True,
                                          name=f"kvps-journal-rewrite {self._path.parent.name}")
        return self._rewriter

    def _wait_rewritten(self) -> None:
        while True:
            with self._lock:
                rewriter = self._rewriter
            if rewriter is None or rewriter is threading.current_thread():
                return
            rewriter.join()

    def _rewrite_all(self) -> None:
        """Rewrite until the file starts at ``_cut``; deciding to stop and unregistering happen
        under one hold of the lock, so a ``deleteEntriesTo`` is never left without a rewriter."""
        name_native_thread("journal-rewrite")
        try:
            while True:
                with self._lock:
                    if self._fd < 0 or self._cut == self._shift + _HEADER.size:
                        self._rewriter = None
                        return
                    epoch, start, src_shift = self._epoch, self._cut, self._shift
                    self._truncated = _NOT_TRUNCATED
                    src = os.dup(self._fd)
                try:
                    if not self._rewrite(epoch, start, src, src_shift):
                        break  # an I/O error, reported; the old file stays (as after a crash)
                finally:
                    os.close(src)
        finally:
            with self._lock:
                if self._rewriter is threading.current_thread():
                    self._rewriter = None

    def _rewrite(self, epoch: int, start: int, src: int, src_shift: int) -> bool:
        """One rewrite of the journal (``src``, a duplicate of ``_fd`` whose file holds
        ``position - src_shift``) into a new file starting at position ``start``. False after an
        I/O error (reported through ``on_io_error``), True otherwise (switched or given up)."""
        tmp = Path(f"{self._path}.tmp")
        durable = self._policy != "never"
        shift = start - _HEADER.size  # position - shift = offset in the new file
        fd, switched, old = -1, 0, -1
        try:
            if durable:  # the snapshot's rename, which this rewrite follows, reaches disk first
                _fsync_dir(self._path.parent)
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            _pwrite_all(fd, [_HEADER.pack(MAGIC, self._version, 0, 0)], 0)
            copied, rounds = start, 0
            while True:
                with self._lock:
                    if self._epoch != epoch:  # clear(): the records being copied are gone
                        break
                    copied = min(copied, self._truncated)
                    self._truncated = _NOT_TRUNCATED
                    end = self._end
                    if rounds and (end - copied <= _CATCH_UP_BYTES or rounds >= _CATCH_UP_ROUNDS):
                        old, switched = self._switch(tmp, fd, src, src_shift, shift, copied)
                        break
                os.ftruncate(fd, copied - shift)  # drop what a truncation made stale
                copied += _copy_range(src, fd, copied - src_shift, end - copied, copied - shift,
                                      to_eof=True)  # ends early if the file was cut meanwhile
                if durable:
                    _fdatasync(fd)
                rounds += 1
            if not switched:
                os.close(fd)
                tmp.unlink()
                return True
            os.close(old)
            if self._policy == "interval":
                _fdatasync(fd)
                _fsync_dir(self._path.parent)
                with self._lock:
                    self._synced = max(self._synced, switched)
            return True
        except OSError as exc:
            if fd >= 0 and not switched:
                os.close(fd)
            self._on_io_error(exc, f"rewriting the journal into {tmp}")
            return False

    def _switch(self, tmp: Path, fd: int, src: int, src_shift: int, shift: int,
                copied: int) -> tuple[int, int]:
        """With ``_lock`` held: copy what the rounds have not, put the new file in place and
        append to it from now on; (the replaced descriptor, the change count it covers)."""
        os.ftruncate(fd, copied - shift)
        _copy_range(src, fd, copied - src_shift, self._end - copied, copied - shift)
        always = self._policy == "always"
        if always:
            _fdatasync(fd)
        os.rename(tmp, self._path)
        if always:
            _fsync_dir(self._path.parent)
        old, self._fd, self._shift = self._fd, fd, shift
        self._changes += 1  # a sync of the old file in flight does not cover the new one
        if always:
            self._synced = self._changes
        return old, self._changes

    # -- file access ----------------------------------------------------------------------------

    def _write(self, buffers: Sequence[Any], offset: int, what: str) -> None:
        try:
            _pwrite_all(self._fd, buffers, offset)
        except OSError as exc:
            self._on_io_error(exc, what)
            raise

    def _truncate(self, size: int) -> None:
        try:
            os.ftruncate(self._fd, size)
        except OSError as exc:
            self._on_io_error(exc, "truncating the journal")
            raise

    def _open_journal(self, first_index: int) -> int:
        if not self._path.exists():
            self._create_empty()
        fd = os.open(self._path, os.O_RDWR)
        try:
            end, reason, damaged = self._read_records()
            size = os.fstat(fd).st_size
            if damaged:
                self._damaged(fd, end, size, reason)
            if end < size:
                logger.warning("raft journal %s: dropped %d bytes after its last good record at "
                               "offset %d (%s; %d entries kept)", self._path, size - end, end,
                               reason, len(self._entries))
                os.ftruncate(fd, end)
                if self._policy != "never":
                    _fdatasync(fd)
        except BaseException:
            os.close(fd)
            raise
        self._end = end
        covered = min(len(self._entries), first_index - self._entries[0][1]) if self._entries else 0
        if covered > 0:  # indexes are consecutive (_read_records stops where they are not)
            logger.warning("raft journal %s: dropping entries %d..%d, older than the snapshot's "
                           "previous entry %d (a compaction's rewrite was cut short)", self._path,
                           self._entries[0][1], self._entries[covered - 1][1], first_index)
            del self._entries[:covered]
            del self._offsets[:covered]
        self._cut = self._offsets[0] if self._offsets else end
        return fd

    def _damaged(self, fd: int, end: int, size: int, reason: str) -> None:
        """Damage, not a torn tail (see the module docstring): report it before anything is
        dropped, so a crash from here on restarts the replica as recovering, and keep the bytes
        that are about to be dropped."""
        last = self._entries[-1][1] if self._entries else None
        what = (f"raft journal {self._path}: damaged record at offset {end} ({reason}) with "
                f"{size - end} bytes after it; keeping the {len(self._entries)} entries before it "
                f"(last index {last})")
        logger.error("%s; this replica recovers from its peers before it votes again", what)
        if self._on_damage is not None:
            self._on_damage(what)
        kept = self._path.with_name(f"{self._path.name}.damaged-{time.time_ns()}")
        out = os.open(kept, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _copy_range(fd, out, end, size - end, 0)
            if self._policy != "never":
                _fsync(out)
        finally:
            os.close(out)
        logger.warning("raft journal %s: the %d dropped bytes are kept in %s", self._path,
                       size - end, kept)

    def _create_empty(self) -> None:
        tmp = Path(f"{self._path}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _pwrite_all(fd, [_HEADER.pack(MAGIC, self._version, 0, 0)], 0)
            if self._policy != "never":
                _fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, self._path)
        if self._policy != "never":
            _fsync_dir(self._path.parent)

    def _read_records(self) -> tuple[int, str, bool]:
        """Fill ``_entries``/``_offsets`` from the file; (end of the last good record, why the
        rest, if any, is not good, whether that is damage rather than a torn tail)."""
        with open(self._path, "rb", buffering=1 << 20) as f:
            head = f.read(_HEADER.size)
            magic, version = (_HEADER.unpack(head)[:2] if len(head) == _HEADER.size else (head, 0))
            if magic != MAGIC:
                hint = (" (written by pysyncobj's own FileJournal, which kvps no longer reads; move "
                        "the replica's data directory away and let it catch up from its peers)"
                        if head.startswith(b"PYSYNCOBJ") else "")
                raise CodecError(f"raft journal {self._path}: not a kvps journal, magic "
                                 f"{bytes(head[:8])!r}{hint}", path=str(self._path))
            if version not in _JOURNAL_VERSIONS:
                raise CodecError(f"raft journal {self._path}: unsupported format version {version}",
                                 path=str(self._path))
            self._version = version
            size = os.fstat(f.fileno()).st_size
            offset = _HEADER.size
            while offset < size:
                head = f.read(_RECORD.size)
                if len(head) < _RECORD.size:
                    return offset, "torn record header", False
                crc, length, index, term = _RECORD.unpack(head)
                if length > size - offset - _RECORD.size:
                    return offset, f"record of {length} bytes runs past the end of the file", False
                command = f.read(length)
                last_record = offset + _RECORD.size + length == size
                if _record_sum(version, head[_CRC.size:], command) != crc:
                    return offset, f"checksum mismatch in the record of entry {index}", not last_record
                if self._entries:
                    _, last_index, last_term = self._entries[-1]
                    if index != last_index + 1 or term < last_term:
                        return offset, (f"entry ({index}, term {term}) does not follow "
                                        f"({last_index}, term {last_term})"), True
                self._entries.append((command, index, term))
                self._offsets.append(offset)
                offset += _RECORD.size + length
            return offset, "", False

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


def _copy_range(src: int, dst: int, offset: int, count: int, dst_offset: int, *,
                to_eof: bool = False) -> int:
    """Copy ``count`` bytes of ``src`` at ``offset`` to ``dst`` at ``dst_offset`` in the kernel;
    the bytes copied. Where ``src`` ends first: an error, or with ``to_eof`` the end of the copy."""
    copied = 0
    while count > 0:
        try:
            n = os.copy_file_range(src, dst, count, offset, dst_offset)
        except OSError as exc:  # not supported here: copy through user space, 4 MiB at a time
            if exc.errno not in (errno.ENOSYS, errno.EXDEV, errno.EINVAL, errno.EOPNOTSUPP):
                raise
            n = len(chunk := os.pread(src, min(count, 4 << 20), offset))
            _pwrite_all(dst, [chunk], dst_offset)
        if n == 0:
            if to_eof:
                break
            raise OSError(errno.EIO, f"copy_file_range copied nothing with {count} bytes left")
        offset += n
        dst_offset += n
        count -= n
        copied += n
    return copied


def _pwrite_all(fd: int, buffers: Sequence[Any], offset: int) -> None:
    """pwritev every byte of ``buffers`` at ``offset`` (pwritev may write less than asked)."""
    total = sum(len(b) for b in buffers)
    written = os.pwritev(fd, buffers, offset)
    if written == total:
        return
    views = [memoryview(b).cast("B") for b in buffers]
    done = 0
    while True:
        done += written
        skip = written
        while views and skip >= len(views[0]):
            skip -= len(views.pop(0))
        if not views:
            return
        views[0] = views[0][skip:]
        written = os.pwritev(fd, views, offset + done)


def _fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _fsync(fd)
    finally:
        os.close(fd)


# -- injection into pysyncobj -------------------------------------------------------------------

_original_create_journal = pysyncobj.syncobj.createJournal
_registry: dict[str, dict[str, Any]] = {}  # absolute journal path -> RaftJournal keyword arguments
_claimed: set[str] = set()
_registry_lock = threading.Lock()


def _create_journal(journalFile: str | None = None) -> Journal:
    """Stands in for ``pysyncobj.syncobj.createJournal`` (see the module docstring)."""
    if journalFile is not None:
        key = os.path.abspath(journalFile)
        with _registry_lock:
            options = _registry.get(key)
            if options is not None:
                _claimed.add(key)
        if options is not None:
            return RaftJournal(journalFile, **options)
    return _original_create_journal(journalFile)


@contextmanager
def using_journal(path: str | Path, *, fsync: str, fsync_interval: float,
                  first_index: int = 0,
                  on_damage: Callable[[str], None] | None = None) -> Iterator[None]:
    """While inside, a ``SyncObj`` constructed with ``journalFile=path`` gets a ``RaftJournal``
    with this policy, dropping records below ``first_index`` (the index of the dump file's
    previous entry, 0 without one: see the module docstring) and calling ``on_damage`` if it
    finds damage. Raises ``RuntimeError`` if the block ends without pysyncobj asking for it."""
    pysyncobj.syncobj.createJournal = _create_journal
    key = os.path.abspath(path)
    with _registry_lock:
        if key in _registry:
            raise RuntimeError(f"raft journal {key} is already being opened")
        _registry[key] = {"fsync": fsync, "fsync_interval": fsync_interval,
                          "first_index": first_index, "on_damage": on_damage}
    try:
        yield
    finally:
        with _registry_lock:
            del _registry[key]
            claimed = key in _claimed
            _claimed.discard(key)
    if not claimed:
        raise RuntimeError(f"pysyncobj did not open {key} through createJournal: the kvps journal "
                           f"was not installed (see kvps/raft/journal.py)")
