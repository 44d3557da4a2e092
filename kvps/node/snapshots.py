"""Cluster-wide user snapshots: create, list, restore, drop, retention (the coordinator).

Any node coordinates (the one that got ``POST /v1/snapshots``, or the scheduler's node). A
snapshot is a ``SnapshotStep`` proposed on every shard, in four phases:

1. **cut** on every shard, concurrently. The log index of the cut *is* the shard's snapshot: each
   replica takes a view of its state there and writes it to ``DATA/snapshots/<id>/`` off the
   apply thread. From the cut on, the replica holds the acknowledgements of pushes applied after
   it (``Replica._release``).
2. Once every shard has applied its cut, the coordinator reads the clock: that is the snapshot's
   **timestamp** T. Every push acknowledged before T was applied before its shard's cut, so it is
   in the snapshot; every push applied after a cut is acknowledged only after T (its reply was
   held), so none acknowledged after T is in it. "Acknowledged" is the moment the server sends
   the reply (a client may read it later); T and the servers' clocks are this host's wall clock
   on one machine — across machines, their skew adds to the boundary.
3. **seal** on every shard records T and releases the held replies. Holds last at most
   ``server.snapshot_hold`` seconds: a cut phase slower than half of that abandons the snapshot.
4. Once a majority of every shard's replicas have written their file (identical bytes: the digest
   of each must agree), **commit** records the digest and size. Only committed snapshots are
   listed; anything that fails on the way is dropped on every shard (files deleted).

Restore (by id, or the newest at or before a time) first has *every* replica of every shard check
its file against the committed digest and load it (a replica without the file, e.g. one that
joined later, fetches it from one that has it); a damaged or missing file aborts the restore with
the reason, and nothing has changed. Then ``restore`` is proposed on every shard: each replica
swaps in the state it loaded, deterministically. A restore is per shard atomic; the shards switch
one after the other within a moment (concurrent pushes may land on either side of it).
"""
from __future__ import annotations

import asyncio
import datetime as dt
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

from kvps.errors import InvalidRequest, KeyNotFound, KvpsError, RetryableError, Unavailable

__all__ = ["SnapshotCoordinator", "new_snapshot_id", "parse_time"]

log = logging.getLogger("kvps.snapshots")

_POLL = 0.05


def new_snapshot_id(now: float) -> str:
    stamp = dt.datetime.fromtimestamp(now, dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
    return f"{stamp}-{secrets.token_hex(3)}"


def parse_time(text: str) -> float:
    """A Unix time, or an ISO 8601 time (UTC unless it names a zone)."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        when = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise InvalidRequest(f"not a time: {text!r} (a Unix time or ISO 8601)") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    return when.timestamp()


class SnapshotCoordinator:
    """Runs the phases above through a ``kvps_client.Client`` (its routing and retries)."""

    def __init__(self, client: Any, *, hold: float, clock: Callable[[], float] = time.time,
                 file_timeout: float = 900.0, progress: Callable[[str], None] | None = None) -> None:
        self.client = client
        self.hold = hold
        self.clock = clock
        self.file_timeout = file_timeout
        self.progress = progress or (lambda msg: None)
        self._lock = asyncio.Lock()  # one snapshot operation at a time from this coordinator

    @property
    def shards(self) -> range:
        return range(self.client.cluster_map.shards)

    # ---- calls ---------------------------------------------------------------------------

    async def _step(self, shard: int, op: str, snap_id: str, **fields: Any) -> dict:
        reply = await self.client.call(shard, "snapshot_step", {"op": op, "snap_id": snap_id, **fields})
        return reply.meta["result"]

    async def _on_replica(self, url: str, op: str, meta: dict) -> dict:
        from kvps.delta import frame

        body = frame.encode(frame.KIND_REQUEST, meta)
        reply = await self.client.sender.send_once(url, op, body)
        return reply.meta

    async def _all(self, calls: list) -> list:
        return list(await asyncio.gather(*calls))

    # ---- create ------------------------------------------------------------------------------

    async def create(self, label: str = "") -> dict:
        async with self._lock:
            await self.client.refresh_map()
            created = self.clock()
            snap_id = new_snapshot_id(created)
            try:
                return await self._create(snap_id, created, label)
            except BaseException as exc:
                log.warning("snapshot %s abandoned: %r", snap_id, exc)
                await self._drop_quietly(snap_id)
                raise

    async def _create(self, snap_id: str, created: float, label: str) -> dict:
        started = time.monotonic()
        self.progress(f"snapshot {snap_id}: cutting {len(self.shards)} shards")
        await self._all([self._step(s, "cut", snap_id, at=created, label=label) for s in self.shards])
        took = time.monotonic() - started
        if took > self.hold / 2:
            raise Unavailable(f"cutting snapshot {snap_id} took {took:.2f} s, over half the "
                              f"{self.hold} s hold; abandoned", snapshot=snap_id)
        taken_at = self.clock()
        await self._all([self._step(s, "seal", snap_id, at=taken_at) for s in self.shards])
        self.progress(f"snapshot {snap_id}: timestamp {taken_at:.6f}; waiting for the files")
        files = await self._all([self._wait_files(s, snap_id) for s in self.shards])
        entries = await self._all([self._step(s, "commit", snap_id, digest=d, size=n)
                                   for s, (d, n) in zip(self.shards, files)])
        self.progress(f"snapshot {snap_id}: complete")
        return _summary(snap_id, [{**e["snapshot"], "shard": s} for s, e in zip(self.shards, entries)])

    async def _wait_files(self, shard: int, snap_id: str) -> tuple[str, int]:
        """(digest, size) once a majority of ``shard``'s replicas have written the same file."""
        urls = self.client.cluster_map.replicas[shard]
        need = len(urls) // 2 + 1
        deadline = time.monotonic() + self.file_timeout
        while True:
            views = await asyncio.gather(*[self._on_replica(u, "snapshot_status", {"snap_id": snap_id})
                                           for u in urls], return_exceptions=True)
            written: dict[tuple[str, int], int] = {}
            failed = []
            for v in views:
                if isinstance(v, BaseException):
                    continue
                info = v["file"]
                if info.get("state") == "written":
                    written[(info["digest"], info["size"])] = written.get((info["digest"], info["size"]), 0) + 1
                elif info.get("state") == "failed":
                    failed.append(info.get("error"))
            if len(written) > 1:
                raise Unavailable(f"snapshot {snap_id}: replicas of shard {shard} wrote different "
                                  f"files {sorted(written)}; abandoned", snapshot=snap_id, shard=shard)
            for (digest, size), count in written.items():
                if count >= need:
                    return digest, size
            if len(failed) > len(urls) - need:
                raise Unavailable(f"snapshot {snap_id}: shard {shard} could not write its file: "
                                  f"{failed}", snapshot=snap_id, shard=shard)
            if time.monotonic() > deadline:
                raise Unavailable(f"snapshot {snap_id}: shard {shard}'s files not written within "
                                  f"{self.file_timeout} s", snapshot=snap_id, shard=shard)
            await asyncio.sleep(_POLL)

    # ---- list / drop / retention -------------------------------------------------------------

    async def catalog(self) -> dict[str, list[dict]]:
        """Per snapshot id, every shard's catalog entry (from the shard leaders)."""
        replies = await self._all([self.client.call(s, "snapshot_catalog", {}) for s in self.shards])
        out: dict[str, list[dict]] = {}
        for shard, reply in zip(self.shards, replies):
            for entry in reply.meta["snapshots"]:
                out.setdefault(entry["id"], []).append({**entry, "shard": shard})
        return out

    async def list(self, *, include_incomplete: bool = False) -> list[dict]:
        """Complete snapshots (committed on every shard), oldest first."""
        await self.client.refresh_map()
        n = len(self.shards)
        out = []
        for snap_id, entries in (await self.catalog()).items():
            complete = len(entries) == n and all(e["state"] == "complete" for e in entries)
            if complete or include_incomplete:
                out.append({**_summary(snap_id, entries), "complete": complete})
        return sorted(out, key=lambda s: (s["time"] or s["created"], s["id"]))

    async def drop(self, snap_id: str) -> bool:
        async with self._lock:
            await self.client.refresh_map()
            results = await self._all([self._step(s, "drop", snap_id) for s in self.shards])
            return any(r.get("dropped") for r in results)

    async def _drop_quietly(self, snap_id: str) -> None:
        try:
            await asyncio.shield(self._all([self._step(s, "drop", snap_id) for s in self.shards]))
        except (KvpsError, asyncio.CancelledError) as exc:
            log.warning("snapshot %s: drop after failure did not finish (%r); it stays unlisted",
                        snap_id, exc)

    async def enforce_retention(self, keep: int) -> list[str]:
        """Drop the oldest complete snapshots beyond ``keep`` (0: keep all), and incomplete ones
        older than an hour (their coordinator died). The dropped ids."""
        snaps = await self.list(include_incomplete=True)
        now = self.clock()
        stale = [s["id"] for s in snaps if not s["complete"] and now - s["created"] > 3600]
        complete = [s["id"] for s in snaps if s["complete"]]
        old = complete[:-keep] if keep > 0 and len(complete) > keep else []
        for snap_id in stale + old:
            await self.drop(snap_id)
        return stale + old

    # ---- restore -------------------------------------------------------------------------------

    async def resolve(self, snap_id: str | None = None, at: float | None = None) -> dict:
        snaps = await self.list()
        if snap_id is not None:
            for s in snaps:
                if s["id"] == snap_id:
                    return s
            raise KeyNotFound(f"no complete snapshot {snap_id!r}", snapshot=snap_id)
        if at is None:
            raise InvalidRequest("name a snapshot id or a time")
        earlier = [s for s in snaps if s["time"] <= at]
        if not earlier:
            raise KeyNotFound(f"no complete snapshot at or before {at}", at=at)
        return earlier[-1]

    async def restore(self, snap_id: str | None = None, at: float | None = None) -> dict:
        async with self._lock:
            await self.client.refresh_map()
            snap = await self.resolve(snap_id, at)
            snap_id = snap["id"]
            digests = snap["digests"]
            self.progress(f"restore {snap_id}: checking every replica's file")
            # Phase 1: every replica verifies (or fetches) and loads its file. Any failure: stop.
            checks, shard_of = [], []
            for s in self.shards:
                urls = self.client.cluster_map.replicas[s]
                for u in urls:
                    others = [o for o in urls if o != u]
                    checks.append(self._on_replica(u, "snapshot_prepare", {
                        "snap_id": snap_id, "digest": digests[str(s)], "sources": others}))
                    shard_of.append(s)
            results = await asyncio.gather(*checks, return_exceptions=True)
            # A file that does not verify stops everything; a replica that cannot be reached is
            # tolerated while a majority of its shard is ready (it loads or fetches the file when
            # it applies the restore).
            bad = [r for r in results if isinstance(r, KvpsError) and not isinstance(r, RetryableError)]
            if bad:
                raise bad[0]
            for s in self.shards:
                ready = sum(1 for r, rs in zip(results, shard_of) if rs == s and isinstance(r, dict))
                total = shard_of.count(s)
                if ready <= total // 2:
                    errs = [r for r, rs in zip(results, shard_of) if rs == s and isinstance(r, BaseException)]
                    raise Unavailable(f"restore {snap_id}: only {ready} of {total} replicas of shard "
                                      f"{s} are ready: {errs[0]!r}", snapshot=snap_id, shard=s)
            results = [r for r in results if isinstance(r, dict)]
            fetched = sum(1 for r in results if r.get("fetched"))
            self.progress(f"restore {snap_id}: swapping state on {len(self.shards)} shards")
            # Phase 2: every shard swaps in what its replicas loaded.
            done = await self._all([self._step(s, "restore", snap_id, digest=digests[str(s)])
                                    for s in self.shards])
            await self.client.refresh_map()
            return {"restored": snap_id, "time": snap["time"], "label": snap["label"],
                    "keys": snap["keys"], "shards": len(done), "fetched_files": fetched}


def _summary(snap_id: str, entries: list[dict]) -> dict:
    """One line of ``kvps snapshot list``: the shards' catalog entries folded together."""
    first = entries[0]
    times = {e["time"] for e in entries}
    return {
        "id": snap_id,
        "label": first["label"],
        "created": first["created"],
        "time": times.pop() if len(times) == 1 else None,
        "size": sum(e["size"] for e in entries),
        "keys": (len(set().union(*(e["names"] for e in entries)))
                 if all(e.get("names") is not None for e in entries)
                 else max(e["keys"] for e in entries)),
        "shards": len(entries),
        "digests": {str(e["shard"]): e["digest"] for e in entries},
    }
