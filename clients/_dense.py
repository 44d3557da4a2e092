"""Dense keys on the client: splitting a value into its blocks per shard, chunking requests under
the cluster's size limit (and many keys' creates into ``create_keys`` batches), and the blocks a
client holds for incremental pulls."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kvps.delta.pack import PACK_MAX_BYTES, pack_into
from kvps.command import MAX_BATCH_KEYS
from kvps.placement import DenseLayout, block_shard

__all__ = ["DenseCache", "chunks", "create_keys_request", "key_batches", "split_blocks"]


class DenseCache:
    """The blocks of one dense key this client holds, with their versions (for incremental pulls)."""

    def __init__(self, layout: DenseLayout) -> None:
        self.layout = layout
        self.blocks: list[np.ndarray | None] = [None] * layout.n_blocks
        self.versions: list[int | None] = [None] * layout.n_blocks

    def assemble(self, out: np.ndarray | None = None) -> np.ndarray:
        """The key's value from its blocks: into ``out`` (of the key's shape and dtype) or a new array."""
        if out is None:
            out = np.empty(self.layout.shape, dtype=np.dtype(self.layout.dtype))
        if out.ndim == 0:
            out[()] = self.blocks[0]
            return out
        for b, block in enumerate(self.blocks):
            out[self.layout.block_slice(b)] = block
        return out


def split_blocks(key: str, layout: DenseLayout, arr: np.ndarray, shards: int) -> dict[int, list]:
    """``{shard: [(block, view of arr), ...]}``: the blocks of ``key`` by the shard that holds them."""
    per_shard: dict[int, list] = {}
    for b in range(layout.n_blocks):
        part = arr if arr.ndim == 0 else arr[layout.block_slice(b)]
        per_shard.setdefault(block_shard(key, b, shards), []).append((b, part))
    return per_shard


def chunks(items: list, limit: int, size: Callable[[Any], int]) -> list[list]:
    """Split ``items`` into consecutive chunks of at most ``limit`` bytes (at least one item each)."""
    out: list[list] = [[]]
    total = 0
    for item in items:
        n = size(item)
        if out[-1] and total + n > limit:
            out.append([])
            total = 0
        out[-1].append(item)
        total += n
    return [c for c in out if c]


def key_batches(items: list[tuple[dict, list]], limit: int) -> list[list[tuple[dict, list]]]:
    """Consecutive batches of (definition, blocks) within ``limit`` bytes and ``MAX_BATCH_KEYS``
    keys (at least one each), no key twice in one (a big key's blocks may span batches)."""
    out: list[list] = [[]]
    total, names = 0, set()
    for definition, part in items:
        n = sum(v.nbytes for _, v in part)
        if out[-1] and (total + n > limit or len(out[-1]) >= MAX_BATCH_KEYS or definition["key"] in names):
            out.append([])
            total, names = 0, set()
        out[-1].append((definition, part))
        total += n
        names.add(definition["key"])
    return [b for b in out if b]


def create_keys_request(batch: list[tuple[dict, list]]) -> tuple[dict, list]:
    """A ``create_keys`` request's meta and arrays: each key's blocks name their arrays; blocks
    up to ``PACK_MAX_BYTES`` are packed (one array per dtype, ``kvps.delta.pack``), as a push's
    gradients are."""
    defs, arrays, small, small_values = [], [], [], []
    for definition, part in batch:
        blocks = []
        for b, value in part:
            blocks.append({"block": b})
            if value.nbytes <= PACK_MAX_BYTES:
                small.append(blocks[-1])
                small_values.append(value)
            else:
                blocks[-1]["array"] = len(arrays)
                arrays.append(value)
        defs.append({**definition, "blocks": blocks})
    pack_into(small, small_values, arrays)
    return {"keys": defs}, arrays
