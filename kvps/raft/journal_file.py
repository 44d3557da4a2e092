"""The single-file Raft journal (``raft.journal``) of kvps before segments: its layout, and
reading it back. ``RaftJournal`` reads such a file once, moves its records into segments
(``kvps.raft.segments``, which keeps its record header and its torn-tail/damage rules) and removes
it; the structures below are shared with the segments.

Layout (little-endian)::

    journal header  '<8sHHI'  magic b"KVPSRJNL", format version (2; 1 is still read), flags (0),
                              reserved (0)
    record          '<IIQQ'   checksum of everything after this field, command length, index,
                              term; then the command bytes. Version 2: the low 32 bits of XXH3-64
                              (~4x cheaper than CRC-32 here, and every replica sums every entry);
                              version 1: CRC-32. A file keeps its version for life: a rewrite
                              copies records, so it writes the header it read.

Opening (``open_file``) reads every record (``read_records``) and stops at the first one that is
torn (shorter than its length says), fails its checksum, or does not continue the log (index not
previous + 1, or term going down); the file is truncated there with a warning naming how many
bytes were dropped. Two cases differ:

* a **torn tail**: the file ends inside that record, or it is the file's last record. Expected
  after a crash: only the last append can be incomplete, and an append is acknowledged only once
  written (``kvps.raft.journal`` says what ``fsync`` adds). Truncated, and the replica carries on
  as a voter.
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
"""
from __future__ import annotations

import dataclasses
import logging
import os
import struct
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import xxhash

from kvps.errors import CodecError
from kvps.raft import disk

__all__ = [
    "CHECKED", "CRC", "Entry", "HEADER", "MAGIC", "RECORD", "Records", "VERSION", "header",
    "open_file", "read_records", "record_sum",
]

logger = logging.getLogger("kvps.raft")

MAGIC = b"KVPSRJNL"
VERSION = 2  # the journal version new files get (kvps.raft.meta_file has its own)
_VERSIONS = (1, 2)  # the versions read
HEADER = struct.Struct("<8sHHI")
RECORD = struct.Struct("<IIQQ")  # crc, command length, index, term
CHECKED = struct.Struct("<IQQ")  # the record header fields the crc covers (then the command)
CRC = struct.Struct("<I")

Entry = tuple[Any, int, int]  # (command bytes, index, term), pysyncobj's log entry shape


def header(version: int) -> bytes:
    return HEADER.pack(MAGIC, version, 0, 0)


def record_sum(version: int, checked: bytes, command: Any) -> int:
    """A record's checksum: over the checked header fields, then the command bytes."""
    if version == 1:
        return zlib.crc32(command, zlib.crc32(checked))
    h = xxhash.xxh3_64(checked)
    h.update(command)
    return h.intdigest() & 0xFFFFFFFF


@dataclasses.dataclass
class Records:
    """What ``read_records`` found in a journal file."""

    version: int
    entries: list[Entry]
    offsets: list[int]  # file offset of each entry's record
    end: int  # offset after the last good record
    reason: str = ""  # why the bytes after ``end``, if any, are not good
    damaged: bool = False  # that is damage rather than a torn tail (kvps.raft.journal)


def read_records(path: Path) -> Records:
    """Every good record of the journal at ``path``, up to the first one that is not."""
    with open(path, "rb", buffering=1 << 20) as f:
        head = f.read(HEADER.size)
        magic, version = (HEADER.unpack(head)[:2] if len(head) == HEADER.size else (head, 0))
        if magic != MAGIC:
            hint = (" (written by pysyncobj's own FileJournal, which kvps no longer reads; move "
                    "the replica's data directory away and let it catch up from its peers)"
                    if head.startswith(b"PYSYNCOBJ") else "")
            raise CodecError(f"raft journal {path}: not a kvps journal, magic "
                             f"{bytes(head[:8])!r}{hint}", path=str(path))
        if version not in _VERSIONS:
            raise CodecError(f"raft journal {path}: unsupported format version {version}",
                             path=str(path))
        size = os.fstat(f.fileno()).st_size
        records = Records(version, [], [], HEADER.size)
        while records.end < size:
            if not _read_record(f, size, records):
                break
        return records


def _read_record(f: Any, size: int, records: Records) -> bool:
    """Read the record at ``records.end`` into ``records``; False (reason set) if it is not good."""
    offset, entries = records.end, records.entries
    head = f.read(RECORD.size)
    if len(head) < RECORD.size:
        records.reason = "torn record header"
        return False
    crc, length, index, term = RECORD.unpack(head)
    if length > size - offset - RECORD.size:
        records.reason = f"record of {length} bytes runs past the end of the file"
        return False
    command = f.read(length)
    last_record = offset + RECORD.size + length == size
    if record_sum(records.version, head[CRC.size:], command) != crc:
        records.reason = f"checksum mismatch in the record of entry {index}"
        records.damaged = not last_record
        return False
    if entries:
        _, last_index, last_term = entries[-1]
        if index != last_index + 1 or term < last_term:
            records.reason = (f"entry ({index}, term {term}) does not follow "
                              f"({last_index}, term {last_term})")
            records.damaged = True
            return False
    entries.append((command, index, term))
    records.offsets.append(offset)
    records.end = offset + RECORD.size + length
    return True


def open_file(path: Path, *, version: int, durable: bool, first_index: int,
              on_damage: Callable[[str], None] | None) -> tuple[int, Records]:
    """Open (or create, as ``version``) the journal at ``path`` for reading and writing: its
    descriptor, and its good records from ``first_index`` on (see the module docstring).
    ``durable``: every fsync policy but ``never`` (the file is then created and cut with fsyncs)."""
    if not path.exists():
        _create_empty(path, version, durable)
    fd = os.open(path, os.O_RDWR)
    try:
        records = read_records(path)
        size = os.fstat(fd).st_size
        if records.damaged:
            _damaged(path, fd, records, size, durable, on_damage)
        if records.end < size:
            logger.warning("raft journal %s: dropped %d bytes after its last good record at "
                           "offset %d (%s; %d entries kept)", path, size - records.end, records.end,
                           records.reason, len(records.entries))
            os.ftruncate(fd, records.end)
            if durable:
                disk.fdatasync(fd)
    except BaseException:
        os.close(fd)
        raise
    entries = records.entries
    covered = min(len(entries), first_index - entries[0][1]) if entries else 0
    if covered > 0:  # indexes are consecutive (read_records stops where they are not)
        logger.warning("raft journal %s: dropping entries %d..%d, older than the snapshot's "
                       "previous entry %d (a compaction's rewrite was cut short)", path,
                       entries[0][1], entries[covered - 1][1], first_index)
        del entries[:covered]
        del records.offsets[:covered]
    return fd, records


def _damaged(path: Path, fd: int, records: Records, size: int, durable: bool,
             on_damage: Callable[[str], None] | None) -> None:
    """Damage, not a torn tail (see the module docstring): report it before anything is
    dropped, so a crash from here on restarts the replica as recovering, and keep the bytes
    that are about to be dropped."""
    end, entries = records.end, records.entries
    last = entries[-1][1] if entries else None
    what = (f"raft journal {path}: damaged record at offset {end} ({records.reason}) with "
            f"{size - end} bytes after it; keeping the {len(entries)} entries before it "
            f"(last index {last})")
    logger.error("%s; this replica recovers from its peers before it votes again", what)
    if on_damage is not None:
        on_damage(what)
    kept = path.with_name(f"{path.name}.damaged-{time.time_ns()}")
    out = os.open(kept, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        disk.copy_range(fd, out, end, size - end, 0)
        if durable:
            disk.fsync(out)
    finally:
        os.close(out)
    logger.warning("raft journal %s: the %d dropped bytes are kept in %s", path, size - end, kept)


def _create_empty(path: Path, version: int, durable: bool) -> None:
    tmp = Path(f"{path}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        disk.pwrite_all(fd, [header(version)], 0)
        if durable:
            disk.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)
    if durable:
        disk.fsync_dir(path.parent)
