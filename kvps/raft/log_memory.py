"""How much of the Raft log the journal holds in memory: payloads released once nobody needs them.

A mixin of ``kvps.raft.journal.RaftJournal`` (as ``kvps.raft.segment_pool`` is). pysyncobj's
log is the journal's ``_entries`` list of ``(command, index, term)``; every command is also in a
segment record (``_locs``: where). ``release_to(index)`` replaces the commands of entries up to
``index`` by ``kvps.raft.released.Released`` placeholders, so the memory they were received
into (a follower's frame buffer, a leader's request buffer) is free for the next ones, instead
of staying until a compaction drops the entries; ``kvps.raft.group.ShardGroup`` decides the
index (applied here, and held by every follower, or past the memory budget). Commands smaller
than ``RELEASE_MIN_BYTES`` stay: a placeholder would cost about as much.

``held_bytes`` counts the command bytes of entries not released (small ones included): the
figure the budget is checked against. ``_entries[:_held_from]`` are released (or small). Reads
back (``RecordReader.read``) happen under the journal's lock, on whichever thread needs the
bytes, and check the record's checksum; a failed or mismatched read is an I/O error of the
journal, fatal as a failed write is (the entry is committed and someone needs it).
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from kvps.raft import segments
from kvps.raft.journal_file import CRC, RECORD
from kvps.raft.released import Released

__all__ = ["LogMemory", "RELEASE_MIN_BYTES", "RecordReader"]

RELEASE_MIN_BYTES = 1024


class RecordReader:
    """Reads a released command back from its segment record (the journal's lock held)."""

    def __init__(self, lock: threading.Lock, on_io_error: Callable[[OSError, str], None],
                 digest: Callable[[Any], "int | None"] = segments.full_digest) -> None:
        self._lock = lock
        self._on_io_error = on_io_error
        self._digest = digest
        self.reads = 0  # commands read back
        self.bytes_read = 0

    def read(self, entry: Released) -> bytes:
        seg, length = entry.segment, entry.length
        with self._lock:
            if seg.epoch != entry.epoch or seg.fd < 0:
                raise LookupError(f"raft entry {entry.index}: its segment was reused or closed")
            try:
                head = os.pread(seg.fd, RECORD.size, entry.offset)
                command = os.pread(seg.fd, length, entry.offset + RECORD.size)
            except OSError as exc:
                self._on_io_error(exc, f"reading entry {entry.index} back from {seg.path}")
                raise
        crc, n, index, _ = RECORD.unpack(head) if len(head) == RECORD.size else (0, -1, -1, 0)
        if (n, index, len(command)) != (length, entry.index, length) \
                or segments.record_sum(entry.epoch, head[CRC.size:], command, digest=self._digest,
                                       version=seg.version) != crc:
            exc = OSError(f"record of entry {entry.index} in {seg.path} does not match what was "
                          "written")
            self._on_io_error(exc, "reading the journal back")
            raise exc
        self.reads += 1
        self.bytes_read += length
        return command


class LogMemory:
    """The journal's payload accounting and release (see the module docstring)."""

    _entries: list
    _locs: list
    _lock: threading.Lock
    _digest: Callable[[Any], "int | None"]  # the journal's (set before _start_log_memory)

    def _start_log_memory(self, on_io_error: Callable[[OSError, str], None]) -> None:
        self._reader = RecordReader(self._lock, on_io_error, self._digest)
        self._held_from = 0
        self._held_bytes = sum(len(e[0]) for e in self._entries)
        self.released = {"entries": 0, "bytes": 0}  # released so far (counters)

    @property
    def released_through(self) -> int:
        """The raft index of the last entry released (0 if none): ``release_to`` up to it is a no-op."""
        entries, held = self._entries, self._held_from
        return entries[held - 1][1] if held and held <= len(entries) else 0

    @property
    def held_bytes(self) -> int:
        """Command bytes of the entries whose payload is still in memory."""
        return self._held_bytes

    @property
    def reads(self) -> dict[str, int]:
        """Released commands read back (a lagging follower, a compaction's boundary entries)."""
        return {"entries": self._reader.reads, "bytes": self._reader.bytes_read}

    def release_to(self, index: int) -> int:
        """Release the payloads of entries up to raft index ``index``; the bytes released."""
        with self._lock:
            entries = self._entries
            if not entries:
                return 0
            start, end = self._held_from, min(index - entries[0][1] + 1, len(entries))
            if end <= start:
                return 0
            locs, reader = self._locs, self._reader
            freed = released = 0
            for k in range(start, end):
                command, idx, term = entries[k]
                n = len(command)
                freed += n
                if n >= RELEASE_MIN_BYTES and type(command) is not Released:
                    seg, offset = locs[k]
                    entries[k] = (Released(reader, seg, seg.epoch, offset, n, idx), idx, term)
                    released += 1
            self._held_from = end
            self._held_bytes -= freed
            self.released["entries"] += released
            self.released["bytes"] += freed
            return freed

    # -- the journal's changes (called under its lock) ---------------------------------------

    def _held_added(self, length: int) -> None:
        self._held_bytes += length

    def _drop_entries(self) -> None:
        """Drop every entry."""
        self._entries, self._locs = [], []
        self._held_from, self._held_bytes = 0, 0

    def _held_dropping_from(self, position: int) -> None:
        """Entries ``[position:]`` are about to be dropped."""
        held = max(position, self._held_from)
        self._held_bytes -= sum(len(e[0]) for e in self._entries[held:])
        self._held_from = min(self._held_from, position)

    def _held_dropping_to(self, position: int) -> None:
        """Entries ``[:position]`` are about to be dropped."""
        if position > self._held_from:
            self._held_bytes -= sum(len(e[0]) for e in self._entries[self._held_from:position])
        self._held_from = max(0, self._held_from - position)
