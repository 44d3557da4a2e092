"""User snapshot files: one per shard replica per snapshot, ``DATA/snapshots/<id>/shard-<k>.kvsnap``.

Layout (little-endian)::

    header   '<8sHHIQH32sI'  magic b"KVPSUSNP", format version (1), flags (0), shard,
                             frame length, id length, digest (blake2b-256 of the frame's head),
                             crc32 of the header bytes before it and of the id
    id       id length bytes, UTF-8
    frame    a ``kvps.delta.frame`` snapshot frame: exactly ``ShardState.snapshot()``'s bytes

The frame carries a CRC per array in its head, so the digest of the head names the whole content
(the digests of every replica of a shard agree, and the catalog records it at commit), and
``frame.decode`` checks every array on load. Files are written to ``*.tmp``, fsynced, renamed into
place and the directory fsynced: a crash mid-write leaves a ``.tmp`` (removed by ``sweep``),
never a half-written snapshot under the real name. Anything that does not verify is ``CodecError``.
"""
from __future__ import annotations

import hashlib
import mmap
import os
import struct
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from kvps.delta import frame
from kvps.errors import CodecError
from kvps.raft.snapshot_file import write_buffers

__all__ = ["MAGIC", "SnapshotFile", "digest_of", "disk_usage", "file_path", "listed_ids", "read", "read_bytes", "remove",
           "sweep", "write_parts"]

MAGIC = b"KVPSUSNP"
VERSION = 1
_HEADER = struct.Struct("<8sHHIQH32s")
_CRC = struct.Struct("<I")


class SnapshotFile:
    """A verified snapshot file: its id, shard, digest and the frame bytes (a view of the file)."""

    def __init__(self, snap_id: str, shard: int, digest: str, frame_bytes: memoryview, size: int) -> None:
        self.snap_id = snap_id
        self.shard = shard
        self.digest = digest
        self.frame = frame_bytes
        self.size = size


def file_path(data_dir: Path, snap_id: str, shard: int) -> Path:
    return Path(data_dir) / "snapshots" / snap_id / f"shard-{shard}.kvsnap"


def digest_of(head: bytes | memoryview) -> str:
    return hashlib.blake2b(head, digest_size=32).hexdigest()


def write_parts(path: Path, snap_id: str, shard: int, meta: dict, arrays: Sequence[np.ndarray], *,
                busy: Callable[[], bool] | None = None) -> tuple[str, int]:
    """Encode ``(meta, arrays)`` (``ShardState.snapshot_parts()``) and write it crash-safely to
    ``path``. Returns (digest, file size). Runs happily off the state machine's thread: it only
    reads the arrays it was given."""
    parts = frame.encode_parts(frame.KIND_SNAPSHOT, meta, arrays)  # one CRC pass over the data
    frame_len = sum(len(p) for p in parts)
    raw_digest = hashlib.blake2b(parts[0], digest_size=32).digest()
    id_raw = snap_id.encode()
    head = _HEADER.pack(MAGIC, VERSION, 0, shard, frame_len, len(id_raw), raw_digest)
    head += _CRC.pack(zlib.crc32(id_raw, zlib.crc32(head))) + id_raw
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        write_buffers(fd, [head, *parts], busy=busy)  # synced as it goes, fsynced at the end
    finally:
        os.close(fd)
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    return raw_digest.hex(), len(head) + frame_len


def read(path: Path, *, shard: int | None = None, snap_id: str | None = None,
         digest: str | None = None) -> SnapshotFile:
    """Read and check a snapshot file's header, size and digest (``frame.decode`` then checks
    every array's CRC). ``CodecError`` naming the file and the problem otherwise."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            # Mapped, not read: a restore keeps the blocks as read-only views of the file's pages
            # (no copy of a GB-sized state; the kernel pages them in and may evict them). Snapshot
            # files are never modified in place, only replaced or unlinked, which a mapping
            # survives.
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if os.fstat(f.fileno()).st_size else b""
    except FileNotFoundError:
        raise CodecError(f"snapshot file {path} is missing", path=str(path)) from None
    return read_bytes(data, shard=shard, snap_id=snap_id, digest=digest, path=str(path))


def read_bytes(data: bytes | mmap.mmap, *, shard: int | None = None, snap_id: str | None = None,
               digest: str | None = None, path: str = "<bytes>") -> SnapshotFile:
    """``read`` for a file's content already in memory (a download)."""
    view = memoryview(data)
    fixed = _HEADER.size + _CRC.size
    if len(view) < fixed:
        raise CodecError(f"snapshot file {path}: truncated header", path=str(path))
    magic, version, _flags, f_shard, frame_len, id_len, raw_digest = _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise CodecError(f"snapshot file {path}: not a kvps snapshot (magic {bytes(magic)!r})", path=str(path))
    if version != VERSION:
        raise CodecError(f"snapshot file {path}: unsupported version {version}", path=str(path))
    (crc,) = _CRC.unpack_from(view, _HEADER.size)
    id_raw = bytes(view[fixed:fixed + id_len])
    if len(id_raw) != id_len or zlib.crc32(id_raw, zlib.crc32(view[:_HEADER.size])) != crc:
        raise CodecError(f"snapshot file {path}: header checksum mismatch", path=str(path))
    body = view[fixed + id_len:]
    if len(body) != frame_len:
        raise CodecError(f"snapshot file {path}: {len(body)} frame bytes, header says {frame_len} "
                         "(truncated or damaged)", path=str(path))
    found = raw_digest.hex()
    if digest_of(body[:frame.head_size(body)]) != found:
        raise CodecError(f"snapshot file {path}: digest mismatch (damaged)", path=str(path))
    f_id = id_raw.decode("utf-8", errors="replace")
    for what, want, got in (("shard", shard, f_shard), ("id", snap_id, f_id), ("digest", digest, found)):
        if want is not None and want != got:
            raise CodecError(f"snapshot file {path}: {what} is {got!r}, expected {want!r}", path=str(path))
    return SnapshotFile(f_id, f_shard, found, body, len(view))


def remove(data_dir: Path, snap_id: str, shard: int) -> None:
    """Delete this shard's file of ``snap_id`` (and the directory once empty)."""
    path = file_path(data_dir, snap_id, shard)
    for p in (path, path.with_name(path.name + ".tmp")):
        try:
            p.unlink()
        except FileNotFoundError:
            pass
    try:
        path.parent.rmdir()
    except OSError:
        pass


def sweep(data_dir: Path, shard: int) -> int:
    """Remove this shard's leftover ``.tmp`` files (a writer killed mid-write); how many."""
    root = Path(data_dir) / "snapshots"
    count = 0
    for tmp in root.glob(f"*/shard-{shard}.kvsnap.tmp"):
        tmp.unlink(missing_ok=True)
        count += 1
    return count


def listed_ids(data_dir: Path, shard: int) -> list[str]:
    root = Path(data_dir) / "snapshots"
    return sorted(p.parent.name for p in root.glob(f"*/shard-{shard}.kvsnap"))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def disk_usage(data_dir: Path) -> int:
    root = Path(data_dir) / "snapshots"
    return sum(p.stat().st_size for p in root.glob("*/*.kvsnap")) if root.exists() else 0

