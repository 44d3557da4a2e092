"""B1, the parameter-server workload: every worker pulls the whole model and pushes a gradient.

The model is ``tensors`` dense float32 tensors of ``tensor_bytes`` each (64 × 1 MiB by default).
One *step* = pull every tensor + push one gradient per tensor; there is no compute in between, so
the figure is the communication ceiling of each system. Steps/s are summed over the workers.
A kvps worker pulls into its parameter arrays (``pull(..., out=)``), a Redis worker views the
bytes it got (``np.frombuffer``), an RPC worker keeps the tensors it was sent.

This module holds the kvps worker and the single-process in-memory baseline; the peers live in
``redis_peer`` and ``rpc_peer`` and follow the same shape (a module-level ``*_worker(rank, ...)``
that sets up and returns ``run(window) -> StepWindow``).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvps.bench.harness import StepWindow, Window, steps_in_window, worker_loop

__all__ = ["LR", "Model", "create_model", "inmem_baseline", "kvps_worker", "read_model", "updates_lost"]

LR = 1e-4  # every system applies value -= LR * grad (kvps: SGD on the leader)


@dataclass(frozen=True)
class Model:
    tensors: int = 64
    tensor_bytes: int = 1 << 20
    prefix: str = "b1"  # of the keys' names (a second kvps row in the same cluster takes another)

    @property
    def numel(self) -> int:
        return self.tensor_bytes // 4

    @property
    def nbytes(self) -> int:
        return self.tensors * self.tensor_bytes

    def names(self, prefix: str | None = None) -> list[str]:
        return [f"{prefix or self.prefix}/p{i:03d}" for i in range(self.tensors)]

    def values(self, seed: int = 0) -> list[np.ndarray]:
        rng = np.random.default_rng(seed)
        return [rng.standard_normal(self.numel, dtype=np.float32) for _ in range(self.tensors)]

    def grads(self, rank: int) -> list[np.ndarray]:
        # One fixed gradient per tensor and worker: generating fresh noise every step would
        # measure numpy's random generator, not the systems.
        rng = np.random.default_rng(1000 + rank)
        return [rng.standard_normal(self.numel, dtype=np.float32) for _ in range(self.tensors)]


# ---- kvps ---------------------------------------------------------------------------------------

def kvps_worker(rank: int, endpoints: list[str], token: str, model: Model,
                client_options: dict) -> Callable[[Window], StepWindow]:
    import kvps_client as kc

    names = model.names()
    grads = dict(zip(names, model.grads(rank)))
    loop = asyncio.new_event_loop()
    client = kc.Client(endpoints, token=token, seed=rank, timeout=60, **client_options)
    loop.run_until_complete(client.open())
    params = loop.run_until_complete(client.pull(names))  # layouts and a first full copy

    async def step() -> None:
        await client.pull(names, out=params)  # into the worker's parameters, as a training loop does
        await client.push(grads)

    def run(window: Window) -> StepWindow:
        out = StepWindow()
        sent0, recv0 = client.stats.bytes_sent, client.stats.bytes_received
        mirror0 = (client.shared.blocks_read, client.shared.fallbacks)
        wire = client.sender.wire
        ring0 = (wire.ring_requests, wire.ring_bytes_sent) if wire is not None else (0, 0)
        retries0: list[int] = []  # the client's retries when the first step in the window began

        def counted_step() -> None:
            if not retries0 and time.monotonic() >= window.start:
                retries0.append(client.stats.retries)
            loop.run_until_complete(step())

        try:
            worker_loop(counted_step, window, out)
        finally:
            ring = (wire.ring_requests - ring0[0], wire.ring_bytes_sent - ring0[1]) if wire is not None else (0, 0)
            out.counters.update(wire_bytes=client.stats.bytes_sent - sent0 + client.stats.bytes_received - recv0
                                - ring[1],
                                ring_requests=ring[0], ring_bytes=ring[1],
                                retries=client.stats.retries - (retries0 or [client.stats.retries])[0],
                                mirror_blocks=client.shared.blocks_read - mirror0[0],
                                mirror_fallbacks=client.shared.fallbacks - mirror0[1],
                                **{f"mirror_fallback_{k}": v for k, v in client.shared.reasons.items()})
            loop.run_until_complete(client.aclose())
            loop.close()
        return out

    return run


def create_model(endpoints: list[str], token: str, model: Model) -> None:
    """Create the B1 keys (SGD, lr=LR) on a kvps cluster."""
    import kvps_client as kc

    async def main() -> None:
        async with kc.Client(endpoints, token=token, seed=0, timeout=60) as ps:
            await asyncio.gather(*(ps.create(name, value, optimizer=kc.SGD(lr=LR))
                                   for name, value in zip(model.names(), model.values())))
    asyncio.run(main())


def read_model(endpoints: list[str], token: str, model: Model) -> list[np.ndarray]:
    """The B1 keys' values now, in ``model.names()`` order."""
    import kvps_client as kc

    async def main() -> dict[str, np.ndarray]:
        async with kc.Client(endpoints, token=token, seed=0, timeout=60) as ps:
            return await ps.pull(model.names())
    values = asyncio.run(main())
    return [values[name] for name in model.names()]


def updates_lost(model: Model, final: list[np.ndarray], pushes: list[int]) -> dict[str, int]:
    """How many of the workers' pushes are missing from ``final``.

    Worker ``w`` pushes the same gradient ``g_w`` of every tensor at each of its ``pushes[w]``
    steps, and every system applies ``value -= LR * g``, so a tensor's final value is
    ``initial - LR * sum_w n_w * g_w`` for the number ``n_w`` of worker ``w``'s pushes that took
    effect. The gradients are independent random vectors of 262,144 elements: least squares
    recovers each ``n_w`` to well within 0.5 despite float32 rounding. A last-writer-wins store
    loses the updates that a concurrent writer's SET overwrote; kvps must lose none."""
    initial = model.values()
    grads = [model.grads(rank) for rank in range(len(pushes))]
    effective = 0
    for t, (start, end) in enumerate(zip(initial, final)):
        a = np.stack([-LR * g[t].astype(np.float64) for g in grads], axis=1)   # (numel, workers)
        b = end.astype(np.float64) - start.astype(np.float64)                 # (numel,)
        n, *_ = np.linalg.lstsq(a, b, rcond=None)
        effective += int(np.rint(n).sum())
    pushed = sum(pushes) * len(initial)
    return {"updates_pushed": pushed, "updates_lost": pushed - effective}


# ---- in-memory baseline -------------------------------------------------------------------------

def inmem_baseline(model: Model, workers: int, warmup: float, seconds: float) -> dict[str, float]:
    """One process, one thread: the workers' steps done back to back on a dict of arrays.

    A pull copies every tensor out (what a worker gets is its own copy), a push applies
    ``value -= LR * grad`` in place. No network, no replication, no concurrency: the ceiling.
    """
    params = dict(zip(model.names(), model.values()))
    grads = [dict(zip(model.names(), model.grads(rank))) for rank in range(workers)]
    lr = np.float32(LR)
    scratch = np.empty(model.numel, np.float32)

    def step(rank: int) -> None:
        copies = {name: value.copy() for name, value in params.items()}  # pull
        for name, value in params.items():  # push
            np.multiply(grads[rank][name], lr, out=scratch)
            value -= scratch
        del copies

    steps: list[tuple[float, float]] = []
    t_go = time.monotonic()
    start, end = t_go + warmup, t_go + warmup + seconds
    rank = 0
    while True:
        t0 = time.monotonic()
        step(rank)
        t1 = time.monotonic()
        steps.append((t0, t1))
        rank = (rank + 1) % workers
        if t1 >= end:
            break
    n = steps_in_window(steps, start, end)
    lat = sorted(e - s for s, e in steps if s >= start)
    return {"steps_per_s": n / seconds, "bytes_per_s": n * 2 * model.nbytes / seconds,
            "steps_in_window": n, "window_s": seconds,
            "step_ms_p50": 1000 * lat[len(lat) // 2] if lat else float("nan"),
            "step_ms_max": 1000 * lat[-1] if lat else float("nan")}
