"""``PSModule``: pull a module's parameters from kvps and push its gradients (asyncio ``Client``).

Each trainable parameter is a key ``prefix + name``: a dense key, or a table for the weight of an
``nn.Embedding`` / ``nn.EmbeddingBag`` with ``sparse=True`` (only touched rows are pushed; see
``_torch_sparse``). Values cross between host and device through ``_torch_copy.Copier`` (copy
streams ordered after the caller's current stream, blocking events, one pinned pool, one worker
thread), so the event loop never copies or waits on a GPU. ``optimizer`` is a ``PSOptimizer``
(schedulers, ``GradScaler``); ``scaler=`` makes ``push`` skip an overflowing step the way
``GradScaler.step`` skips it; ``clip_norm=`` clips each key's gradient by its own norm.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from typing import Any

import numpy as np
import torch
from torch import nn

from kvps.errors import InvalidRequest
from kvps.optimizer import Add
from kvps.placement import DenseLayout

from ._client import Client
from ._clock import StepClock
from ._lossy import bf16_round
from ._torch_copy import Copier, Staged, current_streams, host_array
from ._torch_embedding import Embedding
from ._torch_env import TorchrunEnv
from ._torch_optim import PSOptimizer, clip_by_norm
from ._torch_sparse import ensure_table, sparse_weights

__all__ = ["PSModule", "caller_streams"]

_ALIGN = 64


def caller_streams(caller: dict[torch.device, Any]) -> contextlib.ExitStack:
    """Make ``caller``'s streams current in this thread (one per device), for work done on the
    caller's behalf in another thread."""
    stack = contextlib.ExitStack()
    for stream in caller.values():
        stack.enter_context(torch.cuda.stream(stream))
    return stack


def _staging_bytes(p: torch.Tensor, sparse: bool) -> int:
    """Pinned bytes for one parameter: its value (and a sparse gradient's values), plus the row
    ids of a sparse gradient after them."""
    values = p.numel() * p.element_size()
    return (-(-values // _ALIGN) * _ALIGN + p.shape[0] * 8) if sparse else values


def _write_blocks(dst: torch.Tensor, layout: DenseLayout, blocks: list[np.ndarray]) -> None:
    """Pulled blocks into CPU tensor ``dst`` (the parameter, or its pinned staging region)."""
    if dst.dtype == torch.bfloat16:  # the key is float32: round as torch does (nearest even)
        view, conv = dst.view(torch.int16).numpy(), (lambda b: bf16_round(b).view(np.int16))
    else:
        view, conv = dst.numpy(), (lambda b: b)
    if view.ndim == 0:
        np.copyto(view, conv(np.asarray(blocks[0])).reshape(()))
        return
    for b, block in enumerate(blocks):
        np.copyto(view[layout.block_slice(b)], conv(block))


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
                 lease_s: float = 10.0, scaler: Any = None,
                 clip_norm: float | dict[str, float] | None = None) -> None:
        self.module, self.client, self.merge = module, client, merge
        self.scaler, self.clip_norm = scaler, clip_norm
        self.params = {n: p for n, p in module.named_parameters() if p.requires_grad}
        self.tables = {n for n in sparse_weights(module) if n in self.params}
        self.keys = {n: prefix + n for n in self.params}
        self.embeddings = [m for m in module.modules() if isinstance(m, Embedding)]
        spec = optimizer or Add()
        self._optimizer: PSOptimizer | None = None
        self.clock = None if max_staleness is None else StepClock(
            client, job or prefix or "kvps", worker or client.client_id, max_staleness=max_staleness,
            lease_s=lease_s, workers=workers)
        self.steps = 0  # pushes completed: the step that stamps schedule changes
        self._spec = spec
        self._names = {id(p): n for n, p in self.params.items()}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._copier: Copier | None = None
        self._created = False  # keys created, clock started
        self._hyper: asyncio.Task | None = None  # this step's schedule update, sent once
        self._inflight: list[tuple[str, concurrent.futures.Future]] = []
        self._owned_client = False  # from_env: close() closes the client too
        if scaler is not None:
            self.optimizer  # noqa: B018 - GradScaler.step needs it at every push
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad)
                       for p in self.params.values()] if overlap else []

    @classmethod
    async def from_env(cls, module: nn.Module, endpoints: Any = None, *, token: str | None = None,
                       client_options: dict[str, Any] | None = None,
                       environ: dict[str, str] | None = None, **options: Any) -> "PSModule":
        """In a worker started by torchrun: move ``module`` to ``cuda:LOCAL_RANK`` (when there is
        a GPU), open a client this module owns (``close()`` closes it), and join job
        ``torchrun-<TORCHELASTIC_RUN_ID>`` as worker ``rank-<RANK>`` of ``WORLD_SIZE`` (what
        ``max_staleness`` counts). Other options as for the constructor."""
        env = TorchrunEnv.read(environ)
        env.place(module)
        client = Client(endpoints, token, **(client_options or {}))
        await client.open()
        try:
            pm = cls(module, client, **env.module_options(options))
        except BaseException:
            await client.aclose()
            raise
        pm._owned_client = True
        return pm

    @property
    def optimizer(self) -> PSOptimizer | None:
        """The ``torch.optim.Optimizer`` for schedulers and GradScaler (None without parameters).
        Made on first use: torch's optimizers import torch._dynamo, seconds that a loop without
        a scheduler or scaler need not pay."""
        if self._optimizer is None and self.params:
            self._optimizer = PSOptimizer(list(self.params.values()), self._spec,
                                          {id(p): self.keys[n] for n, p in self.params.items()})
        return self._optimizer

    def devices(self) -> set[torch.device]:
        return {p.device for p in self.params.values()} | {e._where.device for e in self.embeddings}

    # ---- the training step ------------------------------------------------------------------------

    async def pull(self) -> None:
        """Wait for the consistency mode to allow the next step, then copy the current values
        into the module's parameters in place (visible to the caller's current CUDA stream)."""
        await self._pull(current_streams(self.devices()))

    async def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` in a worker thread (on the caller's current CUDA stream), so the
        pushes the hooks start run meanwhile."""
        self._loop = asyncio.get_running_loop()
        caller = current_streams(self.devices())

        def run() -> None:
            with caller_streams(caller):
                loss.backward()
        await asyncio.to_thread(run)

    async def push(self, extra: dict[str, Any] | None = None) -> dict[str, int]:
        """Push this step's gradients (or wait for the pushes the hooks started), clear the
        module's grads, and advance this worker's clock. With ``scaler``, a step whose gradients
        overflowed pushes nothing and the scale backs off (``GradScaler.step`` + ``update``).
        ``extra``: more ``{key: value}`` to push in the same call. Returns ``{key: version}``."""
        return await self._push(extra, current_streams(self.devices()))

    async def close(self) -> None:
        """Remove the hooks, leave the job's clock (the others stop waiting for us), release the
        pinned pool (and the client, if ``from_env`` opened it)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self.clock is not None:
            await self.clock.leave()
        if self._copier is not None:
            await asyncio.to_thread(self._copier.close)
            self._copier, self._created = None, False
        if self._owned_client:
            await self.client.aclose()

    # ---- internals: pull -----------------------------------------------------------------------

    async def _pull(self, caller: dict) -> None:
        self._loop = asyncio.get_running_loop()
        await self._ensure_created(caller)
        if self.clock is not None:
            await self.clock.wait()
        dense = [n for n in self.params if n not in self.tables]
        blocks = await self.client.pull_blocks([self.keys[n] for n in dense]) if dense else {}
        rows = await asyncio.gather(*(self.client.pull_rows(self.keys[n], np.arange(self.params[n].shape[0]))
                                      for n in sorted(self.tables)))
        fills = {n: (lambda dst, lb=blocks[self.keys[n]]: _write_blocks(dst, *lb)) for n in dense}
        for n, r in zip(sorted(self.tables), rows):
            layout = DenseLayout(r.shape, r.dtype.name, r.shape[0])  # the table as one block
            fills[n] = lambda dst, lb=(layout, [r]): _write_blocks(dst, *lb)
        items = [(n, p, fills[n]) for n, p in self.params.items()]
        await self._copier.run(self._copier.install, items, caller)

    async def _ensure_created(self, caller: dict) -> None:
        if self._copier is not None and self._copier.devices != self.devices():
            raise InvalidRequest(f"the module moved from {sorted(map(str, self._copier.devices))} to "
                                 f"{sorted(map(str, self.devices()))} after its first pull or push: "
                                 "wrap it once it is on its device")
        if self._created:
            return
        if self._copier is None:  # pinning a model's worth of memory takes a while: not on the loop
            sizes = {n: _staging_bytes(p, n in self.tables) for n, p in self.params.items()
                     if p.device.type == "cuda"}
            self._copier = await asyncio.to_thread(Copier, sizes, self.devices())
        hosts = await self._copier.run(self._initial_values, caller)
        await asyncio.gather(*(
            ensure_table(self.client, self.keys[n], hosts[n], optimizer=self._spec, merge=self.merge,
                         timeout=self.client.timeout) if n in self.tables else
            self.client.create(self.keys[n], hosts[n], optimizer=self._spec, merge=self.merge)
            for n in self.params))
        if self.clock is not None:
            await self.clock.start()
        self._created = True

    def _initial_values(self, caller: dict) -> dict[str, np.ndarray]:
        """Worker thread: every parameter's current value on the host (bf16 widened)."""
        staged = {n: self._copier.to_host(n, p.detach(), caller.get(p.device))
                  for n, p in self.params.items()}
        return {n: np.array(host_array(s.wait())) for n, s in staged.items()}  # copies: the pool is reused

    # ---- internals: push ---------------------------------------------------------------------

    async def _push(self, extra: dict[str, Any] | None, caller: dict) -> dict[str, int]:
        self._loop = asyncio.get_running_loop()
        await self._ensure_created(caller)
        inflight, self._inflight = self._inflight, []
        started = {name for name, _ in inflight}
        rest = [n for n, p in self.params.items() if p.grad is not None and n not in started]
        try:
            approved = await self._copier.run(self._approve, caller)
            calls: list[Any] = [asyncio.wrap_future(f) for _, f in inflight]
            if approved and (rest or extra):
                calls.append(self._push_grads(rest, extra or {}, caller))
            calls += [self._push_embedding(emb, caller, approved) for emb in self.embeddings]
            results = await asyncio.gather(*calls, return_exceptions=True)
        finally:
            self._hyper = None
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
        self.module.zero_grad(set_to_none=True)
        self.steps += 1
        if self.clock is not None:
            await self.clock.tick()  # a skipped step is a step: the others must not wait for it
        return _merge_versions([r for r in results if isinstance(r, dict)])

    @staticmethod
    async def _push_embedding(emb: Embedding, caller: dict, approved: bool) -> dict[str, int]:
        if not approved:
            emb._discard()
            return {}
        version = await emb._apush(caller)
        return {emb.key: version} if version else {}

    def _approve(self, caller: dict) -> bool:
        """Worker thread, on the caller's streams: ``GradScaler.step`` (unscale in place, check
        for inf/NaN, call ``optimizer.step()`` only if finite) and ``update``; without a scaler,
        ``optimizer.step()`` (it only approves: the update runs on the server). The kvps
        Embedding rows of this step join the scaler's check as a temporary parameter group."""
        opt = self._optimizer  # not made here: without one, nothing watches the step
        if opt is None:
            return True
        opt.approved = False
        leaves = [leaf.rows for emb in self.embeddings for leaf in emb._pending if leaf.rows.grad is not None]
        with caller_streams(caller):
            if self.scaler is None:
                opt.step()
                return True
            if not leaves and all(p.grad is None for p in self.params.values()):
                return True  # nothing to check: GradScaler.update would find no inf check
            if leaves:
                opt.param_groups.append({"params": leaves, **opt.defaults})
            try:
                self.scaler.step(opt)
                self.scaler.update()
            finally:
                if leaves:
                    opt.param_groups.pop()
        return opt.approved

    def _max_norm(self, name: str) -> float | None:
        if isinstance(self.clip_norm, dict):
            return self.clip_norm.get(name)
        return self.clip_norm

    def _stage(self, name: str, grad: torch.Tensor, producer: Any) -> tuple[Staged, ...]:
        """Clip (on ``producer``, the stream the gradient is ready on) and start the copy of one
        gradient to the host: ``(values,)`` dense, ``(values, row ids)`` sparse."""
        g = grad.detach()
        max_norm = self._max_norm(name)
        if max_norm is not None:
            g = clip_by_norm(g, max_norm)
        if g.is_sparse:
            g = g.coalesce()  # at most one entry per row: fits the staging region
            values, ids = g.values(), g.indices()[0]
            param = self.params[name]
            offset = -(-param.numel() * param.element_size() // _ALIGN) * _ALIGN  # see _staging_bytes
            return (self._copier.to_host(name, values, producer),
                    self._copier.to_host(name, ids, producer, offset))
        return (self._copier.to_host(name, g, producer),)

    @staticmethod
    def _to_arrays(staged: tuple[Staged, ...]) -> tuple[np.ndarray, ...]:
        """Worker thread: wait for the copies; numpy arrays (views of the pool or the grad)."""
        return tuple(host_array(s.wait()) for s in staged)

    def _stage_all(self, names: list[str], caller: dict) -> dict[str, tuple[np.ndarray, ...]]:
        with caller_streams(caller):
            staged = {n: self._stage(n, self.params[n].grad, caller.get(self.params[n].device))
                      for n in names}
        return {n: self._to_arrays(s) for n, s in staged.items()}

    async def _push_grads(self, names: list[str], extra: dict[str, Any], caller: dict) -> dict[str, int]:
        await self._schedule()
        hosts = await self._copier.run(self._stage_all, names, caller)
        return await self._send(hosts, extra)

    async def _send(self, hosts: dict[str, tuple[np.ndarray, ...]], extra: dict[str, Any]) -> dict[str, int]:
        dense = {self.keys[n]: h[0] for n, h in hosts.items() if n not in self.tables}
        calls = [self.client.push({**dense, **extra})] if dense or extra else []
        calls += [self._push_rows(self.keys[n], *hosts[n]) for n in hosts if n in self.tables]
        return _merge_versions(list(await asyncio.gather(*calls)))

    async def _push_rows(self, key: str, values: np.ndarray, ids: np.ndarray) -> dict[str, int]:
        return {key: await self.client.push_rows(key, ids, values)} if len(ids) else {}

    async def _schedule(self) -> None:
        """Send this step's schedule changes (once per step, before any of its gradients)."""
        if self._hyper is None:
            self._hyper = asyncio.ensure_future(self._send_schedule())
        await self._hyper

    async def _send_schedule(self) -> None:
        opt = self._optimizer
        changes = opt.changes() if opt is not None else []
        await asyncio.gather(*(self.client.set_hyperparams(key, values, step=self.steps)
                               for keys, values in changes for key in keys))
        if changes:
            opt.mark_sent()

    # ---- internals: overlap hooks ---------------------------------------------------------------

    def _on_grad(self, param: torch.Tensor) -> None:
        # Runs inside backward: on autograd's device thread for CUDA (whose current stream is
        # the one the gradient was accumulated on), the caller's thread for CPU.
        if param.grad is None or self._loop is None or not self._created or self.scaler is not None:
            return  # push() sends it (with a scaler it must first see every gradient)
        name = self._names[id(param)]
        if any(n == name for n, _ in self._inflight):
            # The grad accumulates: a second push would send the first backward's part again.
            raise InvalidRequest("overlap=True pushes each gradient during backward: call push() "
                                 "after every backward pass", key=self.keys[name])
        producer = torch.cuda.current_stream(param.device) if param.device.type == "cuda" else None
        staged = self._stage(name, param.grad, producer)
        coro = self._push_staged(name, staged)
        self._inflight.append((name, asyncio.run_coroutine_threadsafe(coro, self._loop)))

    async def _push_staged(self, name: str, staged: tuple[Staged, ...]) -> dict[str, int]:
        await self._schedule()
        arrays = await self._copier.run(self._to_arrays, staged)
        return await self._send({name: arrays}, {})
