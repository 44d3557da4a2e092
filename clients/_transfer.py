"""Whole-model transfer: every key out as arrays (``state_dict``) and back in (``load_state_dict``),
through the client's public calls."""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from kvps.errors import KeyNotFound

from ._convert import to_host, to_numpy

if TYPE_CHECKING:
    from ._client import Client

__all__ = ["load_state_dict", "merge_key_infos", "state_dict", "stored_rows"]


async def stored_rows(client: "Client", key: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids sorted, rows) of every row of table ``key`` that has been written."""
    shards = range(client.cluster_map.shards)
    resps = await client.sender.fan_out([client.call(s, "stored_rows", {"key": key}) for s in shards])
    info = await client.describe(key)
    ids = np.concatenate([r.arrays[r.meta["ids"]] for r in resps] or [np.empty(0, np.int64)])
    rows = np.concatenate([r.arrays[r.meta["rows"]] for r in resps]
                          or [np.empty((0, info["dim"]), np.dtype(info["dtype"]))])
    order = np.argsort(ids, kind="stable")
    return ids[order], rows[order]


async def state_dict(client: "Client", keys: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    """Every key as arrays: a dense key under its name; a table as ``name`` (its written rows) and
    ``name + ".ids"`` (their ids, int64). Each key is read consistently on its own; keys are not
    read at one instant across shards."""
    infos = {i["key"]: i for i in await client.keys()}
    wanted = sorted(infos) if keys is None else list(keys)
    dense = [k for k in wanted if infos.get(k, {}).get("kind") == "dense"]
    out: dict[str, np.ndarray] = dict(await client.pull(dense)) if dense else {}
    for key in wanted:
        if key not in infos:
            raise KeyNotFound(f"no key {key!r}", key=key)
        if infos[key]["kind"] == "table":
            ids, rows = await stored_rows(client, key)
            out[key], out[key + ".ids"] = rows, ids
    return out


async def load_state_dict(client: "Client", state: Mapping[str, Any], *, optimizer: Any = None) -> list[str]:
    """Write ``state`` (as from :func:`state_dict`): existing dense keys are overwritten with
    ``set``; missing ones are created with ``optimizer`` (default ``Add``). A pair ``name`` /
    ``name.ids`` is a table: missing tables are created (Zeros initializer), and the rows are
    written exactly with ``set_rows``; rows not in the file keep the table's initializer.
    Returns the keys written."""
    infos = {i["key"]: i for i in await client.keys()}
    state = await to_host(dict(state))
    written = []
    for key, value in state.items():
        if key.endswith(".ids") and key[:-4] in state:
            continue
        arr = np.ascontiguousarray(to_numpy(value, name=key))
        if key + ".ids" in state:
            if key not in infos:
                await client.create_table(key, arr.shape[1], dtype=arr.dtype.name, optimizer=optimizer)
            await client.set_rows(key, to_numpy(state[key + ".ids"], name=key), arr)
        elif key in infos:
            await client.set(key, arr)
        else:
            await client.create(key, arr, optimizer=optimizer)
        written.append(key)
    return written


def merge_key_infos(resps: list) -> list[dict]:
    """The ``keys`` replies of every shard as one list sorted by key: a dense key's blocks
    gathered, a table's row, byte and pending-admission counts summed over its shards."""
    merged: dict[str, dict] = {}
    for resp in resps:
        for info in resp.meta["keys"]:
            have = merged.setdefault(info["key"], info)  # the first shard's info as it is
            if info.get("kind") == "dense" and have is not info:
                have["blocks"] = sorted(set(have.get("blocks", [])) | set(info.get("blocks", [])))
            elif info.get("kind") == "table" and have is not info:
                have.update({f: have.get(f, 0) + info[f] for f in ("rows", "bytes", "pending") if f in info})
    return [merged[k] for k in sorted(merged)]
