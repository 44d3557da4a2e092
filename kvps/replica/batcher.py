"""The leader's push batcher: group commit with merging and back-pressure.

Pushes that arrive while earlier proposals are in flight wait in ``pending``; as soon as a proposal
slot frees up, everything pending (up to ``batch_bytes``) is merged into one ``Push`` command
(``kvps.merge``) and proposed. Under load the window is exactly one commit round trip, bounded in
bytes. An idle leader waits ``merge_window`` before proposing, so the pushes of one training step
from several workers share an entry, but only while more than one client pushes to it: a lone
writer's push is proposed at once (the window was half of a 4 KiB write's latency here, and there
is nothing to merge it with).

A push that names a block (or a table) an in-flight proposal names waits for that proposal to
commit, and then merges with every other push to those blocks that arrived meanwhile: concurrent
workers' gradients of one block share one entry (one replication, one optimizer step) instead of
taking the free proposal slots one by one. Pushes to other blocks still go out in parallel.

A retried push whose id is already pending or in flight is attached to the same future instead of
being merged twice. Accepted-but-uncommitted bytes are bounded by ``max_inflight_bytes``: beyond it a
push waits up to ``overload_wait`` and then fails with ``Overloaded`` (retryable).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from kvps.config import ServerConfig
from kvps.errors import InvalidRequest, KvpsError, Overloaded, Unavailable
from kvps.merge import PushRequest, merge, request_bytes
from kvps.raft.group import ENTRY_OFFSET

__all__ = ["PushBatcher"]

log = logging.getLogger("kvps.batcher")

PushKey = tuple[str, int]
# The merge window applies for this long (s) after a push from a client other than the previous
# one; a training step is well within it, so the workers of a job keep merging.
SHARED_HORIZON = 1.0
_SUM: Mapping[str, str] = {}  # no modes given: every key sums


class PushBatcher:
    def __init__(
        self,
        propose: Callable[[bytes], Awaitable[Any]],
        cfg: ServerConfig,
        *,
        clock: Callable[[], float],  # the cluster time (kvps.clocks.ClusterTime.now)
        on_batch: Callable[[int, int], None] | None = None,
    ) -> None:
        self._propose = propose
        self._cfg = cfg
        self._clock = clock
        self._on_batch = on_batch  # (pushes merged, bytes) -> None, for metrics
        self._pending: list[tuple[PushRequest, int]] = []
        self._modes: dict[PushKey, Mapping[str, str]] = {}  # merge mode of each pending id's keys
        self._pending_bytes = 0
        self._futures: dict[PushKey, asyncio.Future] = {}
        self._digests: dict[PushKey, int] = {}  # content checksum of each pending / in-flight id
        self._accepted_bytes = 0  # pending + in flight
        self._inflight = 0
        self._busy: dict[tuple[str, int], int] = {}  # blocks (tables: block -1) in flight -> proposals
        self._tasks: set[asyncio.Task] = set()
        self._space = asyncio.Condition()
        self._timer: asyncio.TimerHandle | None = None
        self._window_done = False
        self._last_client: str | None = None
        self._shared_until = 0.0  # time.monotonic() until which several clients count as pushing

    @property
    def accepted_bytes(self) -> int:
        return self._accepted_bytes

    async def submit(self, req: PushRequest, modes: Mapping[str, str] = _SUM) -> Any:
        """Queue ``req`` and wait for its result (a dict, or raises a KvpsError). ``modes``: the
        merge mode of each key it names, as the leader's pre-check found them (default: sum)."""
        key = (req.client, req.seq)
        fut = self._futures.get(key)
        if fut is not None and req.digest and self._digests.get(key, req.digest) != req.digest:
            raise InvalidRequest("push id already in flight for a different push; nothing applied",
                                 client=req.client, seq=req.seq)
        if fut is None:
            if self._last_client is not None and req.client != self._last_client:
                self._shared_until = time.monotonic() + SHARED_HORIZON
            self._last_client = req.client
            self._digests[key] = req.digest
            size = request_bytes(req)
            await self._reserve(size)
            fut = asyncio.get_running_loop().create_future()
            self._futures[key] = fut
            self._modes[key] = modes
            self._pending.append((req, size))
            self._pending_bytes += size
            self._kick()
        # shield: a client that disconnects must not cancel a push that other pushes share.
        return await asyncio.shield(fut)

    async def _reserve(self, size: int) -> None:
        limit = self._cfg.max_inflight_bytes
        if self._accepted_bytes + size <= limit or self._accepted_bytes == 0:
            self._accepted_bytes += size
            return
        try:
            async with asyncio.timeout(self._cfg.overload_wait):
                async with self._space:
                    await self._space.wait_for(
                        lambda: self._accepted_bytes + size <= limit or self._accepted_bytes == 0)
        except TimeoutError:
            raise Overloaded("leader has too many bytes in flight", in_flight=self._accepted_bytes,
                             limit=limit) from None
        self._accepted_bytes += size

    def _kick(self) -> None:
        window = self._cfg.merge_window
        if (window > 0 and self._inflight == 0 and self._pending and self._timer is None
                and self._pending_bytes < self._cfg.batch_bytes and not self._window_done
                and time.monotonic() < self._shared_until):
            # Idle leader that several clients push to: wait one short window so pushes that
            # arrive together (the workers of one step) merge into one entry; under load the
            # commit round trip is the window.
            self._timer = asyncio.get_running_loop().call_later(window, self._window_elapsed)
            return
        if self._timer is not None and (self._inflight > 0 or self._pending_bytes >= self._cfg.batch_bytes):
            self._timer.cancel()
            self._timer = None
        if self._timer is not None:
            return
        while self._pending and self._inflight < self._cfg.max_inflight_proposals:
            batch = self._take_batch()
            if not batch:  # every pending push waits for a block in flight
                break
            self._inflight += 1
            self._mark(batch, +1)
            task = asyncio.get_running_loop().create_task(self._run(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        self._window_done = False

    def _window_elapsed(self) -> None:
        self._timer = None
        self._window_done = True
        self._kick()

    def _take_batch(self) -> list[tuple[PushRequest, int]]:
        """Pending pushes, oldest first, while the *merged* command stays within batch_bytes: a
        block that several workers pushed is counted once, since merging sums it."""
        batch, merged, seen, kept = [], 0, set(), []
        while self._pending:
            req, n = self._pending[0]
            if any(unit in self._busy for unit in _units(req)):
                kept.append(self._pending.pop(0))  # merges into the proposal after that one
                continue
            grows = _merged_growth(req, seen)
            # A push whose blocks are all in the batch already adds only its id: it joins even
            # past batch_bytes (one worker's push to a shard may exceed it alone: B1 sends 8 MiB),
            # so k workers' pushes of the same blocks replicate as one entry, not k.
            if batch and merged + grows > self._cfg.batch_bytes and grows > _id_bytes(req):
                break
            batch.append(self._pending.pop(0))
            self._pending_bytes -= n
            merged += grows
            seen.update((key, block) for key, block, _ in req.dense)
        self._pending[:0] = kept  # in arrival order, ahead of what was not looked at
        return batch

    def _mark(self, batch: list[tuple[PushRequest, int]], delta: int) -> None:
        """Count the blocks of ``batch`` in (``+1``) or out of (``-1``) flight."""
        for unit in {u for req, _ in batch for u in _units(req)}:
            count = self._busy.get(unit, 0) + delta
            if count > 0:
                self._busy[unit] = count
            else:
                self._busy.pop(unit, None)

    async def _run(self, batch: list[tuple[PushRequest, int]]) -> None:
        reqs = [req for req, _ in batch]
        try:
            outcome = await self._propose_merged(reqs)
            for req in reqs:
                self._settle(req, outcome(req))
        finally:
            self._inflight -= 1
            self._mark(batch, -1)
            self._accepted_bytes -= sum(n for _, n in batch)
            async with self._space:
                self._space.notify_all()
            self._kick()

    async def _propose_merged(self, reqs: list[PushRequest]) -> Callable[[PushRequest], Any]:
        try:
            modes = {k: m for req in reqs for k, m in self._modes.get((req.client, req.seq), {}).items()}
            cmd = merge(reqs, modes, now=self._clock())
            parts = cmd.to_parts(at=ENTRY_OFFSET)  # joined once, behind the Raft entry's prefix
            if self._on_batch is not None:
                self._on_batch(len(reqs), sum(len(p) for p in parts))
            result = await self._propose(parts)
        except KvpsError as exc:
            failure: KvpsError = exc
            return lambda req: failure
        except Exception as exc:  # a bug in merging must fail these pushes, not the server
            log.exception("merging %d pushes failed", len(reqs))
            failure = Unavailable(f"merge failed: {exc}")
            return lambda req: failure
        if isinstance(result, KvpsError):
            return lambda req: result
        results = result.get("results", {})
        missing = Unavailable("push missing from the applied entry")
        return lambda req: results.get((req.client, req.seq), missing)

    def _settle(self, req: PushRequest, value: Any) -> None:
        self._digests.pop((req.client, req.seq), None)
        self._modes.pop((req.client, req.seq), None)
        fut = self._futures.pop((req.client, req.seq), None)
        if fut is None or fut.done():
            return
        if isinstance(value, BaseException):
            fut.set_exception(value)
            fut.exception()  # mark retrieved: nobody may be waiting any more
        else:
            fut.set_result(value)

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        err = Unavailable("replica shutting down")
        for req, _ in self._pending:
            self._settle(req, err)
        self._pending.clear()


def _id_bytes(req: PushRequest) -> int:
    return 96 + len(req.client)


def _units(req: PushRequest) -> set[tuple[str, int]]:
    """What a push changes, as units that merge: its dense blocks, and each table it names (rows
    merge per table)."""
    return {(key, block) for key, block, _ in req.dense} | {(key, -1) for key, _, _ in req.rows}


def _merged_growth(req: PushRequest, seen: set) -> int:
    """Bytes ``req`` adds to a merged command that already holds the blocks in ``seen``."""
    grows = _id_bytes(req)  # its push id
    grows += sum(64 + grad.nbytes for key, block, grad in req.dense if (key, block) not in seen)
    grows += sum(64 + ids.nbytes * 2 + grads.nbytes for _, ids, grads in req.rows)  # ids + counts
    return grows
