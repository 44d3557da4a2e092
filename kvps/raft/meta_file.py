"""``raft.journal.meta``: a replica's current term, vote and commit index, overwritten in place.

Format 2 (this module writes it; format 1 is read and converted at open)::

    two slots of 512 bytes, at offsets 0 and 512; each slot:
    header  '<8sHHII'  magic b"KVPSRMET", format version (2), flags (0), crc32 of the body,
                       body length
    body    '<QQQi'    sequence number, term, commit index, vote length (-1: no vote), then the
                       vote (the voted-for node id, UTF-8); zero padding to 512 bytes

A write goes to the slot its new sequence number picks (``seq % 2``) with one ``pwrite``; opening
takes the valid slot with the higher sequence number. A write torn by a power loss fails its CRC
and the other slot, the state before that write, is used: the change it carried had not been
synced, so pysyncobj had not acted on it under ``always``, and under ``interval`` it is within the
window that policy may lose.

Why not a new file renamed over the old one each time (format 1, up to this version): every
rename freed the old file's block, and on a filesystem mounted with ``discard`` freeing a block
issues a discard that waits in the device queue behind all the writeback in flight. On this
machine (ext4, ``discard``, no I/O scheduler, 256 requests of up to 4 MiB queued) the tick thread
waited seconds there after heavy writes, right when a candidate stood for election: kernel stacks
of the stalled tick threads showed ``evict`` -> ``ext4_truncate`` -> ``blkdev_issue_discard`` ->
``submit_bio_wait``, and a fsync of the new file waiting in ``folio_wait_writeback``. An
overwrite in place frees nothing, and its ``fdatasync`` (when the policy asks for one on the
calling thread) has no metadata to write.
"""
from __future__ import annotations

import os
import struct
import threading
import zlib
from collections.abc import Callable
from pathlib import Path

from kvps.errors import CodecError

__all__ = ["META_MAGIC", "MetaFile"]

META_MAGIC = b"KVPSRMET"
_HEADER = struct.Struct("<8sHHII")
_BODY_V1 = struct.Struct("<QQi")
_BODY = struct.Struct("<QQQi")
SLOT = 512
_MAX_VOTE = SLOT - _HEADER.size - _BODY.size


def _slot(seq: int, term: int, voted_for: str | None, commit_index: int) -> bytes:
    vote = None if voted_for is None else str(voted_for).encode()
    if vote is not None and len(vote) > _MAX_VOTE:
        raise ValueError(f"a vote of {len(vote)} bytes does not fit a meta slot ({_MAX_VOTE})")
    body = _BODY.pack(seq, term, commit_index, -1 if vote is None else len(vote)) + (vote or b"")
    head = _HEADER.pack(META_MAGIC, 2, 0, zlib.crc32(body), len(body))
    return (head + body).ljust(SLOT, b"\0")


def _parse_slot(data: bytes) -> tuple[int, int, str | None, int] | None:
    """(seq, term, vote, commit index) of a valid slot, None for a torn or damaged one."""
    if len(data) < _HEADER.size:
        return None
    magic, version, _flags, crc, length = _HEADER.unpack_from(data)
    body = data[_HEADER.size:_HEADER.size + length]
    if (magic != META_MAGIC or version != 2 or length < _BODY.size or len(body) != length
            or zlib.crc32(body) != crc):
        return None
    seq, term, commit_index, vote_length = _BODY.unpack_from(body)
    vote = body[_BODY.size:]
    if vote_length != (len(vote) if vote_length >= 0 else -1) or (vote_length < 0 and vote):
        return None
    return seq, term, (vote.decode() if vote_length >= 0 else None), commit_index


def _parse_v1(data: bytes, where: str, path: Path) -> tuple[int, str | None, int]:
    if len(data) < _HEADER.size:
        raise CodecError(f"{where}: truncated ({len(data)} bytes); the term and vote it held "
                         f"cannot be recovered", path=str(path))
    magic, version, _flags, crc, length = _HEADER.unpack_from(data)
    body = data[_HEADER.size:]
    if magic != META_MAGIC:
        raise CodecError(f"{where}: bad magic {magic!r}", path=str(path))
    if version != 1:
        raise CodecError(f"{where}: unsupported version {version} ({len(data)} bytes)", path=str(path))
    if len(body) != length or zlib.crc32(body) != crc or length < _BODY_V1.size:
        raise CodecError(f"{where}: corrupt (length or CRC mismatch); the term and vote it held "
                         f"cannot be recovered", path=str(path))
    term, commit_index, vote_length = _BODY_V1.unpack_from(body)
    vote = body[_BODY_V1.size:]
    if vote_length != (len(vote) if vote_length >= 0 else -1) or (vote_length < 0 and vote):
        raise CodecError(f"{where}: bad vote length {vote_length}", path=str(path))
    return term, (vote.decode() if vote_length >= 0 else None), commit_index


class MetaFile:
    """The open meta file: ``term``, ``voted_for`` and ``commit_index`` as read at open (the
    journal keeps the current ones). ``write`` (any thread, serialized by the caller) overwrites
    one slot in the page cache; ``sync`` makes every write so far durable (a no-op when nothing changed).
    ``durable`` (every fsync policy but ``never``): the file is created or converted with fsyncs.
    A missing file starts as pysyncobj's defaults: term 0, no vote, commit index 1. The sync
    functions are the journal's (so its tests count them)."""

    def __init__(self, path: Path, *, durable: bool, fsync: Callable[[int], None] = os.fsync,
                 fdatasync: Callable[[int], None] = os.fdatasync,
                 fsync_dir: Callable[[Path], None] | None = None) -> None:
        self.path = Path(path)
        self._fsync, self._fdatasync, self._fsync_dir = fsync, fdatasync, fsync_dir
        self.term, self.voted_for, self.commit_index = 0, None, 1
        self._seq = 0
        self._lock = threading.Lock()  # guards _fd, _changes, _synced
        self._changes = 0
        self._synced = 0
        where = f"raft journal meta {self.path}"
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            data = None
        if data is not None and len(data) == 2 * SLOT:
            slots = [s for s in (_parse_slot(data[:SLOT]), _parse_slot(data[SLOT:])) if s is not None]
            if not slots:
                raise CodecError(f"{where}: both slots are corrupt; the term and vote it held "
                                 f"cannot be recovered", path=str(self.path))
            self._seq, self.term, self.voted_for, self.commit_index = max(slots)
        else:
            if data is not None:  # format 1: convert once
                self.term, self.voted_for, self.commit_index = _parse_v1(data, where, self.path)
            self._create(durable)
        self._fd = os.open(self.path, os.O_RDWR)

    def _create(self, durable: bool) -> None:
        """A complete format-2 file in place of none or a format-1 one (tmp, rename)."""
        tmp = Path(f"{self.path}.tmp")
        self._seq = 1
        data = _slot(0, self.term, self.voted_for, self.commit_index) + \
            _slot(1, self.term, self.voted_for, self.commit_index)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            if os.pwrite(fd, data, 0) != len(data):
                raise OSError(f"short write of {tmp}")
            if durable:
                self._fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, self.path)
        if durable and self._fsync_dir is not None:
            self._fsync_dir(self.path.parent)

    def write(self, term: int, voted_for: str | None, commit_index: int) -> None:
        with self._lock:
            data = _slot(self._seq + 1, term, voted_for, commit_index)
            self._seq += 1
            written = os.pwrite(self._fd, data, (self._seq % 2) * SLOT)
            if written != SLOT:
                raise OSError(f"short write of a meta slot ({written} of {SLOT} bytes)")
            self._changes += 1

    def sync(self) -> None:
        with self._lock:
            target = self._changes
            if self._fd < 0 or target == self._synced:
                return
            fd = os.dup(self._fd)
        try:
            self._fdatasync(fd)
        finally:
            os.close(fd)
        with self._lock:
            self._synced = max(self._synced, target)

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)
