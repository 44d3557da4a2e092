"""The journal's compaction rewrite, on a thread of its own (``JournalRewrite``).

After a log compaction pysyncobj calls ``RaftJournal.deleteEntriesTo`` on its tick thread, which
only trims the entries in memory (pysyncobj indexes them at once) and moves ``_cut``; the
rewriter thread then copies the kept records into ``raft.journal.tmp`` and renames it over the
journal. Copying hundreds of MB and fsyncing them took seconds on a disk busy with other
replicas' snapshots, and a tick thread waiting for that sends no heartbeats: followers started
elections after every compaction.

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
fdatasync. Under ``never`` nothing is fsynced, as everywhere.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

from kvps.raft import disk
from kvps.raft.journal_file import HEADER, header
from kvps.raft.threads import name_native_thread

__all__ = ["JournalRewrite", "NOT_TRUNCATED"]

NOT_TRUNCATED = 1 << 63  # RaftJournal._truncated when nothing was truncated
_CATCH_UP_BYTES = 1 << 20  # a rewrite switches files (under the lock) once this little is left
_CATCH_UP_ROUNDS = 8  # ... or after this many rounds (appends outpacing the copies)


class JournalRewrite:
    """The rewrite half of ``RaftJournal`` (a base class of it): it shares the journal's lock,
    positions and file, which ``RaftJournal`` describes and sets up."""

    _lock: threading.Lock
    _fd: int
    _path: Path
    _policy: str
    _version: int
    _end: int
    _shift: int
    _cut: int
    _epoch: int
    _truncated: int
    _rewriter: threading.Thread | None
    _changes: int
    _synced: int
    _on_io_error: Callable[[OSError, str], None]

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
                    if self._fd < 0 or self._cut == self._shift + HEADER.size:
                        self._rewriter = None
                        return
                    epoch, start, src_shift = self._epoch, self._cut, self._shift
                    self._truncated = NOT_TRUNCATED
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
        shift = start - HEADER.size  # position - shift = offset in the new file
        fd, switched, old = -1, 0, -1
        try:
            if durable:  # the snapshot's rename, which this rewrite follows, reaches disk first
                disk.fsync_dir(self._path.parent)
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            disk.pwrite_all(fd, [header(self._version)], 0)
            copied, rounds = start, 0
            while True:
                with self._lock:
                    if self._epoch != epoch:  # clear(): the records being copied are gone
                        break
                    copied = min(copied, self._truncated)
                    self._truncated = NOT_TRUNCATED
                    end = self._end
                    if rounds and (end - copied <= _CATCH_UP_BYTES or rounds >= _CATCH_UP_ROUNDS):
                        old, switched = self._switch(tmp, fd, src, src_shift, shift, copied)
                        break
                os.ftruncate(fd, copied - shift)  # drop what a truncation made stale
                copied += disk.copy_range(src, fd, copied - src_shift, end - copied, copied - shift,
                                          to_eof=True)  # ends early if the file was cut meanwhile
                if durable:
                    disk.fdatasync(fd)
                rounds += 1
            if not switched:
                os.close(fd)
                tmp.unlink()
                return True
            os.close(old)
            if self._policy == "interval":
                disk.fdatasync(fd)
                disk.fsync_dir(self._path.parent)
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
        disk.copy_range(src, fd, copied - src_shift, self._end - copied, copied - shift)
        always = self._policy == "always"
        if always:
            disk.fdatasync(fd)
        os.rename(tmp, self._path)
        if always:
            disk.fsync_dir(self._path.parent)
        old, self._fd, self._shift = self._fd, fd, shift
        self._changes += 1  # a sync of the old file in flight does not cover the new one
        if always:
            self._synced = self._changes
        return old, self._changes
