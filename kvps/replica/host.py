"""``StateHost``: the shard state behind one lock, and the effects of what is applied to it.

pysyncobj applies committed entries on its tick thread while the event loop serves reads, so the
state is guarded by one lock: changes go through ``apply`` (the state machine's one verb,
``kvps.machine``), reads through ``lookup(fn)``, which runs ``fn(state)`` under the lock. Dense
blocks are immutable arrays, so a read may keep what it got and encode it outside the lock.

The host performs the effects a command asks for, in order, before the next entry applies: it
keeps recent block versions itself (``BlockHistory``, for exact deltas in pulls), gives free heap
back when a capped table grew or evicted (``HeapTrimmer``) and hands every other effect (snapshot files, held
acknowledgements, log compaction) to ``perform``.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from kvps.command import Command, SnapshotStep
from kvps.machine import Applied, Effect, ForgetKey, ForgetVersions, RememberBlocks, RowsChurned
from kvps.replica.history import BlockHistory
from kvps.service.lifecycle import HeapTrimmer, heap_trimmer
from kvps.shard import ShardState

__all__ = ["StateHost"]

T = TypeVar("T")


class StateHost:
    def __init__(self, state: ShardState, *, history: Callable[[], BlockHistory],
                 perform: Callable[[Effect], None], heap: HeapTrimmer = heap_trimmer) -> None:
        self._lock = threading.Lock()
        self._state = state
        self._new_history = history
        self._history = history()
        self._perform = perform
        self._heap = heap

    def lookup(self, fn: Callable[[ShardState], T]) -> T:
        """``fn(state)`` under the lock (a read: ``fn`` must not change the state)."""
        with self._lock:
            return fn(self._state)

    def apply(self, cmd: Command) -> Any:
        """Apply a committed command (tick thread); its result, effects performed."""
        with self._lock:
            return self._settle(self._state.apply(cmd))

    def apply_restore(self, cmd: SnapshotStep, loaded: ShardState | None) -> Any:
        """Apply a restore step with the state its snapshot file holds (``None``: not loaded)."""
        with self._lock:
            return self._settle(self._state.apply_restore(cmd, loaded))

    def replace(self, state: ShardState) -> None:
        """Swap in a state restored from a Raft snapshot (an install, or a restart)."""
        with self._lock:
            self._state = state
            self._history = self._new_history()

    def remembered(self, key: str, block: int, version: int) -> np.ndarray | None:
        """Block ``version`` of ``key`` if this replica still remembers it (for an XOR delta)."""
        with self._lock:
            return self._history.get(key, block, version)

    def _settle(self, applied: Applied) -> Any:
        for effect in applied.effects:
            if isinstance(effect, RememberBlocks):
                for key, block, version, value in effect.blocks:
                    self._history.add(key, block, version, value)
            elif isinstance(effect, ForgetKey):
                self._history.drop_key(effect.key)
            elif isinstance(effect, ForgetVersions):
                self._history = self._new_history()
            elif isinstance(effect, RowsChurned):  # a capped table grew or evicted
                self._heap.maybe_trim()
            else:
                self._perform(effect)
        return applied.result
