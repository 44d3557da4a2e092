"""The file primitives the journal, its meta file and the recovery marker share.

``fsync`` and ``fdatasync`` are this module's names for ``os.fsync`` / ``os.fdatasync``, looked up
at call time (``disk.fsync(fd)``), so tests can count or stall them by replacing them here.
"""
from __future__ import annotations

import errno
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["copy_range", "exit_on_io_error", "fdatasync", "fsync", "fsync_dir", "pwrite_all"]

_EX_IOERR = 74  # sysexits.h: an input/output error


def exit_on_io_error(exc: OSError, what: str) -> None:
    """The Raft journal's reaction to a failed write, fsync or read-back: exit the process."""
    logging.getLogger("kvps.raft").critical(
        "raft journal: %s failed: %s; exiting (the entry is in memory but maybe not on disk, and "
        "a failed fsync leaves the page cache untrustworthy)", what, exc)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(_EX_IOERR)

fdatasync = os.fdatasync
fsync = os.fsync


def fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fsync(fd)
    finally:
        os.close(fd)


def pwrite_all(fd: int, buffers: Sequence[Any], offset: int) -> None:
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


def copy_range(src: int, dst: int, offset: int, count: int, dst_offset: int, *,
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
            pwrite_all(dst, [chunk], dst_offset)
        if n == 0:
            if to_eof:
                break
            raise OSError(errno.EIO, f"copy_file_range copied nothing with {count} bytes left")
        offset += n
        dst_offset += n
        count -= n
        copied += n
    return copied
