"""The state-machine contract: what applying a command returns, and the effects it asks for.

Every replicated state in kvps (``ShardState``, the metadata group's ``MetaState``) has one verb
that changes it: ``apply(command) -> Applied``. It is deterministic and pure: no clock, no
randomness, no I/O, and it never raises (pysyncobj re-applies a raising entry forever): a domain
error is the ``result``, as a ``KvpsError`` value. What the replica must *do* because of a command
(write a snapshot file, hold acknowledgements until a snapshot's time is fixed, remember the new
block versions for deltas) comes back as ``effects``, and the host that applied it performs them
(``kvps.replica.host``), in order, after the state has changed. Reads go through the host's
``lookup(fn)``, under the same lock.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

__all__ = [
    "Applied", "CompactLog", "DropSnapshotFile", "Effect", "ForgetKey", "ForgetVersions",
    "HoldAcknowledgements", "ReleaseAcknowledgements", "RememberBlocks", "RowsChurned", "StateMachine",
    "WriteSnapshotFile",
]


class Effect:
    """Something the host does because a command was applied (never the state itself)."""


@dataclass(frozen=True)
class RememberBlocks(Effect):
    """New block versions, for exact XOR deltas in later pulls: ``(key, block, version, value)``
    with read-only values (references, not copies)."""
    blocks: tuple[tuple[str, int, int, np.ndarray], ...]


@dataclass(frozen=True)
class ForgetKey(Effect):
    """The key is gone: drop what the host remembers of it."""
    key: str


@dataclass(frozen=True)
class ForgetVersions(Effect):
    """Every block changed version at once (a restore): drop every remembered version."""


@dataclass(frozen=True)
class WriteSnapshotFile(Effect):
    """A user snapshot was cut at this entry: write ``meta`` and ``arrays`` (the state as of this
    entry, valid while the state moves on) to the snapshot's file, off the apply thread."""
    snap_id: str
    meta: dict
    arrays: tuple[np.ndarray, ...]


@dataclass(frozen=True)
class DropSnapshotFile(Effect):
    snap_id: str


@dataclass(frozen=True)
class HoldAcknowledgements(Effect):
    """From here on, hold the replies of applied pushes until the snapshot is sealed (its time is
    fixed) or dropped: a push acknowledged after the snapshot's time must not be in it."""
    snap_id: str


@dataclass(frozen=True)
class ReleaseAcknowledgements(Effect):
    snap_id: str


@dataclass(frozen=True)
class CompactLog(Effect):
    """Compact the Raft log now (after a restore, so a restart does not need the file again)."""


@dataclass(frozen=True)
class RowsChurned(Effect):
    """A table with a cap or a time-to-live added or evicted ``rows`` rows: its arrays grew, or
    eviction's work arrays were freed, so the host may give free heap back
    (``kvps.service.lifecycle.HeapTrimmer``): such a table's owner asked for bounded memory."""
    rows: int


@dataclass(frozen=True)
class Applied:
    """A command's outcome: its ``result`` (a value, or a ``KvpsError`` value) and ``effects``."""
    result: Any
    effects: tuple[Effect, ...] = ()


class StateMachine(Protocol):
    def apply(self, command: Any) -> Applied: ...

    def snapshot(self) -> bytes: ...
