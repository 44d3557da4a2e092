"""The Raft journal's segments: fixed-size files, preallocated once and recycled (etcd's WAL,
RocksDB's recyclable log records), their layout, and reading the log back from them at open.

Why: every appended MiB used to land in pages the process (and the page cache) had never touched,
and every compaction copied the kept records into a new file and freed the old one. On this VM
fresh memory costs 0.3-1.7 ms/MiB against 0.02-0.07 for reused memory (DESIGN §11). A segment is
written over and over: an append never grows or frees a file, and its pages stay cached.

Files, next to the journal's meta file: ``raft.journal.seg-NNNNNN``, each ``size`` bytes (the
configured ``journal_segment_bytes``; a record too big for one gets a segment of its own, which is
unlinked when retired). Layout (little-endian)::

    segment header  '<8sHHQQ'  magic b"KVPSRSEG", version (2), state (0 free, 1 live), epoch,
                               XXH3-64 of the fields before it; records start at offset 4096
    record          '<IIQQ'    checksum, command length, index, term; then the command bytes.
                               The checksum is the low 32 bits of XXH3-64 seeded with the
                               segment's epoch, over the length, index and term, then the
                               command's 64-bit digest (version 1: then the command itself)
    end marker      a record with length 0 and index 0: the segment's records end here

A command's **digest** is the journal's ``digest(command)``: by default XXH3-64 of the command
(a pass over it), or, for a journal whose proposed commands are checksummed frames (a kvps
shard's: ``prefixed_digest`` of ``kvps.delta.frame.verified_digest``), a digest of the frame's
head that *verifies* each array against the checksum the frame carries and refuses (``None``) a
frame whose bytes do not match them. The bytes are then hashed once on each follower, which is
also their check on receipt, and the state machine applies them without checking them again. A
leader's own proposals are not hashed again: it built their heads from checksums it computed or
checked on receipt, and journals them with that digest (``KnownDigests``).
Epoch-independent, so the same command has the same digest on every replica. Segments of
version 1 (an earlier kvps) are read with their own checksum and never appended to again.

The **epoch** is a per-journal counter, bumped every time a segment is taken into use, and
written into its header then. A record left in a recycled segment from an earlier use was summed
with another epoch, so it never validates: reading a segment stops at its first record that does
not (or at its end marker), whatever lies beyond.

The **log** is the live segments in epoch order (the order they were taken into use). A segment
starting at an index at or below the log read so far replaces the log from that index (a
truncation whose end marker a power loss lost); one starting past it is damage. Appends never
continue a segment that was cut: a truncation writes an end marker where the log now ends and
the next append takes a fresh segment, and so does every open (the tail of the last segment may
be torn: its end marker is written where its last good record ends).

Reading one segment (``scan``) stops at the first record that fails its checksum, is torn, or does
not continue the log. Like the single-file journal before it (``kvps.raft.journal_file``): a
**torn tail** is expected after a crash and silently ends the log; **damage** (a complete record
that fails its checksum with a good record of the same epoch right after it, a record that
breaks the sequence, or a segment starting past the log's end) is reported through ``on_damage``
before anything is dropped, and the bytes dropped are kept in ``raft.journal.damaged-<time>``.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import xxhash

from kvps.errors import CodecError
from kvps.raft import disk
from kvps.raft.journal_file import CHECKED, CRC, RECORD, Entry

__all__ = [
    "DATA", "FREE", "KnownDigests", "LIVE", "Loaded", "SEG_HEADER", "SEG_MAGIC", "Scan", "Segment", "create",
    "full_digest", "load", "marker", "prefixed_digest", "read_header", "record_sum", "scan",
    "segment_paths", "write_header",
]

SEG_MAGIC = b"KVPSRSEG"
SEG_VERSION = 2
_VERSIONS = (1, 2)
SEG_HEADER = struct.Struct("<8sHHQQ")  # magic, version, state, epoch, xxh3 of the fields before
DATA = 4096  # records start here (the header has a page of its own)
FREE, LIVE = 0, 1

logger = logging.getLogger("kvps.raft")


Digest = Callable[[Any], "int | None"]
_U64 = struct.Struct("<Q")


def full_digest(command: Any) -> int:
    """The default digest: XXH3-64 of every byte of the command."""
    return xxhash.xxh3_64_intdigest(command)


def prefixed_digest(prefix: bytes, command_digest: Digest | None,
                    known: "KnownDigests | None" = None) -> Digest:
    """A journal's digest for a group whose proposed commands (the entries starting with
    ``prefix``) are checked and digested by ``command_digest`` (returning ``None`` for bytes that
    fail their own checksums); every other entry (pysyncobj's own) is hashed whole. ``known``:
    the digests of this replica's own proposals, taken instead of a pass over their bytes."""
    if command_digest is None:
        return full_digest
    n = len(prefix)

    def digest(entry: Any) -> int | None:
        if known is not None:
            d = known.take(entry)
            if d is not None:
                return d
        if entry[:n] != prefix:
            return full_digest(entry)
        return command_digest(memoryview(entry)[n:])
    return digest


class KnownDigests:
    """The digests of the commands a leader proposed, known where it built them (a frame whose
    head carries checksums it computed, or checked on receipt: ``kvps.delta.frame.FrameParts``),
    so its journal does not hash their bytes a second time; its followers still check every byte
    on receipt. An entry is held from ``note`` until the journal ``take``s it or the proposal is
    settled (``forget``: a proposal forwarded or dropped when leadership moved never reaches this
    journal); at most ``size`` are kept, and one not found is hashed as any other entry."""

    def __init__(self, size: int = 64) -> None:
        self._size = size
        self._known: dict[int, tuple[Any, int]] = {}  # id(entry) -> (entry, digest)
        self._lock = threading.Lock()  # note()/forget() proposing or settling, take() on the tick thread

    def note(self, entry: Any, digest: int) -> int:
        """Remember ``entry``'s digest; the key to ``forget`` it by."""
        with self._lock:
            while len(self._known) >= self._size:
                self._known.pop(next(iter(self._known)))
            self._known[id(entry)] = (entry, digest)  # held: its id is its own meanwhile
        return id(entry)

    def take(self, entry: Any) -> int | None:
        """``entry``'s digest if it was noted (and forget it), else None."""
        with self._lock:
            found = self._known.pop(id(entry), None)
        if found is None or found[0] is not entry:
            return None
        return found[1]

    def forget(self, key: int) -> None:
        with self._lock:
            self._known.pop(key, None)

    def __len__(self) -> int:
        return len(self._known)


def record_sum(epoch: int, checked: bytes, command: Any, *, digest: Digest = full_digest,
               version: int = SEG_VERSION) -> int | None:
    """A record's checksum (low 32 bits of XXH3-64 seeded with its segment's epoch, over the
    checked header fields, then the command's digest); ``None`` if ``digest`` refuses the command
    (a frame whose arrays fail their checksums), which no stored checksum equals."""
    if version == 1:  # an earlier kvps's segment: the command's bytes themselves
        h = xxhash.xxh3_64(checked, seed=epoch)
        h.update(command)
        return h.intdigest() & 0xFFFFFFFF
    d = digest(command) if len(command) else 0
    if d is None:
        return None
    return xxhash.xxh3_64_intdigest(checked + _U64.pack(d), seed=epoch) & 0xFFFFFFFF


def marker(epoch: int, version: int = SEG_VERSION) -> bytes:
    """The end marker of a segment in use with ``epoch`` (holding records of ``version``)."""
    checked = CHECKED.pack(0, 0, 0)
    return CRC.pack(record_sum(epoch, checked, b"", version=version)) + checked


@dataclasses.dataclass(eq=False)
class Segment:
    """One segment file, open for the journal's life. ``first``/``last``: the raft indexes of its
    first and last live records (0, 0 while it holds none); ``tail``: where the next one goes."""

    path: Path
    fd: int
    size: int
    epoch: int = 0
    state: int = FREE
    version: int = SEG_VERSION  # of the records it holds (a free one is rewritten as current)
    tail: int = DATA
    first: int = 0
    last: int = 0

    def fits(self, length: int) -> bool:
        """Whether a record of ``length`` command bytes fits, leaving room for the end marker."""
        return self.tail + 2 * RECORD.size + length <= self.size

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def segment_paths(path: Path) -> list[Path]:
    """The segment files of the journal at ``path``, by number (removes one whose creation a
    crash cut short)."""
    for partial in path.parent.glob(f"{path.name}.seg-*.new"):
        partial.unlink()
    return sorted(path.parent.glob(f"{path.name}.seg-[0-9]*[0-9]"))


def create(path: Path, number: int, size: int, *, durable: bool, prefault: bool) -> Segment:
    """A new free segment of ``size`` bytes. With ``prefault`` (a spare, made in the background
    once a log needs more than one segment) its blocks are allocated and read once, so its pages
    are in the page cache before the first append needs them. Without it (a segment the Raft
    thread needs now: every journal's first) the file is sparse: blocks are allocated as records
    land and kept for every later use, so a small log takes only the disk it writes (a test
    cluster of 27 replicas would otherwise reserve 1.7 GiB)."""
    seg_path = path.with_name(f"{path.name}.seg-{number:06d}")
    new_path = seg_path.with_name(seg_path.name + ".new")  # under its name once allocated
    fd = os.open(new_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        try:
            if not prefault:
                raise OSError("sparse")
            os.posix_fallocate(fd, 0, size)
        except OSError:  # sparse by choice, or fallocate is not supported here
            os.ftruncate(fd, size)
        if prefault:  # reading allocated, never written blocks gives zeros without disk I/O,
            buffer = bytearray(1 << 20)  # and leaves their pages in the page cache (clean)
            for offset in range(DATA, size, len(buffer)):
                os.preadv(fd, [buffer], offset)
        segment = Segment(seg_path, fd, size)
        write_header(segment, FREE, 0)
        if durable:
            disk.fsync(fd)
        os.rename(new_path, seg_path)
    except BaseException:
        os.close(fd)
        new_path.unlink(missing_ok=True)
        raise
    if durable:
        disk.fsync_dir(path.parent)
    return segment


def write_header(segment: Segment, state: int, epoch: int) -> None:
    fields = SEG_HEADER.pack(SEG_MAGIC, SEG_VERSION, state, epoch, 0)[:-8]
    disk.pwrite_all(segment.fd, [fields, struct.pack("<Q", xxhash.xxh3_64_intdigest(fields))], 0)
    segment.state, segment.epoch, segment.version = state, epoch, SEG_VERSION


def read_header(seg_path: Path, fd: int) -> Segment:
    """The segment at ``seg_path``; one whose header fails its checksum (a torn header write) is
    free. A wrong magic or version is a ``CodecError``."""
    size = os.fstat(fd).st_size
    head = os.pread(fd, SEG_HEADER.size, 0)
    if len(head) < SEG_HEADER.size or head[:8] != SEG_MAGIC:
        raise CodecError(f"raft journal segment {seg_path}: not a kvps journal segment, magic "
                         f"{bytes(head[:8])!r}", path=str(seg_path))
    _, version, state, epoch, check = SEG_HEADER.unpack(head)
    if version not in _VERSIONS:
        raise CodecError(f"raft journal segment {seg_path}: unsupported format version {version}",
                         path=str(seg_path))
    if xxhash.xxh3_64_intdigest(head[:-8]) != check or state not in (FREE, LIVE):
        state = FREE
    return Segment(seg_path, fd, size, epoch, state, version)


@dataclasses.dataclass
class Scan:
    """What ``scan`` found in one segment."""

    entries: list[Entry]
    offsets: list[int]  # offset of each entry's record in the segment
    end: int  # offset after the last good record
    clean: bool = False  # ended by its end marker or its end, not by a bad record
    reason: str = ""  # why the bytes at ``end`` are not a good record
    damaged: bool = False  # that is damage rather than a torn tail


def scan(segment: Segment, after: Entry | None, digest: Digest = full_digest) -> Scan:
    """The good records of ``segment`` (see the module docstring); ``after``: the log's last
    entry before this segment (None if none), which its first record must not go back on."""
    out = Scan([], [], DATA)
    with open(os.dup(segment.fd), "rb", buffering=1 << 20) as f:
        f.seek(DATA)
        while not _read_record(f, segment, out, after, digest):
            pass
    return out


def _read_record(f: Any, segment: Segment, out: Scan, after: Entry | None, digest: Digest) -> bool:
    """Read the record at ``out.end`` into ``out``; True once the segment's records end."""
    offset, size, epoch = out.end, segment.size, segment.epoch
    if offset + RECORD.size > size:
        out.clean = True
        return True
    head = f.read(RECORD.size)
    crc, length, index, term = RECORD.unpack(head)
    if length > size - offset - RECORD.size:
        out.reason = f"record of {length} bytes runs past the end of the segment"
        return True
    command = f.read(length)
    if record_sum(epoch, head[CRC.size:], command, digest=digest, version=segment.version) != crc:
        out.reason = f"checksum mismatch in the record at offset {offset}"
        out.damaged = length > 0 and _good_record_at(segment, offset + RECORD.size + length, digest)
        return True
    if length == 0 and index == 0:
        out.clean = True
        return True
    last = out.entries[-1] if out.entries else after
    # the first record may start at or below ``after`` (it replaces the log from there on)
    if last is not None and (index > last[1] + 1 or (index == last[1] + 1 and term < last[2])
                             or (out.entries and index != last[1] + 1)):
        out.reason = f"entry ({index}, term {term}) does not follow ({last[1]}, term {last[2]})"
        out.damaged = True
        return True
    out.entries.append((command, index, term))
    out.offsets.append(offset)
    out.end = offset + RECORD.size + length
    return False


def _good_record_at(segment: Segment, offset: int, digest: Digest) -> bool:
    """Whether a record of the segment's epoch starts at ``offset``: then the bad record before
    it is damage, not a torn tail (no record is written after a torn one in the same use of a
    segment). An end marker there is no proof (a clean stop writes one after the last record);
    a damaged last record of a segment the log goes on from is damage by the gap it leaves."""
    if offset + RECORD.size > segment.size:
        return False
    head = os.pread(segment.fd, RECORD.size, offset)
    crc, length, index, _ = RECORD.unpack(head)
    if index == 0 or length > segment.size - offset - RECORD.size:  # the end marker proves nothing
        return False
    command = os.pread(segment.fd, length, offset + RECORD.size)
    return record_sum(segment.epoch, head[CRC.size:], command, digest=digest,
                      version=segment.version) == crc


@dataclasses.dataclass
class Loaded:
    """The log ``load`` read back: its entries, where each one's record is, the live segments
    in log order (with ``first``/``last``/``tail`` set) and every other one (free)."""

    entries: list[Entry]
    locs: list[tuple[Segment, int]]
    live: list[Segment]
    free: list[Segment]
    epoch: int  # the highest epoch any segment has had
    number: int  # the highest segment file number


def load(path: Path, *, durable: bool, first_index: int,
         on_damage: Callable[[str], None] | None, digest: Digest = full_digest) -> Loaded:
    """Open every segment of the journal at ``path`` and read the log back (module docstring),
    from ``first_index`` on: see ``kvps.raft.journal_file`` for why records below it go."""
    segments: list[Segment] = []
    try:
        for seg_path in segment_paths(path):
            fd = os.open(seg_path, os.O_RDWR)
            try:
                segments.append(read_header(seg_path, fd))
            except BaseException:
                os.close(fd)
                raise
        out = Loaded([], [], [], [s for s in segments if s.state != LIVE],
                     max((s.epoch for s in segments), default=0),
                     max((int(s.path.name.rsplit("-", 1)[1]) for s in segments), default=0))
        live = sorted((s for s in segments if s.state == LIVE), key=lambda s: s.epoch)
        unended: list[Segment] = []  # ended by a bad record: an end marker goes there
        for k, seg in enumerate(live):
            found = scan(seg, out.entries[-1] if out.entries else None, digest)
            if found.entries and out.entries and found.entries[0][1] <= out.entries[-1][1]:
                cut = len(out.entries) - (out.entries[-1][1] - found.entries[0][1] + 1)
                del out.entries[cut:], out.locs[cut:]  # a later segment replaces the log from here
            out.entries += found.entries
            out.locs += [(seg, offset) for offset in found.offsets]
            out.live.append(seg)
            seg.tail = found.end
            if found.clean:
                continue
            unended.append(seg)  # the next append takes a fresh segment: this one ends here
            if found.reason:  # a torn record, or one left from the segment's last use
                logger.info("raft journal %s: the log in %s ends at offset %d (%s)", path,
                            seg.path.name, found.end, found.reason)
            if found.damaged:  # reported before anything is dropped or overwritten
                _damaged(path, seg, found, live[k + 1:], len(out.entries), on_damage)
                for dropped in live[k + 1:]:
                    write_header(dropped, FREE, dropped.epoch)
                    out.free.append(dropped)
                break
        for seg in unended:
            if seg.tail + RECORD.size <= seg.size:
                disk.pwrite_all(seg.fd, [marker(seg.epoch, seg.version)], seg.tail)
                if durable:
                    disk.fdatasync(seg.fd)
        _drop_covered(path, out, first_index)
        _place(out, durable, path)
        return out
    except BaseException:
        for seg in segments:
            seg.close()
        raise


def _drop_covered(path: Path, out: Loaded, first_index: int) -> None:
    entries = out.entries
    covered = min(len(entries), first_index - entries[0][1]) if entries else 0
    if covered > 0:  # indexes are consecutive (scan stops where they are not)
        logger.info("raft journal %s: dropping entries %d..%d, older than the snapshot's "  # usual:
                    "previous entry %d", path,  # a segment is retired once all of it is covered
                    entries[0][1], entries[covered - 1][1], first_index)
        del entries[:covered], out.locs[:covered]


def _place(out: Loaded, durable: bool, path: Path) -> None:
    """Set each live segment's first and last index; free those left without entries."""
    for seg in out.live:
        seg.first = seg.last = 0
    for (seg, _), (_, index, _) in zip(out.locs, out.entries):
        seg.first = seg.first or index
        seg.last = index
    empty = [seg for seg in out.live if not seg.first]
    if empty and durable:  # a snapshot renamed into place just before is durable first
        disk.fsync_dir(path.parent)
    for seg in empty:
        write_header(seg, FREE, seg.epoch)
        out.free.append(seg)
    out.live = [seg for seg in out.live if seg.first]


def _damaged(path: Path, seg: Segment, found: Scan, later: list[Segment], kept: int,
             on_damage: Callable[[str], None] | None) -> None:
    """Damage, not a torn tail: report it before anything is dropped, so a crash from here on
    restarts the replica as recovering, and keep the bytes about to be dropped."""
    what = (f"raft journal {path}: damaged record in {seg.path.name} at offset {found.end} "
            f"({found.reason}), {len(later)} later segments; keeping the {kept} entries before it")
    logger.error("%s; this replica recovers from its peers before it votes again", what)
    if on_damage is not None:
        on_damage(what)
    kept_path = path.with_name(f"{path.name}.damaged-{time.time_ns()}")
    out = os.open(kept_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        at = disk.copy_range(seg.fd, out, found.end, seg.size - found.end, 0)
        for dropped in later:
            at += disk.copy_range(dropped.fd, out, 0, dropped.size, at)
        disk.fsync(out)
    finally:
        os.close(out)
    logger.warning("raft journal %s: the dropped bytes are kept in %s", path, kept_path)
