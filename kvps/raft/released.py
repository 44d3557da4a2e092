"""A log entry's command once the journal's memory no longer holds it (DESIGN §11: a bounded log).

pysyncobj keeps every entry in its in-memory log until a compaction drops it, but once an entry
is applied and every follower has it, nothing needs its bytes in memory any more: its index and
term are all pysyncobj reads of it on the common paths. The journal (``kvps.raft.journal``) then
puts a ``Released`` in the entry's place: the command's length and where its record lies in a
segment. The bytes are read back from the segment (through the page cache, checked against the
record's checksum) only when something needs them:

- an append_entries to a follower that lags behind what was released: ``kvps.raft.wire``
  materialises each one as it encodes the message;
- a compaction's last two entries (``kvps.raft.compaction`` takes ``bytes()`` of them);
- pysyncobj comparing a snapshot's two entries with its log when it installs one (``==``), or
  reading an entry's type byte (slicing).

Pure: no pysyncobj, no socket, no thread (``kvps.raft.wire`` imports it). The ``reader`` is the
journal's: ``reader.read(released) -> bytes``.
"""
from __future__ import annotations

from typing import Any

__all__ = ["Released"]


class Released:
    """The command of log entry ``index``, ``length`` bytes at ``offset`` of segment ``segment``
    in its use ``epoch`` (a segment reused since cannot be read as this entry)."""

    __slots__ = ("reader", "segment", "epoch", "offset", "length", "index")

    def __init__(self, reader: Any, segment: Any, epoch: int, offset: int, length: int,
                 index: int) -> None:
        self.reader = reader
        self.segment = segment
        self.epoch = epoch
        self.offset = offset
        self.length = length
        self.index = index

    def __len__(self) -> int:
        return self.length

    def materialize(self) -> bytes:
        """The command's bytes, read back from the journal (fresh ``bytes`` each call)."""
        return self.reader.read(self)

    __bytes__ = materialize

    def __getitem__(self, item: Any) -> Any:
        return self.materialize()[item]

    def __eq__(self, other: object) -> Any:
        if isinstance(other, Released):
            other = other.materialize()
        if not isinstance(other, (bytes, bytearray, memoryview)):
            return NotImplemented
        return self.materialize() == other

    __hash__ = None  # type: ignore[assignment]  (equal to bytes, which hash by value)

    def __repr__(self) -> str:
        return f"Released(index={self.index}, length={self.length})"
