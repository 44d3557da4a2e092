"""B2, raw replicated write throughput by payload size: one writer, distinct keys.

Both systems get the same shape of work: a *batch* of ``k`` writes of ``size`` bytes to ``k``
distinct keys, acknowledged only once every write in it is replicated, and the next batch starts
after the acknowledgement (one batch outstanding; ``k`` chosen so a batch is ~4 MiB, between 1 and
256 writes):

* kvps: one ``push({key_1: v_1, ..., key_k: v_k})`` (the client groups it per shard; the shard
  leaders commit it through Raft on a majority of 3 replicas) — ``Add`` optimizer, so the stored
  value is the sum;
* Redis: a pipeline of ``k`` SETs followed by ``WAIT 2 <timeout>`` (on all 3 copies).

``k = 1`` (latency-bound, one write at a time) is measured as well. Each measurement runs the
writer in this process for ``seconds``.
"""
from __future__ import annotations

import asyncio
import time

import numpy as np

__all__ = ["batch_size", "kvps_raw", "redis_raw"]

BATCH_BYTES = 4 << 20


def batch_size(size: int, batched: bool) -> int:
    return max(1, min(256, BATCH_BYTES // size)) if batched else 1


def _result(writes: int, size: int, elapsed: float, latencies: list[float], k: int) -> dict:
    lat = sorted(latencies)
    return {"bytes_per_s": writes * size / elapsed, "writes_per_s": writes / elapsed,
            "batch": k, "batch_ms_p50": 1000 * lat[len(lat) // 2] if lat else float("nan"),
            "batch_ms_p99": 1000 * lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else float("nan"),
            "writes": writes, "seconds": elapsed}


def kvps_raw(endpoints: list[str], token: str, size: int, batched: bool, seconds: float,
             tag: str) -> dict:
    import kvps_client as kc

    k = batch_size(size, batched)
    numel = size // 4

    async def main() -> dict:
        async with kc.Client(endpoints, token=token, seed=7, timeout=60) as ps:
            names = [f"b2/{tag}/{size}/{i}" for i in range(max(2 * k, 8))]
            zero = np.zeros(numel, np.float32)
            await asyncio.gather(*(ps.create(n, zero) for n in names))
            value = np.ones(numel, np.float32)
            for n in names:  # warm the layout cache: describe() is not what we measure
                await ps.describe(n)
            writes, latencies, i = 0, [], 0
            start = time.monotonic()
            while time.monotonic() - start < seconds:
                batch = {names[(i + j) % len(names)]: value for j in range(k)}
                i += k
                t0 = time.monotonic()
                await ps.push(batch)
                latencies.append(time.monotonic() - t0)
                writes += k
            return _result(writes, size, time.monotonic() - start, latencies, k)

    return asyncio.run(main())


def redis_raw(port: int, replicas: int, size: int, batched: bool, seconds: float, tag: str) -> dict:
    import redis

    from kvps.bench.redis_peer import WAIT_TIMEOUT_MS

    k = batch_size(size, batched)
    r = redis.Redis(port=port)
    names = [f"b2/{tag}/{size}/{i}" for i in range(max(2 * k, 8))]
    value = np.ones(size // 4, np.float32).tobytes()
    writes, latencies, i, short = 0, [], 0, 0
    try:
        start = time.monotonic()
        while time.monotonic() - start < seconds:
            t0 = time.monotonic()
            pipe = r.pipeline(transaction=False)
            for j in range(k):
                pipe.set(names[(i + j) % len(names)], value)
            pipe.execute_command("WAIT", replicas, WAIT_TIMEOUT_MS)
            i += k
            if pipe.execute()[-1] < replicas:
                short += 1
            latencies.append(time.monotonic() - t0)
            writes += k
        out = _result(writes, size, time.monotonic() - start, latencies, k)
    finally:
        r.delete(*names)
        r.close()
    out["wait_short"] = short
    return out
