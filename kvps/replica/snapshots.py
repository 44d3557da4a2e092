"""One replica's side of user snapshots: its files, held acknowledgements, and restores.

The state machine decides (``kvps.catalog``, ``kvps.shard``); this performs what it asks for:

- ``WriteSnapshotFile`` / ``DropSnapshotFile``: one writer thread writes (or deletes) the files in
  apply order, at background priority, to ``DATA/snapshots/<id>/shard-<k>.kvsnap``
  (``kvps.replica.snapshot_store``).
- ``HoldAcknowledgements`` / ``ReleaseAcknowledgements``: from a cut until the seal fixes the
  snapshot's time, the replies of pushes applied meanwhile are held (at most ``snapshot_hold``
  seconds; then the snapshot is abandoned by its coordinator and the replies go out).
- A restore is applied with the state the file holds: ``prepare`` loads it ahead (fetching the file
  from a peer replica when this one lacks it); a replica that missed the prepare loads (or fetches)
  it while applying the restore entry (``state_for_restore``, on the tick thread).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from kvps.command import SnapshotStep
from kvps.errors import CodecError, KeyNotFound, KvpsError, Unavailable
from kvps.machine import (
    DropSnapshotFile, Effect, HoldAcknowledgements, ReleaseAcknowledgements, WriteSnapshotFile,
)
from kvps.raft.group import background_priority
from kvps.replica import snapshot_store
from kvps.service.http import PeerClient
from kvps.shard import ShardState

__all__ = ["UserSnapshots"]

log = logging.getLogger("kvps.replica")

STAGED_TTL = 600.0  # seconds a prepared (loaded) snapshot waits for its restore entry

PushId = tuple[str, int]


class UserSnapshots:
    """``peers()``: the data URLs of the shard's other replicas (to fetch a missing file from)."""

    def __init__(self, shard: int, address: str, data_dir: Path, *, hold_seconds: float,
                 peers: Callable[[], list[str]], http: PeerClient,
                 busy: Callable[[], bool] | None = None) -> None:
        self.shard = shard
        self.address = address
        self._data_dir = data_dir
        self._hold_seconds = hold_seconds
        self._peers = peers
        self._busy = busy  # the replica is serving: files are written at half speed
        self._http = http
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._files: dict[str, dict] = {}  # id -> {"state": writing|written|failed, ...}
        self._staged: dict[tuple[str, str], ShardState] = {}  # (id, digest) -> loaded, for restore
        self._hold: dict | None = None  # {"snap", "deadline", "ids"} while acknowledgements wait
        swept = snapshot_store.sweep(data_dir, shard)
        if swept:
            log.info("shard %d: removed %d snapshot file(s) cut short by a crash", shard, swept)
        self._jobs: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_files, daemon=True,
                                        name=f"kvps-snapshots-{shard}")
        self._writer.start()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    async def stop(self) -> None:
        self._jobs.put(None)
        await asyncio.to_thread(self._writer.join, 60)

    def file_path(self, snap_id: str) -> Path:
        return snapshot_store.file_path(self._data_dir, snap_id, self.shard)

    # ---- effects (tick thread, in apply order) ------------------------------------------------

    def perform(self, effect: Effect) -> None:
        if isinstance(effect, WriteSnapshotFile):
            with self._lock:
                self._files[effect.snap_id] = {"state": "writing"}
            self._jobs.put(effect)
        elif isinstance(effect, DropSnapshotFile):
            with self._lock:
                self._files.pop(effect.snap_id, None)
            self._jobs.put(effect)
        elif isinstance(effect, HoldAcknowledgements):
            with self._lock:
                self._hold = {"snap": effect.snap_id, "ids": set(),
                              "deadline": time.monotonic() + self._hold_seconds}
        elif isinstance(effect, ReleaseAcknowledgements):
            with self._lock:
                if self._hold is not None and self._hold["snap"] == effect.snap_id:
                    self._hold = None
        else:
            raise TypeError(f"not a snapshot effect: {effect!r}")

    def applied(self, ids: Iterable[PushId]) -> None:
        """Pushes applied now (tick thread): their replies wait while a hold is on."""
        with self._lock:
            if self._hold is not None:
                self._hold["ids"].update(ids)

    # ---- held acknowledgements (event loop) -----------------------------------------------------

    def held(self, pid: PushId) -> bool:
        with self._lock:
            hold = self._hold
            if hold is None:
                return False
            if time.monotonic() >= hold["deadline"]:
                log.warning("shard %d: snapshot %s was not sealed within %.1f s; releasing held "
                            "acknowledgements", self.shard, hold["snap"], self._hold_seconds)
                self._hold = None
                return False
            return pid in hold["ids"]

    # ---- files ------------------------------------------------------------------------------------

    def status(self, snap_id: str, entry: dict | None) -> dict:
        """This replica's view of a snapshot: the catalog ``entry`` and the state of its file."""
        with self._lock:
            info = dict(self._files.get(snap_id, {}))
        if not info:
            info = {"state": "present" if self.file_path(snap_id).exists() else "missing"}
        return {"entry": entry, "file": info}

    def _write_files(self) -> None:
        background_priority()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if isinstance(job, DropSnapshotFile):
                snapshot_store.remove(self._data_dir, job.snap_id, self.shard)
                continue
            info = self._write(job)
            with self._lock:
                if job.snap_id in self._files:  # not dropped meanwhile
                    self._files[job.snap_id] = info
            del job

    def _write(self, job: WriteSnapshotFile) -> dict:
        path = self.file_path(job.snap_id)
        started = time.monotonic()
        try:
            try:  # replaying the log after a restart: the file may be there already
                done = snapshot_store.read(path, shard=self.shard, snap_id=job.snap_id)
                digest, size = done.digest, done.size
                del done
            except CodecError:
                digest, size = snapshot_store.write_parts(path, job.snap_id, self.shard, job.meta,
                                                          list(job.arrays), busy=self._busy)
        except Exception as exc:  # noqa: BLE001 - reported through status
            log.error("shard %d: writing snapshot %s failed: %r", self.shard, job.snap_id, exc)
            return {"state": "failed", "error": repr(exc)}
        seconds = round(time.monotonic() - started, 3)
        log.info("shard %d: snapshot %s written: %d bytes in %.3f s", self.shard, job.snap_id,
                 size, seconds)
        return {"state": "written", "digest": digest, "size": size, "seconds": seconds}

    # ---- restore ----------------------------------------------------------------------------------

    async def prepare(self, snap_id: str, digest: str, sources: list[str]) -> dict:
        """Make sure this replica can restore ``snap_id``: its file verifies against ``digest``
        (fetched from a replica in ``sources`` when missing), and is loaded, ready to swap in."""
        fetched = False
        if not self.file_path(snap_id).exists():
            if not sources:
                raise KeyNotFound(f"snapshot {snap_id} has no file on replica {self.address}",
                                  snapshot=snap_id)
            await self._fetch(snap_id, digest, sources)
            fetched = True
        try:
            loaded = await asyncio.to_thread(self._load, snap_id, digest)
        except CodecError as exc:
            raise CodecError(f"snapshot {snap_id} of shard {self.shard} on replica {self.address}: "
                             f"{exc.message}; refusing to restore", snapshot=snap_id) from None
        key = (snap_id, digest)
        with self._lock:
            self._staged = {key: loaded}  # one at a time: a loaded snapshot is as big as the state
        asyncio.get_running_loop().call_later(STAGED_TTL, self._unstage, key)
        return {"ready": True, "fetched": fetched, "replica": self.address}

    def state_for_restore(self, cmd: SnapshotStep) -> ShardState | None:
        """The state a restore entry swaps in (tick thread): the prepared one, else this replica's
        file, else one fetched from a peer through the event loop. Slow (the Raft tick waits), but
        only a replica that missed the prepare gets past the first; the alternative is to diverge.
        None if nothing works."""
        with self._lock:
            loaded = self._staged.pop((cmd.snap_id, cmd.digest), None)
        if loaded is not None:
            return loaded
        try:
            return self._load(cmd.snap_id, cmd.digest)
        except (CodecError, OSError) as exc:
            log.warning("shard %d: restore of snapshot %s: own file unusable (%s); fetching it",
                        self.shard, cmd.snap_id, exc)
        if self._loop is None:
            return None
        try:
            asyncio.run_coroutine_threadsafe(self._fetch(cmd.snap_id, cmd.digest, self._peers()),
                                             self._loop).result(timeout=600)
            return self._load(cmd.snap_id, cmd.digest)
        except (KvpsError, OSError, TimeoutError) as exc:
            log.critical("shard %d: restore of snapshot %s: no usable file here or at any peer (%s)",
                         self.shard, cmd.snap_id, exc)
            return None

    def _unstage(self, key: tuple[str, str]) -> None:
        """Forget a prepared restore that never came (its coordinator gave up or died)."""
        with self._lock:
            if self._staged.pop(key, None) is not None:
                log.info("shard %d: dropped the loaded snapshot %s: no restore followed", self.shard,
                         key[0])

    def _load(self, snap_id: str, digest: str) -> ShardState:
        f = snapshot_store.read(self.file_path(snap_id), shard=self.shard, snap_id=snap_id,
                                digest=digest)
        return ShardState.restore(f.frame)

    async def _fetch(self, snap_id: str, digest: str, sources: list[str]) -> None:
        path = self.file_path(snap_id)
        tmp = path.with_name(path.name + ".fetch")
        path.parent.mkdir(parents=True, exist_ok=True)
        errors = []
        for source in sources:
            try:
                await self._http.download(f"{source}/v1/snapshots/{snap_id}/file", tmp)
                await asyncio.to_thread(snapshot_store.read, tmp, shard=self.shard,
                                        snap_id=snap_id, digest=digest)
                tmp.replace(path)
                log.info("shard %d: fetched snapshot %s from %s", self.shard, snap_id, source)
                return
            except (KvpsError, OSError) as exc:
                errors.append(f"{source}: {exc}")
        tmp.unlink(missing_ok=True)
        raise Unavailable(f"snapshot {snap_id} of shard {self.shard}: no replica could send its file "
                          f"({'; '.join(errors)})", snapshot=snap_id)
