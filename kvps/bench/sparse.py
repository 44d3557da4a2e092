"""B6, a recommendation-style sparse workload: workers pull and push embedding rows whose ids follow
a Zipf distribution (a few hot items, a long tail), as a CTR model's embedding lookups do.

Each worker cycles through the same seeded batches on every system: ``lookups`` ids drawn from a
bounded Zipf(``zipf_s``) over ``rows`` ids (shuffled by a fixed permutation, so hot ids land on
every shard), deduplicated; a step pulls those rows and pushes one gradient row each
(``value -= LR * grad``). Rows/s counts the rows a step pulls (each is pushed too), summed over
workers:

* kvps: ``pull_rows`` + ``push_rows`` on a table (SGD on the shard leaders, 3 replicas);
* Redis: the rows are fields of one hash: a pipelined ``HMGET`` of the batch, then ``HSET`` of the
  new values (computed by the worker: last-writer-wins, as in B1) and ``WAIT 2``;
* PyTorch RPC: one unreplicated server holding the table as a tensor: ``get_rows(ids)`` and
  ``push_rows(ids, grads)`` (``index_add_``) under one lock.
"""
from __future__ import annotations

import asyncio
import functools
import multiprocessing as mp
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvps.bench.harness import StepWindow, Window, worker_loop
from kvps.bench.workload import LR

__all__ = ["SparseWork", "create_table", "get_rows", "kvps_sparse_worker", "load_redis_rows", "push_rows",
           "redis_sparse_worker", "rpc_sparse_worker", "start_rpc_table"]

KEY = "b6/emb"


@dataclass(frozen=True)
class SparseWork:
    rows: int = 1_000_000    # ids in the table (only those drawn are ever stored by kvps)
    dim: int = 32            # float32 columns per row
    lookups: int = 4096      # ids drawn per step, before deduplication
    zipf_s: float = 1.05     # Zipf exponent: p(k-th most popular id) ∝ k^-s
    batches: int = 16        # distinct batches each worker cycles through
    seed: int = 6

    def batches_for(self, rank: int) -> list[np.ndarray]:
        """Worker ``rank``'s batches: sorted unique int64 ids, the same on every system."""
        return _batches(self, rank)

    def _draw(self, rank: int) -> list[np.ndarray]:
        weights = 1.0 / np.arange(1, self.rows + 1, dtype=np.float64) ** self.zipf_s
        cdf = np.cumsum(weights / weights.sum())
        perm = np.random.default_rng(self.seed).permutation(self.rows).astype(np.int64)
        rng = np.random.default_rng(self.seed * 1000 + rank + 1)
        ranks = [np.minimum(np.searchsorted(cdf, rng.random(self.lookups)), self.rows - 1)
                 for _ in range(self.batches)]
        return [np.unique(perm[r]) for r in ranks]

    def mean_rows(self, workers: int) -> float:
        """Rows per step, averaged over the batches of every worker."""
        sizes = [len(b) for rank in range(workers) for b in self.batches_for(rank)]
        return float(np.mean(sizes))

    def grad(self, rank: int) -> np.ndarray:
        """(lookups, dim) float32: one fixed gradient, sliced per batch (B1 says why fixed)."""
        return np.random.default_rng(2000 + rank).standard_normal((self.lookups, self.dim), dtype=np.float32)

    def init_rows(self, ids: np.ndarray) -> np.ndarray:
        return np.full((len(ids), self.dim), 0.01, np.float32)  # (n, dim)


@functools.lru_cache(maxsize=64)
def _batches(work: SparseWork, rank: int) -> list[np.ndarray]:
    return work._draw(rank)  # the CDF over a million ids takes a while: once per (work, rank)


def _cycle(work: SparseWork, rank: int) -> Callable[[], np.ndarray]:
    batches, at = work.batches_for(rank), [0]

    def next_batch() -> np.ndarray:
        at[0] += 1
        return batches[at[0] % len(batches)]
    return next_batch


def _run(step: Callable[[], None], window: Window, close: Callable[[], None]) -> StepWindow:
    out = StepWindow()
    try:
        worker_loop(step, window, out)
    finally:
        close()
    return out


# ---- kvps ---------------------------------------------------------------------------------------

def create_table(endpoints: list[str], token: str, work: SparseWork) -> None:
    import kvps_client as kc

    async def main() -> None:
        async with kc.Client(endpoints, token=token, seed=0, timeout=60) as ps:
            await ps.create_table(KEY, work.dim, optimizer=kc.SGD(lr=LR), init=kc.Constant(0.01))
    asyncio.run(main())


def kvps_sparse_worker(rank: int, endpoints: list[str], token: str,
                       work: SparseWork) -> Callable[[Window], StepWindow]:
    import kvps_client as kc

    batch, grad = _cycle(work, rank), work.grad(rank)
    loop = asyncio.new_event_loop()
    client = kc.Client(endpoints, token=token, seed=rank, timeout=60)
    loop.run_until_complete(client.open())
    loop.run_until_complete(client.pull_rows(KEY, batch()))  # layouts, connections

    async def step() -> None:
        ids = batch()
        await client.pull_rows(KEY, ids)
        await client.push_rows(KEY, ids, grad[:len(ids)])

    def close() -> None:
        loop.run_until_complete(client.aclose())
        loop.close()
    return lambda window: _run(lambda: loop.run_until_complete(step()), window, close)


# ---- Redis --------------------------------------------------------------------------------------

def load_redis_rows(port: int, replicas: int, work: SparseWork, workers: int) -> None:
    """Every id any worker draws, at its initial value (Redis has no lazy initializer)."""
    import redis

    from kvps.bench.redis_peer import WAIT_TIMEOUT_MS

    ids = np.unique(np.concatenate([b for rank in range(workers) for b in work.batches_for(rank)]))
    rows = work.init_rows(ids)
    r = redis.Redis(port=port)
    pipe = r.pipeline(transaction=False)
    for start in range(0, len(ids), 4096):
        chunk = ids[start:start + 4096]
        pipe.hset(KEY, mapping={int(i): row.tobytes() for i, row in zip(chunk, rows[start:start + 4096])})
    pipe.execute_command("WAIT", replicas, WAIT_TIMEOUT_MS)
    pipe.execute()
    r.close()


def redis_sparse_worker(rank: int, port: int, replicas: int,
                        work: SparseWork) -> Callable[[Window], StepWindow]:
    import redis

    from kvps.bench.redis_peer import WAIT_TIMEOUT_MS

    batch, grad, lr = _cycle(work, rank), work.grad(rank), np.float32(LR)
    r = redis.Redis(port=port)
    r.ping()
    short = [0]

    def step() -> None:
        ids = batch()
        fields = ids.tolist()
        raw = r.hmget(KEY, fields)
        rows = np.frombuffer(b"".join(raw), dtype=np.float32).reshape(len(ids), work.dim)  # (n, dim)
        new = rows - lr * grad[:len(ids)]
        pipe = r.pipeline(transaction=False)
        pipe.hset(KEY, mapping=dict(zip(fields, (row.tobytes() for row in new))))
        pipe.execute_command("WAIT", replicas, WAIT_TIMEOUT_MS)
        if pipe.execute()[-1] < replicas:
            short[0] += 1

    def run(window: Window) -> StepWindow:
        out = _run(step, window, r.close)
        out.counters["wait_short"] = short[0]
        return out
    return run


# ---- PyTorch RPC ----------------------------------------------------------------------------------

class _RowServer:
    def __init__(self, work: SparseWork) -> None:
        import torch

        self.lock = threading.Lock()
        self.table = torch.full((work.rows, work.dim), 0.01)  # (rows, dim) float32

    def get(self, ids):
        with self.lock:
            return self.table[ids].clone()

    def push(self, ids, grads) -> None:
        with self.lock:
            self.table.index_add_(0, ids, grads, alpha=-LR)


_TABLE: _RowServer | None = None  # only ever set inside the RPC server process


def get_rows(ids):
    if _TABLE is None:
        raise RuntimeError("RPC entry points run in the parameter-server process only")
    return _TABLE.get(ids)


def push_rows(ids, grads) -> None:
    if _TABLE is None:
        raise RuntimeError("RPC entry points run in the parameter-server process only")
    _TABLE.push(ids, grads)


def _server_main(port: int, world: int, work: SparseWork) -> None:
    global _TABLE
    _TABLE = _RowServer(work)
    from torch.distributed import rpc

    from kvps.bench.rpc_peer import _init
    _init("ps", 0, world, port)
    rpc.shutdown()


def start_rpc_table(port: int, workers: int, work: SparseWork) -> mp.Process:
    proc = mp.get_context("spawn").Process(target=_server_main, args=(port, workers + 1, work), daemon=True)
    proc.start()
    return proc


def rpc_sparse_worker(rank: int, port: int, workers: int,
                      work: SparseWork) -> Callable[[Window], StepWindow]:
    import torch
    from torch.distributed import rpc

    from kvps.bench.rpc_peer import _init
    _init(f"w{rank}", rank + 1, workers + 1, port)
    batches = [torch.from_numpy(b) for b in work.batches_for(rank)]
    grad, at = torch.from_numpy(work.grad(rank)), [0]
    rpc.rpc_sync("ps", get_rows, args=(batches[0],))

    def step() -> None:
        at[0] += 1
        ids = batches[at[0] % len(batches)]
        rpc.rpc_sync("ps", get_rows, args=(ids,))
        rpc.rpc_sync("ps", push_rows, args=(ids, grad[:len(ids)]))
    return lambda window: _run(step, window, rpc.shutdown)
