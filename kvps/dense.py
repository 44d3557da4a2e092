"""Dense keys: a tensor split into blocks along dim 0, each an immutable array with its version.

Blocks are immutable arrays inside immutable ``Block`` records, replaced on update: a reader (a
pull, a snapshot writer, the delta history) may keep a reference without a lock, and a snapshot of
the state is a shallow copy.

A replaced block's value array is kept for reuse (``Slots``, one per shard): the next update of a
block of that shape and dtype writes its new value into it instead of into memory the process
never touched (DESIGN §11), but only once nothing refers to it any more -- no reader, no view, no
buffer export (its reference count says so) -- so readers still only ever see arrays that never
change.
"""
from __future__ import annotations

import mmap
import sys
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvps.command import CreateKey
from kvps.delta import frame
from kvps.errors import InvalidRequest, KvpsError, ShapeMismatch
from kvps.optimizer import fitted_state, optimizer_from_dict
from kvps.placement import DenseLayout

__all__ = ["Block", "DenseKey", "Slots", "frozen"]


def _as(value: Any, dtype: np.dtype) -> np.ndarray:
    """``np.asarray(value, dtype)``, without its dtype handling when ``value`` is one already (an
    optimizer's result; a 0-d key's comes back a numpy scalar)."""
    if type(value) is np.ndarray and value.dtype == dtype:
        return value
    return np.asarray(value, dtype=dtype)


def frozen(arr: np.ndarray) -> np.ndarray:
    arr.flags.writeable = False
    return arr


def _keep(arr: np.ndarray) -> np.ndarray:
    """A block array from a decoded snapshot: a read-only view of immutable bytes (or of a
    read-only mapped snapshot file) is kept as it is (no copy of a 1 GB restore); anything
    writeable is copied, since blocks never change."""
    if not arr.flags.writeable and isinstance(_base_of(arr), (bytes, mmap.mmap)):
        return arr  # bytes are immutable; snapshot files are mapped read-only and never rewritten
    return frozen(arr.copy())


def _base_of(arr: np.ndarray):
    base = arr
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    if isinstance(base, memoryview):
        return base.obj
    return base


def _spec(arr: np.ndarray) -> dict:
    return {"shape": list(arr.shape), "dtype": arr.dtype.name}


@dataclass(frozen=True, eq=False)
class Block:
    value: np.ndarray  # read-only, the block's shape and the key's dtype
    version: int  # updates applied (a merged push of k counts k, a set counts 1)
    step: int  # optimizer steps applied (one per applied entry)
    state: dict[str, np.ndarray]  # optimizer state, read-only arrays of optimizer.state_shape(value.shape)


class Slots:
    """Replaced block values of a shard, by shape and dtype, reused once unreferenced (module
    docstring). Only values of ``min_bytes`` or more (smaller ones come from the allocator's free
    lists anyway); at most ``depth`` per shape and ``max_bytes`` in all, the oldest let go first."""

    def __init__(self, max_bytes: int = 32 << 20, depth: int = 2, min_bytes: int = 64 << 10) -> None:
        self.max_bytes, self.depth, self.min_bytes = max_bytes, depth, min_bytes
        self._free: dict[tuple, deque] = {}
        self.kept = 0  # bytes held for reuse
        self.reused = 0  # values written into a recycled slot (counted by DenseKey.step_block)

    def retire(self, arr: np.ndarray) -> None:
        nbytes = arr.nbytes
        if nbytes < self.min_bytes or nbytes > self.max_bytes or arr.base is not None \
                or not arr.flags.c_contiguous:  # (a snapshot's view does not own its memory)
            return
        queue = self._free.setdefault((arr.shape, arr.dtype.str), deque())
        if len(queue) >= self.depth:
            self.kept -= queue.popleft().nbytes
        while self.kept + nbytes > self.max_bytes:
            oldest = next(q for q in self._free.values() if q)
            self.kept -= oldest.popleft().nbytes
        queue.append(arr)
        self.kept += nbytes

    def take(self, shape: tuple, dtype: np.dtype) -> np.ndarray | None:
        """A writable array of ``shape`` and ``dtype`` nothing else refers to, or None."""
        queue = self._free.get((shape, dtype.str))
        for _ in range(len(queue) if queue else 0):
            arr = queue.popleft()
            if sys.getrefcount(arr) == 2:  # this name and the call's argument: nobody else
                self.kept -= arr.nbytes
                frame.forget_sum(arr)  # its checksum, remembered for pulls, is about to be wrong
                arr.flags.writeable = True
                return arr
            queue.append(arr)  # still read somewhere
        return None


class DenseKey:
    kind = "dense"

    def __init__(self, key: str, layout: DenseLayout, optimizer: dict, merge: str) -> None:
        self.key = key
        self.layout = layout
        self.dtype = np.dtype(layout.dtype)
        self.optimizer_dict = optimizer
        self.optimizer = optimizer_from_dict(optimizer)
        self.merge = merge
        self.blocks: dict[int, Block] = {}

    def definition(self) -> dict:
        lay = self.layout
        return {"kind": self.kind, "shape": list(lay.shape), "dtype": lay.dtype,
                "block_rows": lay.block_rows, "optimizer": self.optimizer_dict, "merge": self.merge}

    def version(self) -> int:
        return max((b.version for b in self.blocks.values()), default=0)

    def new_block(self, value: np.ndarray) -> Block:
        value = frozen(np.array(value, dtype=self.layout.dtype, copy=True))
        state = {k: frozen(v) for k, v in self.optimizer.init_state(value).items()}
        return Block(value, 0, 0, state)

    def check_block(self, block: Any, arr: Any) -> KvpsError | None:
        """Is ``arr`` a valid gradient / value for ``block`` of this key on this shard?"""
        if not isinstance(arr, np.ndarray):
            return InvalidRequest(f"block {block!r} of {self.key!r}: not an array", key=self.key)
        is_int = isinstance(block, (int, np.integer)) and not isinstance(block, bool)
        current = self.blocks.get(int(block)) if is_int else None
        if current is None:
            return InvalidRequest(f"block {block!r} of {self.key!r} is not on this shard",
                                  key=self.key, block=block if isinstance(block, int) else None)
        if arr.shape != current.value.shape or arr.dtype != current.value.dtype:
            return ShapeMismatch(self.key, _spec(current.value), _spec(arr), block=block)
        return None

    def step_block(self, block: int, grad: np.ndarray, count: int,
                   slots: Slots | None = None) -> Block:
        """The block after one optimizer step; its value in one of ``slots`` when one is free and
        the optimizer writes into it (``replace_block`` then retires the old value there)."""
        old = self.blocks[block]
        slot = None
        if slots is not None and self.optimizer.fills_out:
            slot = slots.take(old.value.shape, old.value.dtype)
        value, state = self.optimizer.step(old.value, grad, old.state, old.step + 1, out=slot)
        if slot is not None:
            if value is slot:
                slots.reused += 1
            else:  # not written into after all: kept for later
                slots.retire(slot)
        value = frozen(_as(value, self.dtype))
        state = {k: frozen(_as(v, self.dtype)) for k, v in state.items()}
        return Block(value, old.version + count, old.step + 1, state)

    def replace_block(self, block: int, new: Block, slots: Slots | None = None) -> None:
        """Commit ``new`` (from ``step_block``); the replaced value goes to ``slots``, reused once
        unreferenced."""
        old = self.blocks.get(block)
        self.blocks[block] = new
        if slots is not None and old is not None and old.value is not new.value:
            slots.retire(old.value)

    def snapshot_parts(self) -> tuple[dict, list[np.ndarray]]:
        names = self.optimizer.state_names()
        blocks = [(b, self.blocks[b]) for b in sorted(self.blocks)]
        arrays = [a for _, blk in blocks for a in (blk.value, *(blk.state[n] for n in names))]
        meta = {"key": self.key, **self.definition(),
                "blocks": [[b, blk.version, blk.step] for b, blk in blocks]}
        return meta, arrays

    @classmethod
    def from_snapshot(cls, meta: dict, arrays: list[np.ndarray]) -> tuple["DenseKey", int]:
        """The key ``snapshot_parts`` described, and how many arrays it used (ValueError if bad)."""
        cmd = CreateKey(meta["key"], tuple(meta["shape"]), meta["dtype"], meta["block_rows"],
                        meta["optimizer"], meta["merge"], ())  # validates the definition
        entry = cls(cmd.key, cmd.layout, cmd.optimizer, cmd.merge)
        names = entry.optimizer.state_names()
        at = 0
        for b, version, step in meta["blocks"]:
            value, *state = arrays[at:at + 1 + len(names)]
            at += 1 + len(names)
            shape = cmd.layout.block_shape(b)
            if len(state) != len(names) or value.shape != shape:
                raise ValueError(f"block {b} of {cmd.key!r} has the wrong shape")
            state = [fitted_state(entry.optimizer, a, shape) for a in state]  # ValueError if bad
            if any(a.dtype.name != cmd.dtype for a in (value, *state)):
                raise ValueError(f"block {b} of {cmd.key!r} has the wrong dtype")
            entry.blocks[int(b)] = Block(_keep(value), int(version), int(step),
                                         {n: _keep(a) for n, a in zip(names, state)})
        return entry, at
