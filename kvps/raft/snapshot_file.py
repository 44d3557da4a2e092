"""Our log-compaction snapshot file (pysyncobj's ``fullDumpFile``), written through its serializer hooks.

pysyncobj's default dump pickles every attribute of the SyncObj and gzips it at level 9 (~6 MB/s
here). With ``SyncObjConf.serializer`` / ``deserializer`` set it instead calls
``serializer(tmp_path, (last_entry, prev_entry, cluster))`` and renames ``tmp_path`` over the dump
file, and on load expects ``deserializer(path)`` to return that same triple (it then restores its
log from the two entries and, with dynamic membership, its member list from ``cluster``). The two
entries are ``(command bytes, index, term)`` of the last applied entry and the one before it.

Layout (little-endian)::

    header   '<8sHHIQ'  magic b"KVPSRSNP", format version (1), flags, checksum of body, body length
    body     2 x entry   '<QQQ' index, term, command length; command bytes
                         (the last applied entry first, then the one before it)
             members     '<I' count; count x ('<I' length; UTF-8 "host:port")
             state       '<Q' length; the state machine's own snapshot bytes

Flags: 0 = the checksum is zlib's CRC-32 (files written before the flag; still read),
``FLAG_XXH3`` (1) = the low 32 bits of XXH3-64, what ``write`` uses: a compaction sums its whole
state once more here, and CRC-32 was 7-8 % of a replica's busy time in B1 (about 4x XXH3's cost).
Other flags are refused.

Everything is checked (magic, version, flags, lengths, checksum) before any of it is used; any
problem is ``CodecError``. The file is fsynced before it is renamed into place, because the journal is
truncated right after a successful compaction. ``state`` may be given as a list of buffers (the
parts of the state's frame), written one after the other without joining them.
"""
from __future__ import annotations

import os
import struct
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import xxhash

from kvps.errors import CodecError

__all__ = ["FLAG_XXH3", "MAGIC", "RaftSnapshot", "VERSION", "read", "write", "write_buffers"]

MAGIC = b"KVPSRSNP"
VERSION = 1
FLAG_XXH3 = 1
_HEADER = struct.Struct("<8sHHIQ")
_ENTRY = struct.Struct("<QQQ")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

Entry = tuple[bytes, int, int]  # (command bytes, index, term), pysyncobj's log entry shape


@dataclass(frozen=True)
class RaftSnapshot:
    last_entry: Entry
    prev_entry: Entry
    members: tuple[str, ...]
    state: bytes | memoryview | Sequence[bytes | memoryview]


def write(path: str | Path, snap: RaftSnapshot, *, busy: Callable[[], bool] | None = None,
          reuse: bool = False) -> None:
    """Write ``snap`` to ``path`` and fsync it (at half speed while ``busy()``: see
    ``write_buffers``). ``reuse``: ``path`` is an older snapshot to overwrite in place (its pages
    are still in the page cache; a new file's would be fresh memory, DESIGN §11), cut to the new
    size first."""
    parts: list[bytes] = []
    for command, index, term in (snap.last_entry, snap.prev_entry):
        command = bytes(command)
        parts += [_ENTRY.pack(index, term, len(command)), command]
    parts.append(_U32.pack(len(snap.members)))
    for member in snap.members:
        raw = member.encode()
        parts += [_U32.pack(len(raw)), raw]
    state = [snap.state] if isinstance(snap.state, (bytes, bytearray, memoryview)) else list(snap.state)
    state = [memoryview(p).cast("B") for p in state]
    parts += [_U64.pack(sum(len(p) for p in state)), *state]
    digest = xxhash.xxh3_64()
    size = 0
    for part in parts:
        digest.update(part)
        size += len(part)
    checksum = digest.intdigest() & 0xFFFFFFFF
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | (0 if reuse else os.O_TRUNC), 0o644)
    try:
        if reuse:
            os.ftruncate(fd, _HEADER.size + size)
        write_buffers(fd, [_HEADER.pack(MAGIC, VERSION, FLAG_XXH3, checksum, size), *parts], busy=busy)
    finally:
        os.close(fd)


SYNC_EVERY = 32 * 1024 * 1024  # bytes written between fdatasyncs of a big file
_CHUNK = 8 * 1024 * 1024


def write_buffers(fd: int, buffers, sync_every: int = SYNC_EVERY, *,
                  busy: Callable[[], bool] | None = None) -> int:
    """Write ``buffers`` to ``fd`` in order, fdatasync every ``sync_every`` bytes, fsync at the end;
    the bytes written. Syncing as it goes keeps a multi-GB snapshot from filling the page cache
    with dirty pages: past the kernel's dirty limits every writer on the machine is throttled,
    the Raft journals included, and their heartbeats stall. Here only this writer waits.
    ``busy()`` says whether the replica is serving requests right now: the write then runs at
    half speed (log compaction, user snapshots)."""
    written = since_sync = 0
    started = time.monotonic()
    for buf in buffers:
        view = memoryview(buf).cast("B")
        for at in range(0, len(view), _CHUNK):
            chunk = view[at:at + _CHUNK]
            while chunk:
                n = os.write(fd, chunk)
                chunk = chunk[n:]
                written += n
                since_sync += n
            if since_sync >= sync_every:
                os.fdatasync(fd)
                since_sync = 0
                took = time.monotonic() - started
                if busy is not None and busy():
                    # The replica is serving: give the disk and cores back for as long as this
                    # segment took (half speed while training runs, full speed when idle).
                    time.sleep(min(took, 1.0))
                started = time.monotonic()
    os.fsync(fd)
    return written


def read(path: str | Path) -> RaftSnapshot:
    """Read and verify a snapshot file; ``CodecError`` if it is not a complete, intact one."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < _HEADER.size:
        raise CodecError(f"raft snapshot {path}: truncated header", path=str(path))
    magic, version, flags, checksum, size = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CodecError(f"raft snapshot {path}: bad magic {magic!r}", path=str(path))
    if version != VERSION:
        raise CodecError(f"raft snapshot {path}: unsupported version {version}", path=str(path))
    body = memoryview(data)[_HEADER.size:]
    if len(body) != size:
        raise CodecError(f"raft snapshot {path}: body is {len(body)} bytes, header says {size}",
                         path=str(path))
    if flags not in (0, FLAG_XXH3):
        raise CodecError(f"raft snapshot {path}: unknown flags {flags:#x}", path=str(path))
    actual = zlib.crc32(body) if flags == 0 else xxhash.xxh3_64_intdigest(body) & 0xFFFFFFFF
    if actual != checksum:
        raise CodecError(f"raft snapshot {path}: checksum mismatch", path=str(path))
    reader = _Reader(body, str(path))
    entries = []
    for _ in range(2):
        index, term, length = reader.unpack(_ENTRY)
        entries.append((reader.take(length), index, term))
    (count,) = reader.unpack(_U32)
    members = []
    for _ in range(count):
        (length,) = reader.unpack(_U32)
        try:
            members.append(reader.take(length).decode())
        except UnicodeDecodeError as exc:
            raise CodecError(f"raft snapshot {path}: bad member name", path=str(path)) from exc
    (length,) = reader.unpack(_U64)
    state = reader.view(length)
    if reader.remaining:
        raise CodecError(f"raft snapshot {path}: {reader.remaining} trailing bytes", path=str(path))
    return RaftSnapshot(entries[0], entries[1], tuple(members), state)


class _Reader:
    def __init__(self, body: memoryview, path: str) -> None:
        self._body = body
        self._pos = 0
        self._path = path

    @property
    def remaining(self) -> int:
        return len(self._body) - self._pos

    def take(self, n: int) -> bytes:
        if n > self.remaining:
            raise CodecError(f"raft snapshot {self._path}: truncated body", path=self._path)
        out = bytes(self._body[self._pos:self._pos + n])
        self._pos += n
        return out

    def view(self, n: int) -> memoryview:
        if n > self.remaining:
            raise CodecError(f"raft snapshot {self._path}: truncated body", path=self._path)
        out = self._body[self._pos:self._pos + n]
        self._pos += n
        return out

    def unpack(self, fmt: struct.Struct) -> tuple:
        return fmt.unpack(self.take(fmt.size))
