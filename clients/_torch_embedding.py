"""``Embedding``: an embedding layer whose rows live in a kvps table (pulled per batch, pushed as
row gradients), for tables too large to hold on every worker.

Between two pushes the layer *holds* the rows it pulled (``prefetch`` adds to them; with a
``SyncClient`` a forward pass pulls the rows it lacks). The held rows become one leaf tensor per
device that requires grad; any number of forward passes (a table shared by several features)
index into it, and ``push`` sends the gradients of the rows that were actually looked up.

Ids on a GPU are looked up on the GPU (``searchsorted`` over the held ids): no copy of the ids to
the host, so no stall of the caller's stream. The check that every id was held runs on the GPU
too, and is read at ``push``, which refuses to push a step that looked up rows it did not hold.
"""
from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from kvps.errors import InvalidRequest

from ._client import Client
from ._convert import device_to_host, host_values, to_host
from ._lossy import bf16_round
from ._sync import SyncClient
from ._torch_copy import PinnedBuffer, current_streams, host_array, wait_event
from ._torch_sparse import table_dtype

__all__ = ["Embedding"]


@dataclass
class _Leaf:
    """The held rows on one device, as a leaf that requires grad, and what forward used."""

    ids: np.ndarray                 # (n,) sorted unique
    rows: torch.Tensor              # (n, dim), requires grad
    used: np.ndarray                # (n,) bool: looked up by a host-side lookup
    ids_dev: torch.Tensor | None = None   # (n,) on the GPU, for GPU lookups
    used_dev: torch.Tensor | None = None  # (n,) bool on the GPU
    missing: torch.Tensor | None = None   # () bool on the GPU: a GPU lookup missed


def _unique(hosts: list) -> np.ndarray:
    """Sorted unique int64 ids of host arrays, tensors or lists."""
    flat = [np.asarray(h).reshape(-1) for h in hosts]
    return np.unique(np.concatenate(flat or [np.empty(0)]).astype(np.int64))


def _on(arr: np.ndarray, device: torch.device) -> torch.Tensor:
    """A small host array on ``device``, queued on the current stream: ``non_blocking``, because a
    blocking copy to a GPU synchronizes the whole stream (torch waits for it after the copy)."""
    return torch.from_numpy(arr).to(device, non_blocking=True)


class Embedding(nn.Module):
    """An embedding layer whose rows live in kvps table ``key`` (created on first use).

    With a ``SyncClient`` a forward pass pulls the rows it lacks and ``prefetch``/``push`` block;
    with an asyncio ``Client`` they are coroutines and ``await emb.prefetch(ids, ...)`` must
    bring every id the next forward passes look up. Inside a ``PSModule`` the module's
    ``push()`` pushes the rows. ``dtype=torch.bfloat16`` keeps a float32 table (exact widening).
    ``clip_norm``, ``max_rows``, ``evict``, ``ttl_s``, ``admit``: as ``Client.create_table``
    (README, "Row lifecycle"); a row the server evicted reads as its initializer again."""

    def __init__(self, client: Client | SyncClient, key: str, dim: int, *, optimizer: Any = None,
                 init: Any = None, dtype: torch.dtype = torch.float32, merge: str = "sum",
                 clip_norm: float | None = None, max_rows: int | None = None, evict: str = "lru",
                 ttl_s: float | None = None, admit: Any = None) -> None:
        super().__init__()
        self._sync = client if isinstance(client, SyncClient) else None
        self._aclient: Client = client._client if isinstance(client, SyncClient) else client
        self.key, self.dim, self.dtype = key, int(dim), dtype
        self._table = {"dtype": table_dtype(str(dtype).removeprefix("torch.")), "optimizer": optimizer,
                       "init": init, "merge": merge, "clip_norm": clip_norm, "max_rows": max_rows,
                       "evict": evict, "ttl_s": ttl_s, "admit": admit}
        # Moves with .to(device): tells forward where the rows must go.
        self.register_buffer("_where", torch.empty(0, dtype=dtype), persistent=False)
        self._created = False
        self._held_ids = np.empty(0, np.int64)                       # (n,) sorted unique
        self._held_rows = np.empty((0, self.dim), self._table["dtype"])  # (n, dim)
        self._leaves: dict[torch.device, _Leaf] = {}   # for the held rows as they are now
        self._pending: list[_Leaf] = []                # leaves of forward passes since the push
        self._pinned = PinnedBuffer()

    def _run(self, coro: Coroutine) -> Any:
        return self._sync._run(coro) if self._sync is not None else coro

    # ---- public ---------------------------------------------------------------------------------

    def prefetch(self, *ids: Any) -> Any:
        """Pull the rows of every ``ids`` (tensors, arrays or lists) for the next forward passes
        (a coroutine with an asyncio ``Client``)."""
        if self._sync is None:
            return self._aprefetch(ids)
        hosts = [host_values(i, name="ids") for i in ids]  # GPU ids copied in the caller's thread
        return self._sync._run(self._hold(_unique(hosts)))

    async def _aprefetch(self, ids: tuple) -> None:
        await self._hold(_unique([await to_host(i, name="ids") for i in ids]))  # loop never waits

    def push(self) -> Any:
        """Push the row gradients of the forward passes since the last push; the highest row
        version (0 if nothing was looked up with grad)."""
        caller = current_streams([self._where.device])
        if self._sync is not None:
            return self._sync._run(self._apush(caller))
        return self._apush(caller)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.device.type == "cuda" and len(self._held_ids):
            return self._lookup_on_device(ids)
        if ids.device.type == "cuda" and self._sync is None:  # copying them here would block the loop
            raise InvalidRequest("with an asyncio Client, `await emb.prefetch(ids)` before forward",
                                 key=self.key)
        flat = np.asarray(host_values(ids.detach(), name="ids")).reshape(-1).astype(np.int64)
        missing = np.setdiff1d(flat, self._held_ids)
        if len(missing):
            if self._sync is None:
                raise InvalidRequest(f"{len(missing)} ids were not prefetched: with an asyncio Client, "
                                     "`await emb.prefetch(ids)` before forward", key=self.key)
            self._sync._run(self._hold(np.unique(missing)))
        leaf = self._leaf(self._where.device)
        pos = np.searchsorted(leaf.ids, flat)
        leaf.used[pos] = True
        return leaf.rows[_on(pos, leaf.rows.device)].view(*ids.shape, self.dim)

    # ---- rows held --------------------------------------------------------------------------

    async def _hold(self, ids: np.ndarray) -> None:
        new = np.setdiff1d(ids, self._held_ids)
        if len(new):
            self._adopt(new, await self._fetch(new))

    async def _fetch(self, ids: np.ndarray) -> np.ndarray:
        """(n, dim) rows of sorted unique ``ids`` from the table (created on first use)."""
        if not self._created:
            await self._aclient.create_table(self.key, self.dim, **self._table)
            self._created = True
        if not len(ids):
            return np.empty((0, self.dim), self._table["dtype"])
        return await self._aclient.pull_rows(self.key, ids)  # (n, dim)

    def _adopt(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Hold pulled ``rows`` of sorted unique ``ids`` (rows already held are kept)."""
        keep = ~np.isin(ids, self._held_ids)
        new, rows = ids[keep], rows[keep]
        if not len(new):
            return
        ids_all = np.concatenate([self._held_ids, new])
        order = np.argsort(ids_all, kind="stable")
        self._held_ids = ids_all[order]
        self._held_rows = np.concatenate([self._held_rows, rows])[order]
        self._leaves = {}  # the next forward makes a leaf of every held row

    def _leaf(self, device: torch.device) -> _Leaf:
        """The held rows on ``device`` as a leaf (one per step and device while grad is on)."""
        leaf = self._leaves.get(device) if torch.is_grad_enabled() else None
        if leaf is not None:
            return leaf
        leaf = _Leaf(self._held_ids, self._rows_on(device), np.zeros(len(self._held_ids), bool))
        if torch.is_grad_enabled():
            leaf.rows.requires_grad_(True)
            self._leaves[device] = leaf
            self._pending.append(leaf)
        return leaf

    def _rows_on(self, device: torch.device) -> torch.Tensor:
        """The held rows as a new ``dtype`` tensor on ``device`` (copied on the current stream
        from a reused pinned buffer)."""
        rows = self._held_rows
        if self.dtype == torch.bfloat16:
            host_bits = bf16_round(rows).view(np.int16)  # numpy has no bf16: its bit patterns
        else:
            host_bits = rows.astype(torch.empty(0, dtype=self.dtype).numpy().dtype, copy=False)
        if device.type == "cpu":
            out = torch.from_numpy(host_bits.copy())
            return out.view(self.dtype) if self.dtype == torch.bfloat16 else out
        buf = self._pinned.take(host_bits.nbytes, device)
        staged = buf[:host_bits.nbytes].view(torch.int16 if self.dtype == torch.bfloat16 else self.dtype)
        np.copyto(staged.numpy().reshape(host_bits.shape), host_bits)
        out = torch.empty(rows.shape, dtype=self.dtype, device=device)
        out.view(staged.dtype).copy_(staged.view(rows.shape), non_blocking=True)
        event = torch.cuda.Event(blocking=True)
        event.record(torch.cuda.current_stream(device))
        self._pinned.used_until(event, device)
        return out

    def _lookup_on_device(self, ids: torch.Tensor) -> torch.Tensor:
        """GPU ids against the held rows, without leaving the GPU."""
        leaf = self._leaf(ids.device)
        if leaf.ids_dev is None:
            leaf.ids_dev = _on(leaf.ids, ids.device)
            leaf.used_dev = torch.zeros(len(leaf.ids), dtype=torch.bool, device=ids.device)
            leaf.missing = torch.zeros((), dtype=torch.bool, device=ids.device)
        flat = ids.detach().reshape(-1).to(torch.int64)
        pos = torch.searchsorted(leaf.ids_dev, flat).clamp_(max=len(leaf.ids) - 1)
        leaf.missing |= (leaf.ids_dev[pos] != flat).any()
        leaf.used_dev.index_fill_(0, pos, True)
        return leaf.rows[pos].view(*ids.shape, self.dim)

    # ---- push -----------------------------------------------------------------------------------

    def _discard(self) -> list[_Leaf]:
        """Forget this step's rows (they go stale after a push; a skipped step drops them)."""
        pending, self._pending = self._pending, []
        self._leaves, self._held_ids = {}, np.empty(0, np.int64)
        self._held_rows = np.empty((0, self.dim), self._table["dtype"])
        return pending

    async def _apush(self, caller: dict) -> int:
        pending = self._discard()
        staged = [self._stage(leaf, caller) for leaf in pending if leaf.rows.grad is not None]
        if not staged:
            return 0
        parts = await asyncio.to_thread(lambda: [self._gather(*s) for s in staged])
        ids = np.concatenate([i for i, _ in parts])
        grads = np.concatenate([g for _, g in parts])  # (rows, dim)
        if not len(ids):
            return 0
        return await self._aclient.push_rows(self.key, ids, grads)

    def _stage(self, leaf: _Leaf, caller: dict) -> tuple:
        """Start the copies of a leaf's gradient (and GPU lookup marks) to the host."""
        grad = leaf.rows.grad.detach()
        if grad.device.type == "cpu":
            return leaf, (grad, None), None, None
        stream = caller.get(grad.device) or torch.cuda.current_stream(grad.device)
        with torch.cuda.stream(stream):  # after the backward pass that produced the gradient
            copies = [device_to_host(t) if t is not None else None
                      for t in (grad, leaf.used_dev, leaf.missing)]
        return leaf, *copies

    def _gather(self, leaf: _Leaf, grad: tuple, used_dev: tuple | None, missing: tuple | None) -> tuple:
        """(ids, grads) of the rows forward looked up (in a thread: waits for the copies)."""
        host = {}
        for name, copy in (("grad", grad), ("used", used_dev), ("missing", missing)):
            if copy is not None:
                tensor, event = copy
                if event is not None:
                    wait_event(event, leaf.rows.device)
                host[name] = tensor
        if "missing" in host and bool(host["missing"]):
            raise InvalidRequest(f"a forward pass looked up ids of {self.key!r} that were not "
                                 "prefetched; nothing was pushed", key=self.key)
        used = leaf.used | (host["used"].numpy() if "used" in host else False)
        grads = host_array(host["grad"])
        return leaf.ids[used], grads[used]
