"""``EmbeddingBagCollection``: several sparse features pooled into bags (like
``torch.nn.EmbeddingBag``), their rows in kvps tables, fetched together.

Features may share a table (``{"table": "items"}`` on both): their ids are deduplicated with the
rest of the step's ids, so a row is pulled once per step however many features and bags use it.
Each table is one ``Embedding`` (a submodule, so ``PSModule.push`` pushes its row gradients);
the pulls of all tables start together (``asyncio.gather``), and ``pull_rows`` sends one request
per shard holding rows of that table. Requests are per table: the data-plane ``pull_rows``
names one key, so two tables on one shard are two requests, in flight at the same time.

``prefetch(next_batch)`` starts the next step's pull in the background, so it overlaps the
current step's compute. The rows it brings may predate the current step's push: when the pull
is used (the next forward, or ``wait()``), rows that this module looked up since the prefetch
started are pulled again, so this worker always sees its own updates (rows pushed by other
workers meanwhile are as fresh as any pull's).
"""
from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from kvps.errors import InvalidRequest

from ._client import Client
from ._convert import host_values
from ._sync import SyncClient
from ._torch_copy import current_streams
from ._torch_embedding import Embedding

__all__ = ["EmbeddingBagCollection"]

_MODES = ("sum", "mean")
_TABLE_ARGS = ("optimizer", "init", "dtype", "merge", "clip_norm", "max_rows", "evict", "ttl_s", "admit")


def _pool(rows: torch.Tensor, offsets: torch.Tensor, mode: str) -> torch.Tensor:
    """Bags of ``rows`` (n, dim) starting at ``offsets`` (bags,) -> (bags, dim), as
    ``nn.EmbeddingBag`` (include_last_offset=False): an empty bag is zeros in both modes."""
    n, bags = rows.shape[0], offsets.shape[0]
    offsets = offsets.to(device=rows.device, dtype=torch.int64)
    ends = torch.cat([offsets[1:], torch.tensor([n], device=rows.device, dtype=torch.int64)])
    lengths = ends - offsets  # (bags,)
    bag = torch.repeat_interleave(torch.arange(bags, device=rows.device), lengths)  # (n,)
    out = torch.zeros(bags, rows.shape[1], dtype=rows.dtype, device=rows.device).index_add(0, bag, rows)
    if mode == "mean":
        out = out / lengths.clamp(min=1).to(rows.dtype).unsqueeze(1)
    return out  # (bags, dim)


class EmbeddingBagCollection(nn.Module):
    """Pooled embeddings of several features: ``tables`` maps a feature to its table spec, a dim
    or a dict ``{"dim", "table" (default: the feature's name), "optimizer", "init", "dtype",
    "merge"}`` and the lifecycle options ``"clip_norm", "max_rows", "evict", "ttl_s", "admit"``
    (``Client.create_table``); features naming the same table share its rows.
    ``forward({feature: (ids, offsets)})`` returns ``{feature: (bags, dim)}``. With an asyncio ``Client``, ``prefetch``
    must be called from the loop, and ``await ebc.wait()`` before the forward that uses it."""

    def __init__(self, client: Client | SyncClient, tables: Mapping[str, Any], *, mode: str = "sum") -> None:
        super().__init__()
        if mode not in _MODES:
            raise InvalidRequest(f"mode must be one of {_MODES}, not {mode!r}", field="mode")
        self._sync = client if isinstance(client, SyncClient) else None
        self.mode = mode
        self.features: dict[str, int] = {}  # feature -> index into self.tables
        specs: dict[str, dict] = {}
        for feature, spec in tables.items():
            spec = {"dim": spec} if isinstance(spec, int) else dict(spec)
            name = spec.pop("table", feature)
            unknown = sorted(set(spec) - {"dim", *_TABLE_ARGS})
            if unknown or "dim" not in spec:
                raise InvalidRequest(f"feature {feature!r}: a table spec needs 'dim' and may have "
                                     f"table, {', '.join(_TABLE_ARGS)} (got {unknown})", field=feature)
            if name in specs and specs[name] != spec:
                raise InvalidRequest(f"features sharing table {name!r} must agree on its spec", field=feature)
            specs[name] = spec
            self.features[feature] = list(specs).index(name)
        self.tables = nn.ModuleList([Embedding(client, name, **spec) for name, spec in specs.items()])
        self._inflight: Any = None  # (pull future or task, {table index: ids}, {index: touched ids})

    # ---- public ---------------------------------------------------------------------------------

    def forward(self, batch: Mapping[str, tuple[Any, Any]]) -> dict[str, torch.Tensor]:
        unknown = sorted(set(batch) - set(self.features))
        if unknown:
            raise InvalidRequest(f"unknown feature(s) {unknown}", field=unknown[0])
        if self._sync is not None:
            self._sync._run(self._complete_and_hold(self._by_table(batch, host_values)))
        elif self._inflight is not None:
            raise InvalidRequest("a prefetch is in flight: `await ebc.wait()` before forward")
        out = {}
        for feature, (ids, offsets) in batch.items():
            rows = self.tables[self.features[feature]](torch.as_tensor(ids).reshape(-1))  # (n, dim)
            out[feature] = _pool(rows, torch.as_tensor(offsets), self.mode)
        if self._inflight is not None:  # these rows will be pushed: the prefetched ones go stale
            self._touch(self._inflight[2])
        return out

    def prefetch(self, next_batch: Mapping[str, tuple[Any, Any]]) -> Any:
        """Start pulling ``next_batch``'s rows, all features and tables together, and return at
        once. (With an asyncio ``Client``: call it from the loop; ``await wait()`` to use them.)"""
        if self._inflight is not None:
            raise InvalidRequest("a prefetch is already in flight: forward (or wait) first")
        if self._sync is not None:
            groups = self._by_table(next_batch, host_values)
            future = self._sync._submit(self._pull(groups))
        else:
            groups = self._by_table(next_batch, _host_now)
            future = asyncio.get_running_loop().create_task(self._pull(groups))
        touched: dict[int, np.ndarray] = {}
        self._touch(touched)
        self._inflight = (future, groups, touched)

    def wait(self) -> Any:
        """Hold the prefetched rows (re-pulling those this module has looked up since): blocks,
        or a coroutine with an asyncio ``Client``."""
        coro = self._complete_and_hold({})
        return self._sync._run(coro) if self._sync is not None else coro

    def push(self) -> Any:
        """Push the row gradients of every table (``PSModule.push`` does this for its module)."""
        caller = current_streams([emb._where.device for emb in self.tables])
        if self._sync is not None:
            return self._sync._run(self._apush(caller))
        return self._apush(caller)

    # ---- internals --------------------------------------------------------------------------

    def _by_table(self, batch: Mapping[str, tuple[Any, Any]], to_host_fn: Any) -> dict[int, np.ndarray]:
        """{table index: sorted unique ids of every feature that uses it}."""
        parts: dict[int, list[np.ndarray]] = {}
        for feature, (ids, _) in batch.items():
            if feature not in self.features:
                raise InvalidRequest(f"unknown feature {feature!r}", field=feature)
            host = np.asarray(to_host_fn(ids, name="ids")).reshape(-1).astype(np.int64)
            parts.setdefault(self.features[feature], []).append(host)
        return {t: np.unique(np.concatenate(p)) for t, p in parts.items()}

    def _touch(self, touched: dict[int, np.ndarray]) -> None:
        """Add the rows each table holds now (this step's lookups) to ``touched``."""
        for t, emb in enumerate(self.tables):
            touched[t] = np.union1d(touched.get(t, np.empty(0, np.int64)), emb._held_ids)

    async def _pull(self, groups: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        """Rows of every table's ids, the tables' pulls in flight together."""
        rows = await asyncio.gather(*(self.tables[t]._fetch(ids) for t, ids in groups.items()))
        return dict(zip(groups, rows))

    async def _complete_and_hold(self, needed: dict[int, np.ndarray]) -> None:
        """Hold the prefetched rows (stale ones pulled again) and any ``needed`` rows missing."""
        prefetched: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        if self._inflight is not None:
            future, groups, touched = self._inflight
            self._inflight = None
            rows = await (asyncio.wrap_future(future) if self._sync is not None else future)
            prefetched = {t: (groups[t], rows[t]) for t in groups}
            stale = {t: np.intersect1d(ids, touched.get(t, ids[:0])) for t, (ids, _) in prefetched.items()}
            fresh = await self._pull({t: s for t, s in stale.items() if len(s)})
            for t, again in fresh.items():
                ids, got = prefetched[t]
                got = got.copy()
                got[np.searchsorted(ids, stale[t])] = again
                prefetched[t] = (ids, got)
            for t, (ids, got) in prefetched.items():
                self.tables[t]._adopt(ids, got)
        missing = {t: np.setdiff1d(ids, self.tables[t]._held_ids) for t, ids in needed.items()}
        for t, got in (await self._pull({t: m for t, m in missing.items() if len(m)})).items():
            self.tables[t]._adopt(missing[t], got)

    async def _apush(self, caller: dict) -> int:
        versions = await asyncio.gather(*(emb._apush(caller) for emb in self.tables))
        return max(versions, default=0)


def _host_now(ids: Any, *, name: str) -> np.ndarray:
    """Host ids without waiting (an asyncio prefetch): CPU tensors and arrays only."""
    if isinstance(ids, torch.Tensor) and ids.device.type != "cpu":
        raise InvalidRequest("with an asyncio Client, prefetch takes host ids (GPU ids would block "
                             "the loop)", field=name)
    return np.asarray(host_values(ids, name=name))

