"""B7, many small keys: ``keys`` dense keys of ``key_bytes`` each, created once, then pulled all
and pushed all, round after round, by one client.

Both systems get the same work, acknowledged only once it is on every copy:

* kvps: ``create_many`` (per shard, the keys go in as few Raft entries as the request cap
  allows), then per round ``pull(all keys)`` and ``push({every key: gradient})`` (``Add``, so
  each push lands exactly once on 3 replicas); the client groups each call per shard.
* Redis: the create is a pipeline of SETs followed by ``WAIT 2``; a pull is one pipeline of GETs;
  a push one pipeline of SETs followed by ``WAIT 2`` (last writer wins).

Figures: seconds to create them all, and the median over rounds of the pull, the push and their
sum (the round); ``ratio_vs_redis`` is Redis's round time over kvps's (above 1: kvps is faster).
The first pull of a fresh kvps client (it learns every key's layout: one request per shard) is
reported apart from the rounds.
"""
from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = ["SmallKeys", "kvps_small_keys", "redis_small_keys"]


@dataclass(frozen=True)
class SmallKeys:
    keys: int = 10_000
    key_bytes: int = 1024
    rounds: int = 5

    def names(self, tag: str) -> list[str]:
        return [f"b7/{tag}/{i}" for i in range(self.keys)]

    def value(self) -> np.ndarray:
        return np.ones(self.key_bytes // 4, np.float32)


def _figures(create_s: float, pulls: list[float], pushes: list[float]) -> dict:
    rounds = [a + b for a, b in zip(pulls, pushes)]
    return {"create_s": create_s, "pull_s": statistics.median(pulls), "push_s": statistics.median(pushes),
            "round_s": statistics.median(rounds), "rounds": len(rounds)}


def kvps_small_keys(endpoints: list[str], token: str, work: SmallKeys,
                    detail: Callable[[str], None] = lambda _: None) -> dict:
    import kvps_client as kc

    names, value = work.names("k"), work.value()

    async def main() -> dict:
        async with kc.Client(endpoints, token=token, seed=7, timeout=120) as ps:
            t0 = time.monotonic()
            await ps.create_many({n: value for n in names})
            create_s = time.monotonic() - t0
        async with kc.Client(endpoints, token=token, seed=8, timeout=120) as ps:
            t0 = time.monotonic()
            first = await ps.pull(names)
            first_pull_s = time.monotonic() - t0
            if not all(np.array_equal(first[n], value) for n in names):
                raise AssertionError("B7: a pulled key does not hold its created value")
            pulls, pushes = [], []
            for r in range(work.rounds):
                detail(f"round {r + 1}/{work.rounds}")
                t0 = time.monotonic()
                await ps.pull(names)
                t1 = time.monotonic()
                await ps.push({n: value for n in names})
                pushes.append(time.monotonic() - t1)
                pulls.append(t1 - t0)
            last = await ps.pull(names)
            if not all(np.array_equal(last[n], value * (work.rounds + 1)) for n in names):
                raise AssertionError("B7: a key does not hold its value plus every push")
        return {**_figures(create_s, pulls, pushes), "first_pull_s": first_pull_s,
                "semantics": "every push applied exactly once on 3 replicas"}

    return asyncio.run(main())


def redis_small_keys(port: int, replicas: int, work: SmallKeys,
                     detail: Callable[[str], None] = lambda _: None) -> dict:
    import redis

    from kvps.bench.redis_peer import WAIT_TIMEOUT_MS

    names, value = work.names("r"), work.value().tobytes()
    r = redis.Redis(port=port)
    short = 0

    def write_all() -> None:
        nonlocal short
        pipe = r.pipeline(transaction=False)
        for n in names:
            pipe.set(n, value)
        pipe.execute_command("WAIT", replicas, WAIT_TIMEOUT_MS)
        if pipe.execute()[-1] < replicas:
            short += 1

    try:
        t0 = time.monotonic()
        write_all()
        create_s = time.monotonic() - t0
        pulls, pushes = [], []
        for i in range(work.rounds):
            detail(f"round {i + 1}/{work.rounds}")
            t0 = time.monotonic()
            pipe = r.pipeline(transaction=False)
            for n in names:
                pipe.get(n)
            got = pipe.execute()
            t1 = time.monotonic()
            # the client's update of each value is the workload's, not the store's: a plain SET
            write_all()
            pushes.append(time.monotonic() - t1)
            pulls.append(t1 - t0)
            if len(got) != len(names) or any(g is None for g in got):
                raise AssertionError("B7: Redis lost a key")
    finally:
        for i in range(0, len(names), 1000):
            r.delete(*names[i:i + 1000])
        r.close()
    return {**_figures(create_s, pulls, pushes), "wait_short": short,
            "semantics": "last-writer-wins; WAIT 2 after each pipeline"}
