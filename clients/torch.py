"""kvps_client.torch: train a PyTorch model on kvps in a few lines (the only module importing torch).

    import kvps_client as kc
    from kvps_client.torch import Embedding, PSModule, SyncPSModule

    async with kc.Client(endpoints) as ps:                   # an asyncio training loop
        pm = PSModule(model, ps, prefix="mlp/", optimizer=kc.SGD(lr=0.1), overlap=True)
        for x, y in batches:
            await pm.pull()                                  # parameters into the module, in place
            await pm.backward(F.cross_entropy(model(x), y))  # hooks push each gradient once ready
            await pm.push()                                  # wait for the pushes, clear the grads
        await pm.close()

    with kc.SyncClient(endpoints) as ps:                     # an ordinary training loop
        pm = SyncPSModule(model, ps, prefix="mlp/", optimizer=kc.SGD(lr=0.1), overlap=True)
        for x, y in batches:
            pm.pull(); F.cross_entropy(model(x), y).backward(); pm.push()

Each parameter is a dense key ``prefix + name``, created on first use with the module's current
value ("create if absent": the first worker's value wins, the others pull it). The optimizer runs
on the server. ``max_staleness`` picks the consistency mode (see ``kvps_client.StepClock``):
None = asynchronous, s = bounded staleness (SSP), 0 = synchronous (BSP).

CUDA: gradients leave the GPU through pinned host buffers with non-blocking copies; pulled values
enter it the same way (``pin_memory()`` + ``non_blocking=True``; torch's pinned allocator keeps a
buffer alive until its copy is done).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Coroutine
from typing import Any

import numpy as np
import torch
from torch import nn

from kvps.errors import InvalidRequest

from ._client import Client
from ._clock import StepClock
from ._sync import SyncClient

__all__ = ["Embedding", "PSModule", "SyncPSModule"]


def _to_host(t: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """A CPU copy of ``t`` and, for a CUDA tensor, the event that marks the end of its
    non-blocking copy into a pinned buffer (None on the CPU: the copy is done)."""
    t = t.detach()
    if t.device.type == "cpu":
        return t.clone(), None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(t.device))
    return host, event


async def _ready(event: Any) -> None:
    if event is not None:  # wait in a thread: the event loop keeps serving other pushes
        await asyncio.to_thread(event.synchronize)


def _staged(arr: np.ndarray, device: torch.device) -> torch.Tensor:
    """``arr`` as a CPU tensor to copy to ``device``: pinned when that is a GPU, so the copy can be
    non-blocking (a pageable source would be staged through a bounce buffer, synchronously)."""
    src = torch.from_numpy(np.ascontiguousarray(arr))
    return src if device.type == "cpu" else src.pin_memory()


def _to_device(arr: np.ndarray, device: torch.device) -> torch.Tensor:
    src = _staged(arr, device)
    return src if device.type == "cpu" else src.to(device, non_blocking=True)


def _merge_versions(results: list[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for versions in results:
        for key, v in versions.items():
            out[key] = max(v, out.get(key, v))
    return out


class PSModule:
    """Pull ``module``'s parameters from kvps and push its gradients (asyncio ``Client``).

    ``overlap=True`` registers a post-accumulate-grad hook per parameter that starts that
    parameter's push as soon as its gradient is ready, while the backward pass goes on (one
    backward per step); ``push()`` then waits for them. In asyncio, run the backward pass with
    ``await pm.backward(loss)`` (a worker thread), else the loop cannot send during it.
    Gradients of ``kvps_client.torch.Embedding`` layers inside the module are pushed too.
    """

    def __init__(self, module: nn.Module, client: Client, *, prefix: str = "", optimizer: Any = None,
                 merge: str = "sum", overlap: bool = False, max_staleness: int | None = None,
                 job: str | None = None, worker: str | None = None, workers: int | None = None,
                 lease_s: float = 10.0) -> None:
        self.module = module
        self.client = client
        self.optimizer = optimizer
        self.merge = merge
        self.params = {n: p for n, p in module.named_parameters() if p.requires_grad}
        self.keys = {n: prefix + n for n in self.params}
        self.embeddings = [m for m in module.modules() if isinstance(m, Embedding)]
        self.clock = None if max_staleness is None else StepClock(
            client, job or prefix or "kvps", worker or client.client_id, max_staleness=max_staleness,
            lease_s=lease_s, workers=workers)
        self.steps = 0  # pushes completed
        self._names = {id(p): n for n, p in self.params.items()}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._created = False
        self._inflight: list[tuple[str, concurrent.futures.Future]] = []
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad)
                       for p in self.params.values()] if overlap else []

    async def pull(self) -> None:
        """Wait for the consistency mode to allow the next step, then copy the current values
        into the module's parameters in place."""
        self._loop = asyncio.get_running_loop()
        await self._ensure_created()
        if self.clock is not None:
            await self.clock.wait()
        values = await self.client.pull(list(self.keys.values()))
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(_staged(values[self.keys[name]], p.device), non_blocking=True)

    async def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` in a worker thread, so the pushes the hooks start run meanwhile."""
        self._loop = asyncio.get_running_loop()
        await asyncio.to_thread(loss.backward)

    async def push(self, extra: dict[str, Any] | None = None) -> dict[str, int]:
        """Push this step's gradients (or wait for the pushes the hooks started), clear the
        module's grads, and advance this worker's clock. ``extra``: more ``{key: value}`` to push
        in the same call (a step counter, metrics). Returns ``{key: version}``."""
        self._loop = asyncio.get_running_loop()
        await self._ensure_created()
        inflight, self._inflight = self._inflight, []
        started = {name for name, _ in inflight}
        rest = {n: p.grad for n, p in self.params.items() if p.grad is not None and n not in started}
        calls: list[Any] = [asyncio.wrap_future(f) for _, f in inflight]
        if rest or extra:
            calls.append(self._push_grads(rest, extra or {}))
        calls += [self._push_rows(emb) for emb in self.embeddings]
        results = await asyncio.gather(*calls, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
        self.module.zero_grad(set_to_none=True)
        self.steps += 1
        if self.clock is not None:
            await self.clock.tick()
        return _merge_versions(results)

    async def close(self) -> None:
        """Remove the hooks and leave the job's clock (the others stop waiting for us)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self.clock is not None:
            await self.clock.leave()

    # ---- internals ---------------------------------------------------------------------------

    async def _ensure_created(self) -> None:
        if self._created:
            return
        await asyncio.gather(*(self.client.create(self.keys[n], p, optimizer=self.optimizer, merge=self.merge)
                               for n, p in self.params.items()))
        self._created = True
        if self.clock is not None:
            await self.clock.start()

    def _on_grad(self, param: torch.Tensor) -> None:
        # Runs inside backward (on autograd's device thread for CUDA, the caller's for CPU).
        if param.grad is None or self._loop is None:
            return  # push() sends what could not be started here
        name = self._names[id(param)]
        if any(n == name for n, _ in self._inflight):
            # The grad accumulates: a second push would send the first backward's part again.
            raise InvalidRequest("overlap=True pushes each gradient during backward: call push() "
                                 "after every backward pass", key=self.keys[name])
        host, event = _to_host(param.grad)
        coro = self._push_one(name, host, event)
        self._inflight.append((name, asyncio.run_coroutine_threadsafe(coro, self._loop)))

    async def _push_one(self, name: str, host: torch.Tensor, event: Any) -> dict[str, int]:
        await _ready(event)
        return await self.client.push({self.keys[name]: host})

    async def _push_grads(self, grads: dict[str, torch.Tensor], extra: dict[str, Any]) -> dict[str, int]:
        hosts = {self.keys[n]: _to_host(g) for n, g in grads.items()}  # all copies queued first
        for _, event in hosts.values():
            await _ready(event)
        return await self.client.push({**{k: h for k, (h, _) in hosts.items()}, **extra})

    async def _push_rows(self, emb: "Embedding") -> dict[str, int]:
        version = await emb._apush()
        return {emb.key: version} if version else {}


class SyncPSModule:
    """``PSModule`` for ordinary (blocking) loops on a ``SyncClient``. The hooks start pushes on
    the client's event-loop thread, so ``overlap=True`` overlaps a plain ``loss.backward()``."""

    def __init__(self, module: nn.Module, client: SyncClient, **kwargs: Any) -> None:
        self._sync = client
        self.inner = PSModule(module, client._client, **kwargs)
        self.inner._loop = client._loop

    module = property(lambda self: self.inner.module)
    keys = property(lambda self: self.inner.keys)
    clock = property(lambda self: self.inner.clock)
    steps = property(lambda self: self.inner.steps)

    def pull(self) -> None:
        self._sync._run(self.inner.pull())

    def push(self, extra: dict[str, Any] | None = None) -> dict[str, int]:
        return self._sync._run(self.inner.push(extra))

    def close(self) -> None:
        self._sync._run(self.inner.close())


class Embedding(nn.Module):
    """An embedding layer whose rows live in kvps table ``key`` (created on first use).

    Forward pulls the batch's unique ids, builds a leaf tensor ``(unique, dim)`` that requires
    grad, and indexes it; ``push()`` after backward sends the row gradients (duplicates summed
    by the client). With a ``SyncClient`` forward pulls by itself and ``prefetch``/``push`` block;
    with an asyncio ``Client`` they are coroutines and ``await emb.prefetch(ids)`` must precede
    the forward pass. Inside a ``PSModule`` the module's ``push()`` pushes the rows.
    """

    def __init__(self, client: Client | SyncClient, key: str, dim: int, *, optimizer: Any = None,
                 init: Any = None, dtype: torch.dtype = torch.float32, merge: str = "sum") -> None:
        super().__init__()
        self._sync = client if isinstance(client, SyncClient) else None
        self._aclient: Client = client._client if isinstance(client, SyncClient) else client
        self.key, self.dim, self.dtype = key, int(dim), dtype
        self._table = {"dtype": str(dtype).removeprefix("torch."), "optimizer": optimizer,
                       "init": init, "merge": merge}
        # Moves with .to(device): tells forward where the rows must go.
        self.register_buffer("_where", torch.empty(0, dtype=dtype), persistent=False)
        self._created = False
        self._prefetched: tuple[np.ndarray, np.ndarray] | None = None  # (unique ids, rows)
        self._pending: list[tuple[np.ndarray, torch.Tensor]] = []  # (unique ids, leaf rows)

    def _run(self, coro: Coroutine) -> Any:
        return self._sync._run(coro) if self._sync is not None else coro

    def prefetch(self, ids: Any) -> Any:
        """Pull the rows of ``ids`` for the next forward pass."""
        return self._run(self._aprefetch(ids))

    def push(self) -> Any:
        """Push the row gradients of every forward pass since the last push; the highest row version."""
        return self._run(self._apush())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.detach().reshape(-1).cpu().numpy().astype(np.int64)
        unique, inverse = np.unique(flat, return_inverse=True)
        rows = self._take_prefetched(unique)
        if rows is None:
            if self._sync is None:
                raise InvalidRequest("with an asyncio Client, `await emb.prefetch(ids)` before forward",
                                     key=self.key)
            rows = self._sync._run(self._pull(unique))
        leaf = _to_device(rows, self._where.device)  # (unique, dim)
        if torch.is_grad_enabled():
            leaf.requires_grad_(True)
            self._pending.append((unique, leaf))
        index = torch.from_numpy(inverse.reshape(-1)).to(leaf.device)
        return leaf[index].view(*ids.shape, self.dim)

    def _take_prefetched(self, unique: np.ndarray) -> np.ndarray | None:
        if self._prefetched is None:
            return None
        have, rows = self._prefetched
        self._prefetched = None  # rows go stale: one prefetch serves one forward
        pos = np.minimum(np.searchsorted(have, unique), max(len(have) - 1, 0))
        if len(have) == 0 or not np.array_equal(have[pos], unique):
            return None
        return rows[pos]

    async def _aprefetch(self, ids: Any) -> None:
        flat = np.asarray(ids.detach().cpu().numpy() if isinstance(ids, torch.Tensor) else ids)
        unique = np.unique(flat.astype(np.int64).reshape(-1))
        self._prefetched = (unique, await self._pull(unique))

    async def _pull(self, unique: np.ndarray) -> np.ndarray:
        if not self._created:
            await self._aclient.create_table(self.key, self.dim, **self._table)
            self._created = True
        return await self._aclient.pull_rows(self.key, unique)

    async def _apush(self) -> int:
        pending, self._pending = self._pending, []
        done = [(ids, leaf.grad) for ids, leaf in pending if leaf.grad is not None]
        if not done:
            return 0
        host, event = _to_host(torch.cat([g for _, g in done]))  # (rows, dim)
        await _ready(event)
        return await self._aclient.push_rows(self.key, np.concatenate([i for i, _ in done]), host)
