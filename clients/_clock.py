"""``StepClock``: one worker's clock in a training job, kept by the server (consistency modes).

- asynchronous (``max_staleness=None``): no clock at all; workers never wait for each other.
- bounded staleness, SSP (``max_staleness=s``): a worker that has completed ``c`` steps starts its
  next step only once every live worker of the job has completed at least ``c - s``.
- synchronous, BSP (``max_staleness=0``): a barrier per step; every worker's step-``t`` gradients
  are acknowledged before anyone pulls for step ``t + 1``.

The clocks are replicated shard state (``kvps.clocks``), so they survive leader failover. Each
clock is a lease: a worker that dies stops renewing it, and after ``lease_s`` the others stop
waiting for it. A waiting worker renews its own lease while it waits; ``lease_s`` must exceed the
longest step (compute + push) a healthy worker takes.

    clock = StepClock(client, "job", "worker-0", max_staleness=2, workers=3)
    await clock.start()                  # register, and wait until 3 workers have joined
    for batch in data:
        await clock.wait()               # may block: too far ahead of the slowest worker
        ... pull, compute, push ...
        await clock.tick()               # one more step completed
    await clock.leave()                  # the others stop waiting for this worker
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from kvps.errors import InvalidRequest, Timeout

from ._client import Client

__all__ = ["StepClock"]


class StepClock:
    def __init__(self, client: Client, job: str, worker: str, *, max_staleness: int | None,
                 lease_s: float = 10.0, workers: int | None = None, join_timeout: float = 120.0,
                 poll: float = 0.005, poll_cap: float = 0.05,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        if max_staleness is not None and (isinstance(max_staleness, bool) or max_staleness < 0):
            raise InvalidRequest("max_staleness must be None (asynchronous) or an int >= 0")
        if not lease_s > 0:
            raise InvalidRequest("lease_s must be > 0")
        self.client = client
        self.job = job
        self.worker = worker
        self.max_staleness = max_staleness
        self.lease_s = float(lease_s)
        self.workers = workers
        self.join_timeout = join_timeout
        self._poll, self._poll_cap = poll, poll_cap
        self._sleep = sleep
        self._monotonic = monotonic
        self.step = 0  # steps this worker has completed (and reported)
        self.clocks: dict[str, int] = {}  # the job's live clocks as last seen
        self.polls = 0  # clock reads made while waiting (tests watch a worker block with it)
        self._renewed = 0.0

    @property
    def waits(self) -> bool:
        """Whether this clock ever makes the worker wait (False: asynchronous)."""
        return self.max_staleness is not None

    async def start(self) -> None:
        """Register and, with ``workers``, wait until that many workers of the job are live:
        otherwise the first worker up would run ahead alone. A worker that joins a running job
        registers at the slowest live worker's step when that is ahead of its own: from step 0 it
        would hold every other worker back until it had replayed the steps it missed."""
        if not self.waits:
            return
        others = [s for w, s in (await self.client.clocks(self.job)).items() if w != self.worker]
        if others and min(others) > self.step:
            self.step = min(others)
        await self._report()
        if self.workers is None:
            return
        deadline = self._monotonic() + self.join_timeout
        delay = self._poll
        while len(self.clocks) < self.workers:
            if self._monotonic() > deadline:
                raise Timeout(f"only {len(self.clocks)} of {self.workers} workers joined job "
                              f"{self.job!r} within {self.join_timeout}s", job=self.job)
            await self._sleep(delay)
            delay = min(self._poll_cap, delay * 2)
            await self._refresh()

    def may_start(self, clocks: dict[str, int]) -> bool:
        """May this worker begin its next step, given the job's live clocks?"""
        if self.max_staleness is None or not clocks:
            return True
        return min(clocks.values()) >= self.step - self.max_staleness

    async def wait(self) -> dict[str, int]:
        """Block until this worker may begin its next step; the clocks that allowed it."""
        delay = self._poll
        while not self.may_start(self.clocks):
            await self._sleep(delay)
            delay = min(self._poll_cap, delay * 2)
            self.polls += 1
            await self._refresh()
        return dict(self.clocks)

    async def tick(self) -> None:
        """One more step completed (call it after the step's pushes were acknowledged)."""
        self.step += 1
        if self.waits:
            await self._report()

    async def leave(self) -> None:
        """Drop this worker's clock: the others stop waiting for it at once."""
        if self.waits:
            await self.client.clock_tick(self.job, self.worker, self.step, lease_s=0)

    async def _report(self) -> None:
        self.clocks = await self.client.clock_tick(self.job, self.worker, self.step, lease_s=self.lease_s)
        self._renewed = self._monotonic()

    async def _refresh(self) -> None:
        # A waiting worker is alive: renew its lease well before it ends, else only read.
        if self._monotonic() - self._renewed > self.lease_s / 3:
            await self._report()
        else:
            self.clocks = await self.client.clocks(self.job)
