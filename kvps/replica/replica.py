"""One shard replica: the state machine, its Raft group, the leader's batcher, and the read paths.

Threads: pysyncobj applies committed entries on its tick thread; everything else runs on the
replica's asyncio loop. ``ShardState`` is guarded by one lock; dense blocks are immutable arrays, so
a read takes references under the lock and encodes them outside it.

Leadership: a replica that becomes leader first commits a ``Barrier`` of its own term and serves
writes and leader reads only once it has applied it. By then every entry that can ever commit from
earlier terms is applied here, so the duplicate check before merging sees all of them (DESIGN §3).
"""
from __future__ import annotations

import asyncio
import functools
import logging
import os
import queue
import threading
import time
from collections import Counter, deque
from pathlib import Path
from typing import Any

import numpy as np

from kvps.replica.batcher import PushBatcher
from kvps.clocks import ClusterTime
from kvps.command import (
    Barrier, ClockTick, Command, CreateKey, CreateTable, DeleteKey, Hyperparams, Push, Set, SetRows,
    SnapshotStep,
    decode_command,
)
from kvps.replica import snapshot_store
from kvps.config import ClusterConfig
from kvps.delta import frame
from kvps.errors import (
    CodecError, InvalidRequest, KeyNotFound, KvpsError, NotLeader, Unavailable,
)
from kvps.replica.history import BlockHistory
from kvps.merge import PushRequest, comparable_digests, is_finite, request_bytes
from kvps.replica.metrics import ReplicaMetrics
from kvps.raft import bridge, snapshot_file
from kvps.raft import membership as raft_membership
from kvps.raft.group import ShardGroup, background_priority
from kvps.shard import ShardState

__all__ = ["Replica"]

log = logging.getLogger("kvps.replica")

STAGED_TTL = 600.0  # seconds a prepared (loaded) snapshot waits for its restore entry

# A joining replica starts no election for this long: the leader reaches it well before.
JOIN_ELECTION_HOLD = 10.0


class Replica:
    def __init__(self, cfg: ClusterConfig, node_id: int, shard: int, *, secret: bytes,
                 data_dir: Path, peers: list[str] | None = None, joining: bool = False) -> None:
        self.cfg = cfg
        self.node_id = node_id
        self.shard = shard
        self.address = cfg.node(node_id).raft_address(shard)
        # Members move between nodes (kvps/rebalance.py): know every node's replica of this shard.
        self._data_urls = {n.raft_address(shard): n.data_url(shard) for n in cfg.nodes}
        # Raft addresses of the other members at start (None: the config's placement), and whether
        # this replica joins an existing group (kvps/raft/membership.py: it must not elect itself).
        self._peers = peers
        self._joining = joining
        self._lock = threading.Lock()
        self._state = self._new_state()
        # the time this replica stamps into commands as leader and judges leases by (kvps.clocks)
        self.cluster_time = ClusterTime(time.monotonic)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._applied = asyncio.Event()  # pulsed after every apply (follower reads wait on it)
        self._serving_term = -1  # term whose barrier this replica has applied as leader
        # While leadership is handed to another member (kvps/membership.py), no new writes: the
        # target must have every entry for pysyncobj to grant the transfer and for it to win.
        self._writes_held_until = 0.0
        self._barrier_task: asyncio.Task | None = None
        self._batcher: PushBatcher | None = None
        self.counters = {"pushes": 0, "pulls": 0, "batches": 0, "batched_pushes": 0,
                         "leader_changes": 0, "rejected": 0}
        self.metrics = ReplicaMetrics(shard, node_id)
        self._hot: Counter[str] = Counter()  # push bytes per key (bounded, see _count_push)
        # (log index, monotonic time) of recent applies: a follower's lag in seconds is the age
        # of the first entry it has not acknowledged.
        self._applied_at: deque[tuple[int, float]] = deque(maxlen=20000)
        # recent block versions, for exact XOR deltas in pulls (kvps/history.py)
        self._history = BlockHistory(depth=cfg.server.delta_depth, max_bytes=cfg.server.delta_history_bytes)
        self._journal_dir = data_dir / f"shard-{shard}"
        self._journal_dir.mkdir(parents=True, exist_ok=True)
        self._group: ShardGroup | None = None
        self._secret = secret
        # user snapshots (kvps.snapshots): files written by one writer thread, in apply order
        self._data_dir = Path(data_dir)
        swept = snapshot_store.sweep(self._data_dir, shard)
        if swept:
            log.info("shard %d: removed %d snapshot file(s) cut short by a crash", shard, swept)
        self._snap_files: dict[str, dict] = {}  # id -> {"state": writing|written|failed, ...}
        self._snap_jobs: queue.Queue = queue.Queue()
        self._snap_writer = threading.Thread(target=self._snapshot_writer, daemon=True,
                                             name=f"kvps-snapshots-{shard}")
        self._snap_writer.start()
        self._staged: dict[tuple[str, str], ShardState] = {}  # (id, digest) -> loaded, for restore
        # acknowledgements held while a snapshot is being cut: {"snap", "deadline", "ids"}
        self._hold: dict | None = None
        self._activity = (0, 0.0)  # (entries applied + pulls served, when that last moved)
        snapshot_file.set_busy_probe(self._serving_recently)
        # for fetching a snapshot file from a peer replica (set by the process wiring)
        self.peer_token: Any = lambda: ""
        self.client_ssl: Any = None

    def _new_state(self) -> ShardState:
        return ShardState(self.shard, session_ttl=self.cfg.server.session_ttl,
                          dedup=not self.cfg.server.unsafe_disable_dedup)

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._batcher = PushBatcher(self._propose, self.merge_mode, self.cfg.server,
                                    clock=self.cluster_time.now, on_batch=self._count_batch)
        peers = self._peers if self._peers is not None else [
            self.cfg.node(n).raft_address(self.shard)
            for n in self.cfg.replica_nodes(self.shard) if n != self.node_id]
        self._group = ShardGroup(
            self_address=self.address, peers=peers, raft=self.cfg.raft, secret=self._secret,
            context=f"kvps/shard={self.shard}", journal_dir=self._journal_dir,
            applier=self._apply, snapshot_state=self._snapshot_state,
            restore_state=self._restore_state, on_role_change=self._on_role_change)
        if self._joining:
            raft_membership.hold_elections(self._group, JOIN_ELECTION_HOLD)

    async def stop(self) -> None:
        if self._barrier_task is not None:
            self._barrier_task.cancel()
        if self._batcher is not None:
            await self._batcher.close()
        if self._group is not None:
            await asyncio.to_thread(self._group.stop)
        self._snap_jobs.put(("stop", "", None, None))
        await asyncio.to_thread(self._snap_writer.join, 60)

    @property
    def group(self) -> ShardGroup:
        assert self._group is not None, "Replica.start() not called"
        return self._group

    # ---- tick-thread callbacks (pysyncobj) ---------------------------------------------------

    def _apply(self, data: bytes) -> Any:
        try:
            cmd = decode_command(data)
        except (CodecError, InvalidRequest) as exc:
            log.error("shard %d: undecodable log entry (%d bytes): %s", self.shard, len(data), exc)
            return InvalidRequest(f"undecodable command: {exc}")
        if isinstance(cmd, SnapshotStep):
            result = self._apply_snapshot_step(cmd)
        else:
            with self._lock:
                result = self._state.apply(cmd)
                self.cluster_time.applied(self._state.time)
                self._remember_blocks(cmd)
                if self._hold is not None and isinstance(cmd, (Push, Set)):
                    self._hold["ids"].update(_push_ids(cmd))
        if self._group is not None:  # pysyncobj advances lastApplied after we return
            self._applied_at.append((self._group.raftLastApplied + 1, time.monotonic()))
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._pulse_applied)
        return result

    # ---- user snapshots (tick thread: apply; writer thread: files) ------------------------------

    def _apply_snapshot_step(self, cmd: SnapshotStep) -> Any:
        if cmd.op == "restore":
            return self._apply_restore(cmd)
        with self._lock:
            before = self._state.snapshot_entry(cmd.snap_id)
            result = self._state.apply(cmd)
            if isinstance(result, KvpsError):
                return result
            if cmd.op == "cut" and before is None:
                # This index is the snapshot: take the view now, write it off this thread, and
                # hold the acknowledgements of later pushes until the timestamp is fixed. (A
                # retried cut at a later index changes nothing: the first one is the snapshot; a
                # replica that never applied the first, e.g. restored from a log compaction
                # taken in between, has no file and fetches it from a peer when restoring.)
                meta, arrays = self._state.snapshot_parts()
                self._snap_files[cmd.snap_id] = {"state": "writing"}
                self._snap_jobs.put(("write", cmd.snap_id, meta, arrays))
                self._hold = {"snap": cmd.snap_id, "ids": set(),
                              "deadline": time.monotonic() + self.cfg.server.snapshot_hold}
            elif cmd.op in ("seal", "drop") and self._hold is not None and self._hold["snap"] == cmd.snap_id:
                self._hold = None
            if cmd.op == "drop":
                self._snap_files.pop(cmd.snap_id, None)
                self._snap_jobs.put(("drop", cmd.snap_id, None, None))
        return result

    def _apply_restore(self, cmd: SnapshotStep) -> Any:
        with self._lock:
            err = self._state.check_restore(cmd)
            loaded = self._staged.pop((cmd.snap_id, cmd.digest), None)
        if err is not None:
            return err
        if loaded is None:  # not prepared here (down during the prepare, or restarted since)
            loaded = self._load_or_fetch_blocking(cmd.snap_id, cmd.digest)
        with self._lock:
            result = self._state.apply_restore(cmd, loaded)
            if not isinstance(result, KvpsError):
                self._history = BlockHistory(depth=self.cfg.server.delta_depth,
                                             max_bytes=self.cfg.server.delta_history_bytes)
        if loaded is None and not isinstance(self._state.check_restore(cmd), KvpsError):
            # Every other replica restores; this one cannot. Carrying on would diverge: stop, and
            # let the supervisor restart it (it replays the log and tries again).
            log.critical("shard %d: exiting rather than diverge from the other replicas", self.shard)
            os._exit(70)
        if not isinstance(result, KvpsError) and self._group is not None:
            self._group.forceLogCompaction()  # so a restart does not need the file again
        log.info("shard %d: restored snapshot %s: %s", self.shard, cmd.snap_id, result)
        return result

    def _serving_recently(self) -> bool:
        """Did this replica apply an entry or serve a pull in the last 0.2 s? (writer threads)"""
        count = self.counters["pulls"] + (self._group.raftLastApplied if self._group is not None else 0)
        seen, at = self._activity
        now = time.monotonic()
        if count != seen:
            self._activity = (count, now)
            return True
        return now - at < 0.2

    def _load_or_fetch_blocking(self, snap_id: str, digest: str) -> ShardState | None:
        """On the apply thread: this replica's file, else one fetched from a peer replica. Slow
        (it stalls this replica's Raft tick), but only a replica that missed the prepare gets
        here; the alternative is to diverge."""
        try:
            return self._load_snapshot(snap_id, digest)
        except (CodecError, OSError) as exc:
            log.warning("shard %d: restore of snapshot %s: own file unusable (%s); fetching it",
                        self.shard, snap_id, exc)
        import ssl as ssl_
        import urllib.request

        path = snapshot_store.file_path(self._data_dir, snap_id, self.shard)
        ctx = self.client_ssl if isinstance(self.client_ssl, ssl_.SSLContext) else None
        for url in (u for a, u in sorted(self._data_urls.items()) if a != self.address):
            req = urllib.request.Request(f"{url}/v1/snapshots/{snap_id}/file",
                                         headers={"Authorization": f"Bearer {self.peer_token()}"})
            try:
                with urllib.request.urlopen(req, timeout=300, context=ctx) as resp:
                    data = resp.read()
                snapshot_store.read_bytes(data, shard=self.shard, snap_id=snap_id, digest=digest)
                tmp = path.with_name(path.name + ".fetch")
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp.write_bytes(data)
                os.replace(tmp, path)
                log.info("shard %d: fetched snapshot %s from %s while applying", self.shard, snap_id, url)
                return self._load_snapshot(snap_id, digest)
            except (OSError, CodecError) as exc:
                log.warning("shard %d: fetching snapshot %s from %s failed: %s", self.shard, snap_id,
                            url, exc)
        log.critical("shard %d: restore of snapshot %s: no usable file here or at any peer",
                     self.shard, snap_id)
        return None

    def _load_snapshot(self, snap_id: str, digest: str) -> ShardState:
        f = snapshot_store.read(snapshot_store.file_path(self._data_dir, snap_id, self.shard),
                                shard=self.shard, snap_id=snap_id, digest=digest)
        return ShardState.restore(f.frame)

    def _snapshot_writer(self) -> None:
        background_priority()
        while True:
            op, snap_id, meta, arrays = self._snap_jobs.get()
            if op == "stop":
                return
            path = snapshot_store.file_path(self._data_dir, snap_id, self.shard)
            if op == "drop":
                snapshot_store.remove(self._data_dir, snap_id, self.shard)
                continue
            started = time.monotonic()
            try:
                try:  # replaying the log after a restart: the file may be there already
                    done = snapshot_store.read(path, shard=self.shard, snap_id=snap_id)
                    digest, size = done.digest, done.size
                    del done
                except CodecError:
                    digest, size = snapshot_store.write_parts(path, snap_id, self.shard, meta, arrays)
            except Exception as exc:  # noqa: BLE001 - reported through snapshot_status
                log.error("shard %d: writing snapshot %s failed: %r", self.shard, snap_id, exc)
                info = {"state": "failed", "error": repr(exc)}
            else:
                info = {"state": "written", "digest": digest, "size": size,
                        "seconds": round(time.monotonic() - started, 3)}
                log.info("shard %d: snapshot %s written: %d bytes in %.3f s", self.shard, snap_id,
                         size, info["seconds"])
            with self._lock:
                if snap_id in self._snap_files:  # not dropped meanwhile
                    self._snap_files[snap_id] = info
            meta = arrays = None

    def snapshot_status(self, snap_id: str) -> dict:
        """This replica's view of a snapshot: the catalog entry and the state of its file."""
        with self._lock:
            entry = self._state.snapshot_entry(snap_id)
            info = dict(self._snap_files.get(snap_id, {}))
        if not info:
            path = snapshot_store.file_path(self._data_dir, snap_id, self.shard)
            info = {"state": "present" if path.exists() else "missing"}
        return {"entry": entry, "file": info}

    def snapshot_catalog(self) -> list[dict]:
        with self._lock:
            return self._state.snapshot_catalog()

    async def snapshot_prepare(self, snap_id: str, digest: str, sources: list[str], token: str = "") -> dict:
        """Make sure this replica can restore ``snap_id``: its file verifies against ``digest``
        (fetched from a replica in ``sources`` when missing), and is loaded, ready to swap in."""
        path = snapshot_store.file_path(self._data_dir, snap_id, self.shard)
        fetched = False
        if not path.exists():
            if not sources:
                raise KeyNotFound(f"snapshot {snap_id} has no file on replica {self.address}",
                                  snapshot=snap_id)
            await self._fetch_snapshot(snap_id, digest, sources, token, path)
            fetched = True
        try:
            loaded = await asyncio.to_thread(self._load_snapshot, snap_id, digest)
        except CodecError as exc:
            raise CodecError(f"snapshot {snap_id} of shard {self.shard} on replica {self.address}: "
                             f"{exc.message}; refusing to restore", snapshot=snap_id) from None
        key = (snap_id, digest)
        with self._lock:
            self._staged = {key: loaded}  # one at a time: a loaded snapshot is as big as the state
        asyncio.get_running_loop().call_later(STAGED_TTL, self._unstage, key)
        return {"ready": True, "fetched": fetched, "replica": self.address}

    def _unstage(self, key: tuple[str, str]) -> None:
        """Forget a prepared restore that never came (its coordinator gave up or died)."""
        with self._lock:
            if self._staged.pop(key, None) is not None:
                log.info("shard %d: dropped the loaded snapshot %s: no restore followed", self.shard, key[0])

    async def _fetch_snapshot(self, snap_id: str, digest: str, sources: list[str], token: str,
                              path: Path) -> None:
        import aiohttp  # the data plane's own dependency; only needed here

        errors = []
        tmp = path.with_name(path.name + ".fetch")
        path.parent.mkdir(parents=True, exist_ok=True)
        connector = aiohttp.TCPConnector(ssl=self.client_ssl) if self.client_ssl is not None else None
        async with aiohttp.ClientSession(connector=connector) as session:
            for source in sources:
                try:
                    url = f"{source}/v1/snapshots/{snap_id}/file"
                    async with session.get(url, headers={"Authorization": f"Bearer {token}"},
                                           timeout=aiohttp.ClientTimeout(total=600)) as resp:
                        if resp.status != 200:
                            errors.append(f"{source}: HTTP {resp.status}")
                            continue
                        with open(tmp, "wb") as f:
                            async for chunk in resp.content.iter_chunked(4 << 20):
                                f.write(chunk)
                            f.flush()
                            os.fsync(f.fileno())
                    await asyncio.to_thread(snapshot_store.read, tmp, shard=self.shard,
                                            snap_id=snap_id, digest=digest)
                    os.replace(tmp, path)
                    log.info("shard %d: fetched snapshot %s from %s", self.shard, snap_id, source)
                    return
                except (aiohttp.ClientError, OSError, TimeoutError, CodecError) as exc:
                    errors.append(f"{source}: {exc}")
        tmp.unlink(missing_ok=True)
        raise Unavailable(f"snapshot {snap_id} of shard {self.shard}: no replica could send its file "
                          f"({'; '.join(errors)})", snapshot=snap_id)

    def snapshot_file_path(self, snap_id: str) -> Path:
        return snapshot_store.file_path(self._data_dir, snap_id, self.shard)

    async def snapshot_step(self, cmd: SnapshotStep) -> dict:
        await self.ensure_serving()
        if cmd.op == "restore":
            with self._lock:
                err = self._state.check_restore(cmd)
            if err is not None:
                raise err
        return _unwrap(await self._propose(cmd.to_bytes()))

    def _held(self, pid: tuple[str, int]) -> bool:
        with self._lock:
            hold = self._hold
            if hold is None:
                return False
            if time.monotonic() >= hold["deadline"]:
                log.warning("shard %d: snapshot %s was not sealed within %.1f s; releasing held "
                            "acknowledgements", self.shard, hold["snap"], self.cfg.server.snapshot_hold)
                self._hold = None
                return False
            return pid in hold["ids"]

    async def _release(self, pid: tuple[str, int]) -> None:
        """Wait while ``pid``'s acknowledgement is held by a snapshot being cut."""
        while self._held(pid):
            await self._wait_applied(0.05)

    def _remember_blocks(self, cmd: Command) -> None:
        """Keep the new versions of the blocks ``cmd`` wrote (references, no copies)."""
        if isinstance(cmd, DeleteKey):
            self._history.drop_key(cmd.key)
            return
        if isinstance(cmd, Push):
            touched = [(d.key, d.block) for d in cmd.dense]
        elif isinstance(cmd, (Set, CreateKey)):
            touched = [(cmd.key, b) for b, _ in cmd.blocks]
        else:
            return
        for key, block in touched:
            try:
                version, value = self._state.read_blocks(key, [block])[0]
            except KvpsError:  # the command was refused: nothing to remember
                continue
            self._history.add(key, block, version, value)

    def delta_base(self, key: str, block: int, version: int) -> np.ndarray | None:
        """Block ``version`` of ``key`` if this replica still remembers it."""
        with self._lock:
            return self._history.get(key, block, version)

    def stored_rows(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        with self._lock:
            return self._state.stored_rows(key)

    def row_versions(self, key: str, ids: np.ndarray) -> np.ndarray:
        with self._lock:
            return self._state.row_versions(key, ids)

    def _snapshot_state(self) -> Any:
        """For log compaction: a view now (tick thread), encoded later by the writer thread."""
        with self._lock:
            meta, arrays = self._state.snapshot_parts()
        return functools.partial(frame.encode_parts, frame.KIND_SNAPSHOT, meta, arrays)

    def _restore_state(self, data: bytes) -> None:
        state = ShardState.restore(data)
        with self._lock:
            self._state = state
        self.cluster_time.applied(state.time)

    def _on_role_change(self, role: str) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._role_changed, role)

    # ---- loop-thread reactions ----------------------------------------------------------------

    def _pulse_applied(self) -> None:
        self._applied.set()
        self._applied = asyncio.Event()

    def _role_changed(self, role: str) -> None:
        self.counters["leader_changes"] += 1
        self.metrics.child(self.metrics.leader_changes).inc()
        log.info("shard %d replica %s is now %s (term %d)", self.shard, self.address, role,
                 self.group.term())
        if role == "leader" and (self._barrier_task is None or self._barrier_task.done()):
            self._barrier_task = asyncio.get_running_loop().create_task(self._commit_barrier())
        elif role != "leader":
            abandoned = self.group.abandon_pending()
            if abandoned:
                log.info("shard %d: stepped down with %d proposals pending; answered as unknown "
                         "outcome (clients retry, deduplicated)", self.shard, abandoned)

    async def _commit_barrier(self) -> None:
        """Commit a Barrier of our term; once applied, serve writes and leader reads."""
        while self.group.is_leader():
            term = self.group.term()
            if self._serving_term == term:
                return
            try:
                await self._propose(Barrier(term=term, replica=self.address).to_bytes())
            except KvpsError as exc:
                log.info("shard %d: barrier for term %d failed (%s); retrying", self.shard, term, exc)
                await asyncio.sleep(self.cfg.raft.heartbeat_period)
                continue
            if self.group.term() == term and self.group.is_leader():
                self._serving_term = term
                log.info("shard %d: leader of term %d is serving", self.shard, term)

    async def _propose(self, data: bytes) -> Any:
        started = time.monotonic()
        try:
            return await bridge.propose(self.group, data)
        finally:
            self.metrics.child(self.metrics.commit_seconds).observe(time.monotonic() - started)

    def _count_batch(self, pushes: int, nbytes: int) -> None:
        self.counters["batches"] += 1
        self.counters["batched_pushes"] += pushes
        self.metrics.child(self.metrics.batch_pushes).observe(pushes)

    def _count_push(self, req: PushRequest) -> None:
        nbytes = request_bytes(req)
        self.counters["pushes"] += 1
        self.metrics.child(self.metrics.pushes).inc()
        self.metrics.child(self.metrics.push_bytes).inc(nbytes)
        for key, _, grad in req.dense:
            self._hot[key] += grad.nbytes
        for key, ids, grads in req.rows:
            self._hot[key] += grads.nbytes + ids.nbytes
        if len(self._hot) > 1000:  # keep the heaviest: hot keys stay, one-off keys go
            self._hot = Counter(dict(self._hot.most_common(100)))

    def count_pull(self, nbytes: int) -> None:
        self.counters["pulls"] += 1
        self.metrics.child(self.metrics.pulls).inc()
        self.metrics.child(self.metrics.pull_bytes).inc(nbytes)

    def count_rejected(self, reason: str) -> None:
        self.counters["rejected"] += 1
        self.metrics.child(self.metrics.rejected, reason=reason).inc()

    # ---- leadership checks ------------------------------------------------------------------

    def leader_hint(self) -> str | None:
        addr = self.group.leader_address()
        return self._data_url_of(addr) if addr else None

    def _data_url_of(self, address: str) -> str:
        """A member's data URL; a node that joined after this replica started is not in its config,
        but every node serves a shard's data on the port after its raft port (NodeConfig)."""
        if address in self._data_urls:
            return self._data_urls[address]
        host, port = address.rsplit(":", 1)
        return f"{self.cfg.node(self.node_id).scheme}://{host}:{int(port) + 1}"

    def _not_leader(self) -> NotLeader:
        return NotLeader(f"replica {self.address} of shard {self.shard} is not the leader",
                         leader_hint=self.leader_hint(), shard=self.shard)

    def hold_writes(self, seconds: float) -> None:
        """Answer writes and leader reads with ``Unavailable`` (clients retry) for ``seconds``."""
        self._writes_held_until = time.monotonic() + seconds

    async def ensure_serving(self) -> None:
        """Return once this replica is the leader and has applied its barrier."""
        if time.monotonic() < self._writes_held_until:
            raise Unavailable("leadership is being handed to another replica", shard=self.shard)
        deadline = time.monotonic() + self.cfg.server.barrier_wait
        # Hold a request about one election long when no leader is known: a replica cut off from
        # its peers never learns one, and the client should move on to another replica.
        hold_until = time.monotonic() + min(self.cfg.server.barrier_wait,
                                            1.5 * self.cfg.raft.election_timeout_max)
        while True:
            if not self.group.is_leader():
                if not self.group.leader_reachable() and time.monotonic() < hold_until:
                    # An election is under way, or our leader's connection just dropped (it may be
                    # dead: a new one is then elected within ~0.1 s): hold the request until it is
                    # decided, so the client learns the new leader from our hint instead of
                    # chasing a dead one and backing off blindly.
                    await asyncio.sleep(0.01)
                    continue
                raise self._not_leader()
            if self._serving_term == self.group.term():
                return
            if self._barrier_task is None or self._barrier_task.done():
                self._barrier_task = asyncio.get_running_loop().create_task(self._commit_barrier())
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise Unavailable("new leader has not applied its barrier yet", shard=self.shard)
            await self._wait_applied(remaining)

    async def _wait_applied(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._applied.wait(), min(timeout, 0.05))
        except TimeoutError:
            pass

    # ---- writes ----------------------------------------------------------------------------

    async def push(self, req: PushRequest) -> dict:
        await self.ensure_serving()
        finite = is_finite(req)
        with self._lock:
            err = self._state.check_push(req, "allow" if finite else self.cfg.server.nonfinite)
            done = self._state.lookup_push(req.client, req.seq)
        if done is not None:
            stored = done.get("digest") if isinstance(done, dict) else None
            if comparable_digests(stored or 0, req.digest) and stored != req.digest:
                self.count_rejected("ReusedPushId")
                log.warning("shard %d: push id %s/%d reused for different content (replayed or "
                            "forged); refused", self.shard, req.client, req.seq)
                raise InvalidRequest("push id already used for a different push; nothing applied",
                                     client=req.client, seq=req.seq)
            await self._release((req.client, req.seq))
            return _unwrap(done)
        if not finite:
            action = "skipped" if self.cfg.server.nonfinite == "skip" and err is None else "rejected"
            self.metrics.child(self.metrics.nonfinite, action=action).inc()
            log.warning("shard %d: push %s/%d has NaN/Inf gradients: %s", self.shard, req.client,
                        req.seq, action)
            if action == "skipped":  # dropped on purpose: nothing applied, versions unchanged
                return {"versions": self._current_versions(req)}
        if err is not None:
            raise err
        self._count_push(req)
        assert self._batcher is not None
        result = await self._batcher.submit(req)
        await self._release((req.client, req.seq))
        return _unwrap(result)

    async def write(self, cmd: Command) -> dict:
        """Create, delete, set and clock ticks: proposed alone (not merged)."""
        await self.ensure_serving()
        if isinstance(cmd, Set):
            with self._lock:
                done = self._state.lookup_push(cmd.client, cmd.seq)
                err = self._state.check_set(cmd)
            if done is not None:
                await self._release((cmd.client, cmd.seq))
                return _unwrap(done)
            if err is not None:
                raise err
        elif isinstance(cmd, Hyperparams):  # validated here, on the leader, before proposing
            with self._lock:
                err = self._state.check_hyperparams(cmd)
            if err is not None:
                raise err
        elif not isinstance(cmd, (CreateKey, CreateTable, DeleteKey, ClockTick, SetRows)):
            raise InvalidRequest(f"not a write command: {type(cmd).__name__}")
        result = await self._propose(cmd.to_bytes())
        if isinstance(cmd, Set):
            await self._release((cmd.client, cmd.seq))
        return _unwrap(result)

    def _current_versions(self, req: PushRequest) -> dict[str, int]:
        with self._lock:
            out = {}
            for key, block, _ in req.dense:
                out[key] = max(out.get(key, 0), self._state.block_versions(key, [block])[0])
            for key, ids, _ in req.rows:
                _, versions = self._state.read_rows(key, ids)
                out[key] = max([out.get(key, 0), *map(int, versions)])
            return out

    def merge_mode(self, key: str) -> str:
        with self._lock:
            return self._state.merge_mode(key)

    # ---- reads -----------------------------------------------------------------------------

    async def before_read(self, consistency: str, min_versions: dict[tuple[str, int], int]) -> None:
        """Block until this replica may answer a read at ``consistency``."""
        if consistency == "leader":
            await self.ensure_serving()
        elif consistency == "linearizable":
            await self.ensure_serving()
            # A read barrier through the log: once it applies, no newer leader can have
            # committed anything we have not applied.
            _unwrap(await self._propose(Barrier(term=self.group.term(), replica=self.address).to_bytes()))
        elif consistency == "follower":
            await self._wait_versions(min_versions)
        else:
            raise InvalidRequest(f"unknown consistency {consistency!r}")

    async def _wait_versions(self, wanted: dict[tuple[str, int], int]) -> None:
        if not wanted:
            return
        deadline = time.monotonic() + self.cfg.server.barrier_wait
        while True:
            with self._lock:
                lagging = [kb for kb, v in wanted.items() if self._block_version(*kb) < v]
            if not lagging:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise Unavailable("replica has not reached min_version", shard=self.shard,
                                  key=lagging[0][0], block=lagging[0][1])
            await self._wait_applied(remaining)

    def _block_version(self, key: str, block: int) -> int:
        """-1 for a block this replica has not seen created yet (it may be behind the leader)."""
        try:
            return self._state.block_versions(key, [block])[0]
        except KeyNotFound:
            return -1

    def read_blocks(self, key: str, blocks: list[int]) -> list[tuple[int, np.ndarray]]:
        with self._lock:
            return self._state.read_blocks(key, blocks)

    def block_versions(self, key: str, blocks: list[int]) -> list[int]:
        with self._lock:
            return self._state.block_versions(key, blocks)

    def read_rows(self, key: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        with self._lock:
            return self._state.read_rows(key, ids)

    def clocks(self, job: str) -> dict[str, int]:
        """Live worker clocks of ``job``; leases are judged by this replica's cluster time."""
        with self._lock:
            return self._state.clocks(job, self.cluster_time.now())

    def describe(self, key: str) -> dict:
        with self._lock:
            info = self._state.describe(key)
        if info is None:
            raise KeyNotFound(f"no key {key!r} on shard {self.shard}", key=key)
        return info

    def keys(self) -> list[dict]:
        with self._lock:
            return self._state.keys()

    def state_hash(self) -> str:
        with self._lock:
            return self._state.state_hash()

    def status(self) -> dict:
        st = self.group.status()
        return {
            "shard": self.shard, "node": self.node_id, "pid": os.getpid(), "raft": self.address,
            "data_url": self.cfg.node(self.node_id).data_url(self.shard),
            "role": st["role"], "term": st["term"], "leader": self._node_of(st["leader"]),
            "leader_url": self._data_url_of(st["leader"]) if st["leader"] else None,
            "serving": st["role"] == "leader" and self._serving_term == st["term"],
            "commit_index": st["commit_index"], "applied_index": st["applied_index"],
            "log_entries": st["log_entries"], "compactions": st.get("compactions"),
            "tick_stalls": st.get("tick_stalls"),
            # its lost data was replaced: no vote until it has caught up (kvps.raft.recovery)
            "recovering": st["recovering"], "recovering_reason": st["recovering_reason"],
            "votes_withheld": st["votes_withheld"],
            "in_flight_bytes": self._batcher.accepted_bytes if self._batcher else 0,
            "counters": dict(self.counters),
            "peers": self.peer_lag() if st["role"] == "leader" else {},
            "hot_keys": [{"key": k, "push_bytes": v} for k, v in self._hot.most_common(10)],
        }

    def peer_lag(self) -> dict[str, dict]:
        """Leader's view of each follower: acknowledged index, lag in entries and in seconds."""
        last = self.group.status()["applied_index"]
        now = time.monotonic()
        out = {}
        for addr, p in self.group.peer_progress().items():
            match = p["match_index"]
            lag = None if match is None else max(0, last - match)
            seconds = 0.0
            if lag:
                # list(): the tick thread appends meanwhile (a deque refuses mutation mid-iteration)
                first_missing = next((t for i, t in list(self._applied_at) if i > match), None)
                seconds = round(now - first_missing, 3) if first_missing is not None else None
            out[addr] = {"connected": p["connected"], "match_index": match, "lag_entries": lag,
                         "lag_seconds": seconds}
        return out

    def expose_metrics(self) -> bytes:
        st = self.group.status()
        m = self.metrics
        m.child(m.term).set(st["term"])
        m.child(m.is_leader).set(1 if st["role"] == "leader" and self._serving_term == st["term"] else 0)
        m.child(m.commit_index).set(st["commit_index"])
        m.child(m.applied_index).set(st["applied_index"])
        m.child(m.recovering).set(1 if st["recovering"] else 0)
        m.child(m.in_flight_bytes).set(self._batcher.accepted_bytes if self._batcher else 0)
        if st["role"] == "leader":
            for addr, p in self.peer_lag().items():
                if p["lag_entries"] is not None:
                    m.child(m.lag_entries, peer=addr).set(p["lag_entries"])
        return m.expose()

    def _node_of(self, address: str | None) -> int | None:
        if address is None:
            return None
        for n in self.cfg.nodes:
            if n.raft_address(self.shard) == address:
                return n.id
        return None


def _push_ids(cmd: Push | Set) -> list[tuple[str, int]]:
    if isinstance(cmd, Set):
        return [(cmd.client, cmd.seq)]
    return [(p.client, p.seq) for p in cmd.pushes]


def _unwrap(result: Any) -> dict:
    """Domain errors travel as values through Raft; raise them here, at the edge."""
    if isinstance(result, KvpsError):
        raise result
    return result
