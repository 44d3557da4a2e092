"""Workloads that run inside the harness process: the exactly-once counter and the registers.

Every operation is recorded with its invocation and completion time (``time.monotonic``) and its
shard, for the checks and the timeline. An operation that failed with anything but a definitive
rejection has an *unknown outcome*: it may have been applied (its reply was lost) or not.

* counter: each worker pushes ``1`` to an ``Add`` key of its shard; afterwards
  acked <= value <= acked + unknown must hold (below: lost pushes; above: pushes applied twice).
* register: single-block keys, one per shard; reads (linearizable unless asked otherwise), blind
  writes of unique values and compare-and-sets on the version last seen; the history goes to the
  linearizability checker.
"""
from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import kvps_client as kc
from kvps.errors import KvpsError, PushExpired, RejectedError, VersionConflict
from kvps.placement import block_shard

from kvps_chaos.linearizability import UNKNOWN, Operation

__all__ = ["CounterTally", "LossyTransport", "OpRecord", "Workloads", "key_on_shard"]

ONE = np.ones(1, np.float32)


@dataclass
class OpRecord:
    kind: str            # "counter" | "register" | "train"
    shard: int
    client: str
    call: float
    ret: float
    ok: bool
    error: str | None = None


def key_on_shard(prefix: str, shard: int, shards: int) -> str:
    """The first name ``prefix/i`` whose (only) block lives on ``shard``."""
    for i in range(100_000):
        key = f"{prefix}/{i}"
        if block_shard(key, 0, shards) == shard:
            return key
    raise ValueError(f"no key for shard {shard}")


class LossyTransport:
    """Loses the reply of a successful push or set with probability ``loss`` (the server did apply
    it): the client must retry the same push id, which the duplicate table must absorb."""

    def __init__(self, inner: Any, rng: random.Random) -> None:
        self.inner, self.rng, self.loss, self.lost = inner, rng, 0.0, 0

    async def open(self) -> None:
        await self.inner.open()

    async def close(self) -> None:
        await self.inner.close()

    async def request(self, method, url, body, *, headers, timeout):
        status, data = await self.inner.request(method, url, body, headers=headers, timeout=timeout)
        if (status == 200 and self.loss > 0 and url.endswith(("/v1/rpc/push", "/v1/rpc/set"))
                and self.rng.random() < self.loss):
            self.lost += 1
            raise kc.Unavailable("reply lost on purpose (chaos reply-loss)")
        return status, data


def _unknown(exc: KvpsError) -> bool:
    """A definitive rejection means nothing changed, except PushExpired (it *was* applied)."""
    return not isinstance(exc, RejectedError) or isinstance(exc, PushExpired)


@dataclass
class CounterTally:
    acked: int = 0
    unknown: int = 0
    rejected: int = 0
    versions: dict[str, list[int]] = field(default_factory=dict)  # per client: versions returned


class Workloads:
    def __init__(self, endpoints: list[str], token: str, shards: int, seed: int, *,
                 counter_clients: int, register_clients: int, op_timeout: float,
                 register_reads: str = "linearizable", pace: float = 0.02) -> None:
        self.endpoints, self.token, self.shards, self.seed = endpoints, token, shards, seed
        self.counter_clients, self.register_clients = counter_clients, register_clients
        self.op_timeout, self.pace, self.register_reads = op_timeout, pace, register_reads
        self.counter_keys = [key_on_shard("chaos/counter", s, shards) for s in range(shards)]
        self.register_keys = [key_on_shard("chaos/reg", s, shards) for s in range(shards)]
        self.records: list[OpRecord] = []
        self.tally = {k: CounterTally() for k in self.counter_keys}
        self.history: list[Operation] = []
        self.initial: dict[str, tuple[float, int]] = {}
        self.transports: list[LossyTransport] = []
        self.stop = asyncio.Event()

    def client(self, name: str, **kw: Any) -> kc.Client:
        seed = self.seed * 1000 + len(self.transports)
        transport = LossyTransport(kc.HttpTransport(), random.Random(seed))
        self.transports.append(transport)
        return kc.Client(self.endpoints, token=self.token, timeout=self.op_timeout,
                         request_timeout=2.0, seed=seed, client_id=f"{name}-{self.seed}",
                         transport=transport, **kw)

    def set_reply_loss(self, loss: float) -> None:
        for t in self.transports:
            t.loss = loss

    @property
    def replies_lost(self) -> int:
        return sum(t.lost for t in self.transports)

    async def setup(self) -> None:
        async with kc.Client(self.endpoints, token=self.token, timeout=60, seed=self.seed) as ps:
            for key in self.counter_keys + self.register_keys:
                await ps.create(key, np.zeros(1, np.float32))
            for key in self.register_keys:
                value, version = await ps.get(key, consistency="linearizable")
                self.initial[key] = (float(value[0]), version)

    async def run(self) -> None:
        tasks = [self._counter(i) for i in range(self.counter_clients)]
        tasks += [self._register(i) for i in range(self.register_clients)]
        await asyncio.gather(*tasks)

    # ---- counter -----------------------------------------------------------------------------

    async def _counter(self, i: int) -> None:
        rng = random.Random(self.seed * 7919 + i)
        name = f"counter{i}"
        async with self.client(name) as ps:
            # One shard per client: a client stuck on a failed-over shard must not stall the
            # others' traffic, or the timeline would show every shard dipping at once.
            shard = i % self.shards
            key, tally = self.counter_keys[shard], self.tally[self.counter_keys[shard]]
            while not self.stop.is_set():
                call = time.monotonic()
                try:
                    versions = await ps.push({key: ONE})
                    tally.acked += 1
                    tally.versions.setdefault(name, []).append(versions[key])
                    self.records.append(OpRecord("counter", shard, name, call, time.monotonic(), True))
                except KvpsError as exc:
                    if _unknown(exc):
                        tally.unknown += 1
                    else:
                        tally.rejected += 1
                    self.records.append(OpRecord("counter", shard, name, call, time.monotonic(), False,
                                                 type(exc).__name__))
                await asyncio.sleep(rng.uniform(0, 2 * self.pace))

    # ---- registers ---------------------------------------------------------------------------

    async def _register(self, i: int) -> None:
        rng = random.Random(self.seed * 104729 + i)
        name = f"register{i}"
        seen: dict[str, int] = {}
        n = 0
        async with self.client(name, consistency=self.register_reads) as ps:
            while not self.stop.is_set():
                key = rng.choice(self.register_keys)
                kind = rng.choices(("read", "write", "cas"), (4, 3, 3))[0]
                n += 1
                value = float(i * 1_000_000 + n)  # unique per write, exact in float32 (< 2**24)
                await self._register_op(ps, name, key, kind, value, seen)
                await asyncio.sleep(rng.uniform(0, 2 * self.pace))

    async def _register_op(self, ps: kc.Client, name: str, key: str, kind: str, value: float,
                           seen: dict[str, int]) -> None:
        shard = self.register_keys.index(key)
        call = time.monotonic()
        arr = np.array([value], np.float32)
        expected = seen.get(key, self.initial[key][1])
        inp: Any = ("read", None) if kind == "read" else ("write", value) if kind == "write" else \
            ("cas", (expected, value))
        try:
            if kind == "read":
                got, version = await ps.get(key)
                out: Any = (float(got[0]), version)
                seen[key] = version
            elif kind == "write":
                out = await ps.set(key, arr)
                seen[key] = out
            else:
                try:
                    out = ("ok", await ps.set(key, arr, expected_version=expected))
                    seen[key] = out[1]
                except VersionConflict as exc:
                    out = ("conflict", exc.fields.get("actual"))
            ok, error, unknown = True, None, False
        except KvpsError as exc:
            ok, error, out, unknown = False, type(exc).__name__, UNKNOWN, _unknown(exc)
        ret = time.monotonic()
        self.records.append(OpRecord("register", shard, name, call, ret, ok, error))
        if ok:
            self.history.append(Operation(name, inp, out, call, ret, key))
        elif kind != "read" and unknown:  # a failed read tells nothing; a failed write may have applied
            self.history.append(Operation(name, inp, UNKNOWN, call, math.inf, key))

    async def final_reads(self) -> dict[str, tuple[float, int]]:
        """Linearizable reads of every counter and register after the run (they join the
        register history as one more client, so a write lost at the end is caught too)."""
        out = {}
        async with kc.Client(self.endpoints, token=self.token, timeout=60, seed=self.seed + 1) as ps:
            for key in self.counter_keys + self.register_keys:
                call = time.monotonic()
                value, version = await ps.get(key, consistency="linearizable")
                out[key] = (float(value[0]), version)
                if key in self.register_keys:
                    self.history.append(Operation("final", ("read", None), out[key], call,
                                                  time.monotonic(), key))
        return out

