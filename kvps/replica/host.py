"""``StateHost``: the shard state behind one lock, and the effects of what is applied to it.

pysyncobj applies committed entries on its tick thread while the event loop serves reads, so the
state is guarded by one lock: changes go through ``apply`` (the state machine's one verb,
``kvps.machine``), reads through ``lookup(fn)``, which runs ``fn(state)`` under the lock. Dense
blocks are immutable arrays, so a read may keep what it got and encode it outside the lock.

The host performs the effects a command asks for, in order, before the next entry applies: it
keeps recent block versions itself (``BlockHistory``, for exact deltas in pulls), gives free heap
back when a capped table grew or evicted (``HeapTrimmer``), copies each new version of a block a
same-host client pulled into the shared-memory mirror while this replica leads
(``kvps.replica.mirror``; every change of the mirror happens under this lock, in apply order) and
hands every other effect (snapshot files, held acknowledgements, log compaction) to ``perform``.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from kvps.command import Command, SnapshotStep
from kvps.machine import Applied, Effect, ForgetKey, ForgetVersions, RememberBlocks, RowsChurned
from kvps.replica.history import BlockHistory
from kvps.replica.mirror import MirrorFull, MirrorWriter
from kvps.service.lifecycle import HeapTrimmer, heap_trimmer
from kvps.shard import ShardState

__all__ = ["StateHost"]

T = TypeVar("T")

log = logging.getLogger("kvps.replica")


class StateHost:
    def __init__(self, state: ShardState, *, history: Callable[[], BlockHistory],
                 perform: Callable[[Effect], None], heap: HeapTrimmer = heap_trimmer) -> None:
        self._lock = threading.Lock()
        self._state = state
        self._new_history = history
        self._history = history()
        self._perform = perform
        self._heap = heap
        self._mirror: MirrorWriter | None = None
        self.mirror_full = False  # a mirror ran out of room: none again (raise server.mirror_bytes)

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
            self._close_mirror()

    def remembered(self, key: str, block: int, version: int) -> np.ndarray | None:
        """Block ``version`` of ``key`` if this replica still remembers it (for an XOR delta)."""
        with self._lock:
            return self._history.get(key, block, version)

    # ---- the shared-memory mirror (kvps.delta.mirror) ----------------------------------------

    @property
    def mirror(self) -> MirrorWriter | None:
        return self._mirror

    def open_mirror(self, make: Callable[[], MirrorWriter]) -> MirrorWriter | None:
        """The mirror, made now if there is none (the replica calls this only while it leads);
        None once one ran out of room."""
        with self._lock:
            if self._mirror is None and not self.mirror_full:
                self._mirror = make()
            return self._mirror

    def close_mirror(self) -> None:
        """No mirror from now on (until ``open_mirror``): readers stop trusting it at once."""
        with self._lock:
            self._close_mirror()

    def read_mirrored(self, key: str, blocks: list[int]) -> tuple[list[tuple[int, np.ndarray]], list | None]:
        """``read_blocks`` and, while there is a mirror, each block's ``[slot, tag]`` there (a
        block not yet in it, or at an older version, is copied in now)."""
        with self._lock:
            current = self._state.read_blocks(key, blocks)
            mirror = self._mirror
            if mirror is None:
                return current, None
            slots = []
            try:
                for block, (version, value) in zip(blocks, current):
                    slot = mirror.slot(key, block)
                    if slot is None or mirror.version(key, block) != version:
                        slot = mirror.publish(key, block, version, value)
                    slots.append(list(slot))
            except MirrorFull:
                self._mirror_ran_out()
                return current, None
            return current, slots

    def _mirror_ran_out(self) -> None:
        log.warning("the shared-memory mirror is full (%s); same-host pulls of this replica use "
                    "TCP from now on (server.mirror_bytes)", self._mirror.path if self._mirror else "")
        self.mirror_full = True
        self._close_mirror()

    def _close_mirror(self) -> None:
        if self._mirror is not None:
            self._mirror.close()
            self._mirror = None

    def _settle(self, applied: Applied) -> Any:
        for effect in applied.effects:
            if isinstance(effect, RememberBlocks):
                for key, block, version, value in effect.blocks:
                    self._history.add(key, block, version, value)
                if self._mirror is not None:  # the blocks it holds (a same-host client read them)
                    try:
                        for key, block, version, value in effect.blocks:
                            if self._mirror.slot(key, block) is not None:
                                self._mirror.publish(key, block, version, value)
                    except MirrorFull:
                        self._mirror_ran_out()
            elif isinstance(effect, ForgetKey):
                self._history.drop_key(effect.key)
                if self._mirror is not None:
                    self._mirror.forget_key(effect.key)
            elif isinstance(effect, ForgetVersions):
                self._history = self._new_history()
                self._close_mirror()
            elif isinstance(effect, RowsChurned):  # a capped table grew or evicted
                self._heap.maybe_trim()
            else:
                self._perform(effect)
        return applied.result
