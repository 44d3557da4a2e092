"""Embedding-table rows on the client: ids deduplicated, grouped by the shard that holds them and
batched under the cluster's request size; pulls send the versions held (``RowCache``) so only
changed rows come back."""
from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from kvps.errors import InvalidRequest
from kvps.lifecycle import admission_to_dict, lifecycle_from_dict
from kvps.placement import row_shards

from ._convert import check_shape, to_host, to_numpy
from ._rows import RowCache

if TYPE_CHECKING:
    from ._client import Client

__all__ = ["pull_rows", "push_rows", "set_rows", "table_lifecycle"]


def table_lifecycle(max_rows: int | None, evict: str, ttl_s: float | None, admit: Any,
                    shards: int) -> dict:
    """``create_table``'s lifecycle field ({} when every option is the default: rows live
    forever), checked here so a bad option fails before anything is sent."""
    if max_rows is None and ttl_s is None and admit is None and evict == "lru":
        return {}
    life = {"max_rows": max_rows, "shards": shards, "evict": evict, "ttl_s": ttl_s,
            "admit": admission_to_dict(admit)}
    return {"lifecycle": lifecycle_from_dict(life).to_dict()}  # type: ignore[union-attr]


async def _table(client: "Client", key: str, instead: str) -> dict:
    info = await client.describe(key)
    if info["kind"] != "table":
        raise InvalidRequest(f"{key!r} is a dense key: use {instead}", key=key)
    return info


def _ids(value: Any) -> np.ndarray:
    return np.asarray(to_numpy(value, name="ids"), dtype=np.int64).ravel()


def _groups(client: "Client", key: str, unique: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """``[(shard, positions in unique), ...]`` for sorted unique ``ids``."""
    shards = row_shards(key, unique, client.cluster_map.shards)
    return [(int(s), np.flatnonzero(shards == s)) for s in np.unique(shards)]


def _batches(client: "Client", key: str, unique: np.ndarray, row_bytes: int) -> Iterator[tuple[int, np.ndarray]]:
    """The groups of ``_groups`` cut into requests under the cluster's size limit."""
    per_request = max(1, client.cluster_map.max_push_bytes // max(1, row_bytes + 8))
    for s, idx in _groups(client, key, unique):
        for start in range(0, len(idx), per_request):
            yield s, idx[start:start + per_request]


async def pull_rows(client: "Client", key: str, ids: Any, consistency: str, min_version: int = 0) -> np.ndarray:
    info = await _table(client, key, "pull")
    unique, inverse = np.unique(_ids(await to_host(ids, name="ids")), return_inverse=True)
    groups = _groups(client, key, unique)
    read = {"consistency": consistency, **({"min_version": min_version} if min_version else {})}
    if client._row_cache:
        return (await _pull_incremental(client, key, info, unique, groups, read))[inverse]
    resps = await client.sender.fan_out([
        client.call(s, "pull_rows", {"key": key, "ids": 0, **read}, [unique[idx]], consistency=consistency)
        for s, idx in groups])
    await _check_issued(client, key, min_version, groups, resps)
    out = np.empty((len(unique), info["dim"]), dtype=np.dtype(info["dtype"]))  # (unique, dim)
    for (_, idx), resp in zip(groups, resps):
        out[idx] = resp.arrays[resp.meta["rows"]]
    return out[inverse]


async def _pull_incremental(client: "Client", key: str, info: dict, unique: np.ndarray,
                            groups: list, read: dict) -> np.ndarray:
    """Send the versions held; only changed rows come back (ids and versions compressed)."""
    cache = client._rows.setdefault(key, RowCache(info["dim"], np.dtype(info["dtype"])))
    have = cache.have(unique)  # (unique,) -1 where not held
    resps = await client.sender.fan_out([
        client.call(s, "pull_rows", {"key": key, "ids": 0, "have": 1, **read},
                    [unique[idx], have[idx]], consistency=read["consistency"], codec="shuffle-lz4")
        for s, idx in groups])
    await _check_issued(client, key, read.get("min_version", 0), groups, resps)
    for (_, idx), resp in zip(groups, resps):
        changed = resp.arrays[resp.meta["changed"]]  # positions within this group's ids
        cache.update(unique[idx][changed], resp.arrays[resp.meta["versions"]],
                     resp.arrays[resp.meta["rows"]])
    return cache.rows(unique)


async def _check_issued(client: "Client", key: str, min_version: int, groups: list, resps: list) -> None:
    """A table lives on every shard; a row pull asks only the shards holding its ids."""
    asked = {s for s, _ in groups}
    await client._check_issued(key, min_version, [r.meta.get("short", {}).get(key) for r in resps],
                               [s for s in range(client.cluster_map.shards) if s not in asked])


async def push_rows(client: "Client", key: str, ids: Any, grads: Any) -> int:
    info = await _table(client, key, "push")
    host = await to_host({"ids": ids, "grads": grads})
    ids, grads = _ids(host["ids"]), to_numpy(host["grads"], name=key)
    check_shape(key, grads, (len(ids), info["dim"]), info["dtype"])
    unique, inverse = np.unique(ids, return_inverse=True)
    summed = np.zeros((len(unique), info["dim"]), dtype=grads.dtype)  # (unique, dim)
    np.add.at(summed, inverse, grads)
    lossy = client._lossy
    requests = []
    for s, part in _batches(client, key, unique, summed.itemsize * info["dim"]):
        fields, parts = ({}, [summed[part]]) if lossy is None else \
            lossy.encode(key, -1, summed[part], rows=True)[:2]  # rows keep no residual
        requests.append((s, {"rows": [{"key": key, "ids": 0, "grads": 1, **fields}]}, [unique[part], *parts]))
    if not requests:
        return 0
    return (await client._push_requests(requests)).get(key, 0)


async def set_rows(client: "Client", key: str, ids: Any, values: Any) -> None:
    info = await client.describe(key)
    host = await to_host({"ids": ids, "values": values})
    ids, values = _ids(host["ids"]), np.ascontiguousarray(to_numpy(host["values"], name=key))
    check_shape(key, values, (len(ids), info["dim"]), info["dtype"])
    unique, first = np.unique(ids[::-1], return_index=True)    # the last write of an id wins
    values = values[::-1][first]
    await client.sender.fan_out([
        client.call(s, "set_rows", {"key": key, "ids": 0, "rows": 1}, [unique[part], values[part]])
        for s, part in _batches(client, key, unique, values.itemsize * info["dim"])])
    client._rows.pop(key, None)
