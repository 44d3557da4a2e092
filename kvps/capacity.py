"""The memory limit of a replica's table rows, judged in apply from the log alone.

A push is refused with ``CapacityExceeded`` when the rows (and admission counters) it would leave
on the shard, in accounted bytes (``Table.nbytes``: per row its values, optimizer state and record,
``kvps.record``, at the widths the push needs; the same on every replica), pass the server's
``memory_limit``. Dense keys do not count: a push never grows
them. The check runs on the planned updates, before anything is committed, so a refused push
changes nothing.
"""
from __future__ import annotations

from typing import Any

from kvps.errors import CapacityExceeded, KvpsError

__all__ = ["capacity_errors", "table_lifecycle_info"]


def capacity_errors(keys: dict[str, Any], planned: list, limit: int | None) -> dict[str, KvpsError]:
    """``{key: CapacityExceeded}`` for the tables whose planned updates (``[(table, RowUpdate)]``)
    take the shard past ``limit`` (empty: within it, or no limit)."""
    if limit is None or not planned:
        return {}
    after = {id(t): t.nbytes(u) for t, u in planned}
    total = 0
    for entry in keys.values():
        if entry.kind == "table":
            total += after.get(id(entry), entry.nbytes())
    if total <= limit:
        return {}
    return {t.key: CapacityExceeded(t.key, limit, total) for t, u in planned
            if after[id(t)] > t.nbytes()}


def table_lifecycle_info(table: Any) -> dict:
    """What ``describe`` adds for a table with a lifecycle: the rules, the version of rows not
    stored, and how many ids are counted but not admitted yet."""
    if table.lifecycle is None:
        return {}
    return {"lifecycle": table.lifecycle.to_dict(), "floor": table.floor, "pending": table.pending.n}
