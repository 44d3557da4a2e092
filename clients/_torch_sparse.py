"""torch's own sparse embeddings inside a ``PSModule``: ``nn.Embedding(sparse=True)`` and
``nn.EmbeddingBag(sparse=True)`` weights live in a kvps *table*, and a step pushes only the rows
its batch touched (``push_rows``), not the whole table.

The table starts with the module's own weight, "first worker wins" as for dense keys. A table is
created empty, so who writes the initial rows is decided by a compare-and-set on a small marker
key ``<key>/.init`` (0 = fresh, 1 = being written, 2 = ready): the worker whose set succeeds
writes the rows and marks the table ready; the others wait for that. Compare-and-set is
deduplicated by push id like every write, so a retried claim cannot make two owners.
"""
from __future__ import annotations

import asyncio
import time

import numpy as np
from torch import nn

from kvps.errors import Timeout, VersionConflict
from kvps.initializer import Zeros
from kvps.optimizer import Add

__all__ = ["ensure_table", "sparse_weights", "table_dtype"]

FRESH, CLAIMED, READY = 0.0, 1.0, 2.0


def sparse_weights(module: nn.Module) -> dict[str, nn.Module]:
    """``{parameter name: layer}`` of the embedding layers whose gradient is sparse."""
    out = {}
    for prefix, layer in module.named_modules():
        if isinstance(layer, (nn.Embedding, nn.EmbeddingBag)) and layer.sparse and layer.weight.requires_grad:
            out[f"{prefix}.weight" if prefix else "weight"] = layer
    return out


def table_dtype(dtype: str) -> str:
    """The table's dtype for a weight of ``dtype``: numpy has no bfloat16, the server keeps
    float32 (exactly what a bf16 model is rounded from)."""
    return "float32" if dtype == "bfloat16" else dtype


async def ensure_table(client, key: str, rows: np.ndarray, *, optimizer, merge: str,
                       timeout: float) -> bool:
    """Create table ``key`` and, if this worker is the first, write ``rows`` (num, dim) into it.
    Returns whether this worker wrote them; waits up to ``timeout`` s for another writer."""
    await client.create_table(key, rows.shape[1], dtype=rows.dtype.name, optimizer=optimizer,
                              init=Zeros(), merge=merge)
    marker = key + "/.init"
    await client.create(marker, np.zeros(1, np.float32), optimizer=Add())
    value, version = await client.get(marker, consistency="linearizable")
    if value[0] == FRESH:
        try:
            await client.set(marker, np.full(1, CLAIMED, np.float32), expected_version=version)
        except VersionConflict:
            pass  # another worker claimed it first
        else:
            await client.set_rows(key, np.arange(len(rows), dtype=np.int64), rows)
            await client.set(marker, np.full(1, READY, np.float32))
            return True
    await _wait_ready(client, key, marker, timeout)
    return False


async def _wait_ready(client, key: str, marker: str, timeout: float) -> None:
    deadline, pause = time.monotonic() + timeout, 0.005
    while (await client.get(marker, consistency="linearizable"))[0][0] != READY:
        if time.monotonic() > deadline:
            raise Timeout(f"table {key!r}: the worker that claimed its initial rows has not written "
                          f"them within {timeout}s (it may have died: delete {marker!r} to retry)",
                          key=key)
        await asyncio.sleep(pause)
        pause = min(2 * pause, 0.2)
