"""``Replica``: one shard replica — its state host, Raft group, leadership, batcher and reads.

Built in one phase by ``await Replica.open(...)`` on the event loop that will serve it (pysyncobj's
tick thread stops when the thread that built the group exits). Threads: pysyncobj applies committed
entries on its tick thread (``_apply``: decode, apply through the ``StateHost``, which performs the
effects); everything else runs on the loop. Writes go through ``Leadership.ensure_serving`` (the
new-leader barrier) and, for pushes, the ``PushBatcher``; reads wait for what their consistency
asks and then ``lookup`` the state.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvps.clocks import ClusterTime
from kvps.command import (
    Barrier, ClockTick, Command, CreateKey, CreateKeys, CreateTable, DeleteKey, Hyperparams, Push, Set, SetRows,
    SnapshotStep,
    decode_command,
)
from kvps.config import ClusterConfig
from kvps.delta import frame
from kvps.errors import CodecError, InvalidRequest, KeyNotFound, KvpsError, NotLeader, Unavailable
from kvps.machine import CompactLog, Effect
from kvps.merge import PushRequest, comparable_digests, is_finite
from kvps.raft import bridge
from kvps.raft import membership as raft_membership
from kvps.raft.first_election import stand_first
from kvps.raft.group import ShardGroup
from kvps.raft.ticker import Ticker
from kvps.replica.batcher import PushBatcher
from kvps.replica.history import BlockHistory
from kvps.replica.host import StateHost
from kvps.replica.leadership import Leadership
from kvps.replica.mirror import LeaderMirror
from kvps.replica.snapshots import UserSnapshots
from kvps.replica.stats import ReplicaStats
from kvps.service.http import PeerClient
from kvps.shard import ShardState

__all__ = ["Replica"]

log = logging.getLogger("kvps.replica")

# A joining replica starts no election for this long: the leader reaches it well before.
JOIN_ELECTION_HOLD = 10.0
_EX_DIVERGED = 70  # sysexits.h EX_SOFTWARE: this replica cannot follow its log


def _exit(reason: str) -> None:
    log.critical("%s; exiting rather than diverge (the node restarts this replica)", reason)
    os._exit(_EX_DIVERGED)


class Replica:
    def __init__(self, cfg: ClusterConfig, node_id: int, shard: int, data_dir: Path,
                 http: PeerClient, fatal: Callable[[str], None]) -> None:
        """Use ``open``: this only sets fields (the group and its callers come in ``open``)."""
        self.cfg = cfg
        self.node_id = node_id
        self.shard = shard
        self.address = cfg.node(node_id).raft_address(shard)
        self._data_dir = Path(data_dir)
        self._http = http
        self._fatal = fatal
        # Members move between nodes (kvps.node.rebalance): know every node's replica of this shard.
        self._data_urls = {n.raft_address(shard): n.data_url(shard) for n in cfg.nodes}
        server = cfg.server
        self.host = StateHost(
            ShardState(shard, session_ttl=server.session_ttl, dedup=not server.unsafe_disable_dedup,
                       memory_limit=server.memory_limit),
            history=lambda: BlockHistory(depth=server.delta_depth, max_bytes=server.delta_history_bytes),
            perform=self._perform)
        # the time this replica stamps into commands as leader and judges leases by (kvps.clocks)
        self.cluster_time = ClusterTime(time.monotonic)
        self.snapshots = UserSnapshots(shard, self.address, self._data_dir, http=http,
                                       hold_seconds=server.snapshot_hold, peers=self._peer_urls,
                                       busy=self._serving_recently)
        self.stats = ReplicaStats(shard, node_id)
        self._loop = asyncio.get_running_loop()
        self._applied = asyncio.Event()  # pulsed after every apply (follower reads wait on it)
        self.leadership: Leadership | None = None  # set by open() once the group is built
        self._early_role: str | None = None  # a role change seen before that
        # the shared-memory mirror for same-host readers (kvps.delta.mirror): made on the first
        # pull that asks, while this replica leads; its lease is half the shortest election
        # timeout past the last time a majority answered this leader
        self.mirror = LeaderMirror(self.host, shard, mirror_bytes=server.mirror_bytes,
                                   lease_s=cfg.raft.election_timeout_min / 2)

    @classmethod
    async def open(cls, cfg: ClusterConfig, node_id: int, shard: int, *, secret: bytes,
                   data_dir: Path, token: Callable[[], str], client_ssl: Any = None,
                   peers: list[str] | None = None, joining: bool = False,
                   fatal: Callable[[str], None] = _exit, ticker: Ticker | None = None,
                   on_halted: Callable[[str], None] | None = None) -> "Replica":
        """A running replica. ``peers``: the other members' Raft addresses (None: the config's
        placement); ``joining``: it joins an existing group (a moved replica: no election of its
        own for a while, ``kvps.raft.membership``); ``token``: the current bearer token (for
        fetching snapshot files from peers); ``fatal(reason)``: what to do when this replica
        cannot follow its log (exit, so the node restarts it; with a ``ticker``, raise
        ``GroupHalted``: the group stops and ``on_halted(reason)`` is called on the ticker's
        thread). ``ticker``: the process's Raft ticker (``kvps.replica.resident``); None: the
        group runs pysyncobj's own tick thread (one replica per process)."""
        http = await PeerClient(token=token, ssl=client_ssl, timeout=30.0).open()
        self = cls(cfg, node_id, shard, data_dir, http, fatal)
        self.snapshots.start(self._loop)
        if peers is None:
            peers = [cfg.node(n).raft_address(shard) for n in cfg.replica_nodes(shard) if n != node_id]
        journal_dir = self._data_dir / f"shard-{shard}"
        journal_dir.mkdir(parents=True, exist_ok=True)
        build = functools.partial(
            ShardGroup, self_address=self.address, peers=peers, raft=cfg.raft, secret=secret,
            context=f"kvps/shard={shard}", journal_dir=journal_dir, applier=self._apply,
            snapshot_state=self._snapshot_state, restore_state=self._restore_state,
            on_role_change=self._on_role_change, busy=self._serving_recently,
            bind_address=cfg.node(node_id).raft_bind(cfg.node(node_id).port_base + 2 * shard),
            ticker=ticker, on_halted=on_halted, autostart=False,
            command_digest=frame.verified_digest)
        # pysyncobj's own tick thread stops when the thread that built the group exits: build it
        # here. A ticker builds it on its thread (opening the journal): wait for that in a worker
        # thread, so the loop keeps serving the node's other replicas; it ticks (and replays the
        # journal's committed entries through _apply) only once start() is called below.
        self.group = build() if ticker is None else await asyncio.to_thread(build)
        if joining:
            raft_membership.hold_elections(self.group, JOIN_ELECTION_HOLD)
        elif cfg.replica_nodes(shard)[0] == node_id:  # the placement's preferred replica
            stand_first(self.group)  # a fresh group elects it once connected (kvps.raft.first_election)
        self.leadership = Leadership(cfg, shard, self.address, self.group, propose=self._propose,
                                     wait_applied=self._wait_applied, not_leader=self._not_leader,
                                     on_hold=self.mirror.suspend)
        self.mirror.attach(self.group, self.leadership)
        self.batcher = PushBatcher(self._propose, cfg.server, clock=self.cluster_time.now,
                                   on_batch=self.stats.count_batch)
        if self._early_role is not None:
            self.leadership.role_changed(self._early_role)
        if ticker is not None:  # everything its applier and callbacks read is in place now
            await asyncio.to_thread(self.group.start)
        return self

    async def stop(self) -> None:
        self.mirror.close()
        self.leadership.stop()
        await self.batcher.close()
        await asyncio.to_thread(self.group.stop)
        await self.snapshots.stop()
        await self._http.close()

    # ---- tick-thread callbacks (pysyncobj) ---------------------------------------------------

    def _apply(self, data: bytes) -> Any:
        try:
            # the journal checked the arrays against their checksums when it wrote (or read
            # back) this entry, on this replica (ShardGroup's command_digest): not again here
            cmd = decode_command(data, verify=False)
        except (CodecError, InvalidRequest) as exc:
            log.error("shard %d: undecodable log entry (%d bytes): %s", self.shard, len(data), exc)
            return InvalidRequest(f"undecodable command: {exc}")
        if isinstance(cmd, SnapshotStep) and cmd.op == "restore":
            result = self._apply_restore(cmd)
        else:
            result = self.host.apply(cmd)
        self.cluster_time.applied(self.host.lookup(lambda s: s.time))
        if isinstance(cmd, (Push, Set)):  # replies held while a snapshot is being cut
            self.snapshots.applied(_push_ids(cmd))
        self.stats.applied(self.group.raftLastApplied + 1)  # pysyncobj advances it after we return
        self._loop.call_soon_threadsafe(self._pulse_applied)
        return result

    def _apply_restore(self, cmd: SnapshotStep) -> Any:
        if self.host.lookup(lambda s: s.check_restore(cmd)) is not None:
            return self.host.apply_restore(cmd, None)  # the error value, nothing loaded
        loaded = self.snapshots.state_for_restore(cmd)
        if loaded is None:  # every other replica restores; carrying on would diverge
            self._fatal(f"shard {self.shard}: snapshot {cmd.snap_id} cannot be restored here")
        result = self.host.apply_restore(cmd, loaded)
        log.info("shard %d: restored snapshot %s: %s", self.shard, cmd.snap_id, result)
        return result

    def _perform(self, effect: Effect) -> None:
        """Effects the state host does not perform itself (tick thread, in apply order)."""
        if isinstance(effect, CompactLog):
            self.group.forceLogCompaction()  # so a restart does not need the snapshot file again
        else:
            self.snapshots.perform(effect)

    def _snapshot_state(self) -> Any:
        """For log compaction: a view now (tick thread), encoded later by the writer thread."""
        meta, arrays = self.host.lookup(lambda s: s.snapshot_parts())
        return functools.partial(frame.encode_parts, frame.KIND_SNAPSHOT, meta, arrays)

    def _restore_state(self, data: bytes) -> None:
        state = ShardState.restore(data, memory_limit=self.cfg.server.memory_limit)
        self.host.replace(state)
        self.cluster_time.applied(state.time)

    def _serving_recently(self) -> bool:
        """Whether this replica applied an entry or served a pull in the last 0.2 s (snapshot
        writers then run at half speed)."""
        group = getattr(self, "group", None)  # the group's compaction may ask while it is built
        return self.stats.serving_recently(group.raftLastApplied if group is not None else 0)

    def _on_role_change(self, role: str) -> None:
        if role != "leader":  # at once, on the tick thread: no reader trusts it from now on
            self.mirror.close()
        self._loop.call_soon_threadsafe(self._role_changed, role)

    # ---- loop-thread reactions ----------------------------------------------------------------

    def _pulse_applied(self) -> None:
        self._applied.set()
        self._applied = asyncio.Event()

    def _role_changed(self, role: str) -> None:
        self.stats.leader_changed()
        if self.leadership is None:  # a ticker's group ticks while open() still builds the rest
            self._early_role = role
            return
        self.leadership.role_changed(role)

    async def _propose(self, data: bytes) -> Any:
        started = time.monotonic()
        try:
            return await bridge.propose(self.group, data)
        finally:
            self.stats.committed(time.monotonic() - started)

    async def _wait_applied(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._applied.wait(), min(timeout, 0.05))
        except TimeoutError:
            pass

    async def _release(self, pid: tuple[str, int]) -> None:
        """Wait while ``pid``'s acknowledgement is held by a snapshot being cut."""
        while self.snapshots.held(pid):
            await self._wait_applied(0.05)

    # ---- leadership ---------------------------------------------------------------------------

    def leader_hint(self) -> str | None:
        addr = self.group.leader_address()
        return self.data_url_of(addr) if addr else None

    def data_url_of(self, address: str) -> str:
        """A member's data URL; a node that joined after this replica started is not in its config,
        but every node serves a shard's data on the port after its raft port (NodeConfig)."""
        if address in self._data_urls:
            return self._data_urls[address]
        host, port = address.rsplit(":", 1)
        return f"{self.cfg.node(self.node_id).scheme}://{host}:{int(port) + 1}"

    def _peer_urls(self) -> list[str]:
        return [u for a, u in sorted(self._data_urls.items()) if a != self.address]

    def _not_leader(self) -> NotLeader:
        return NotLeader(self.shard, self.leader_hint(), self.address)

    async def ensure_serving(self) -> None:
        await self.leadership.ensure_serving()

    # ---- writes ----------------------------------------------------------------------------

    async def push(self, req: PushRequest) -> dict:
        await self.ensure_serving()
        finite = is_finite(req)
        nonfinite = "allow" if finite else self.cfg.server.nonfinite
        err, done, modes = self.host.lookup(lambda s: s.admit_push(req, nonfinite))
        if done is not None:
            stored = done.get("digest") if isinstance(done, dict) else None
            if comparable_digests(stored or 0, req.digest) and stored != req.digest:
                self.stats.rejected("ReusedPushId")
                log.warning("shard %d: push id %s/%d reused for different content (replayed or "
                            "forged); refused", self.shard, req.client, req.seq)
                raise InvalidRequest("push id already used for a different push; nothing applied",
                                     client=req.client, seq=req.seq)
            await self._release((req.client, req.seq))
            return _unwrap(done)
        if not finite:
            action = "skipped" if self.cfg.server.nonfinite == "skip" and err is None else "rejected"
            self.stats.nonfinite(action)
            log.warning("shard %d: push %s/%d has NaN/Inf gradients: %s", self.shard, req.client,
                        req.seq, action)
            if action == "skipped":  # dropped on purpose: nothing applied, versions unchanged
                return {"versions": self.host.lookup(lambda s: s.current_versions(req))}
        if err is not None:
            raise err
        self.stats.count_push(req)
        result = await self.batcher.submit(req, modes)
        await self._release((req.client, req.seq))
        return _unwrap(result)

    async def write(self, cmd: Command) -> dict:
        """Create, delete, set, row writes and clock ticks: proposed alone (not merged)."""
        await self.ensure_serving()
        if isinstance(cmd, Set):
            done, err = self.host.lookup(lambda s: (s.lookup_push(cmd.client, cmd.seq), s.check_set(cmd)))
            if done is not None:
                await self._release((cmd.client, cmd.seq))
                return _unwrap(done)
            if err is not None:
                raise err
        elif isinstance(cmd, Hyperparams):  # validated here, on the leader, before proposing
            err = self.host.lookup(lambda s: s.check_hyperparams(cmd))
            if err is not None:
                raise err
        elif not isinstance(cmd, (CreateKey, CreateKeys, CreateTable, DeleteKey, ClockTick, SetRows)):
            raise InvalidRequest(f"not a write command: {type(cmd).__name__}")
        result = await self._propose(cmd.to_bytes())
        if isinstance(cmd, Set):
            await self._release((cmd.client, cmd.seq))
        return _unwrap(result)

    async def snapshot_step(self, cmd: SnapshotStep) -> dict:
        await self.ensure_serving()
        if cmd.op == "restore":
            err = self.host.lookup(lambda s: s.check_restore(cmd))
            if err is not None:
                raise err
        return _unwrap(await self._propose(cmd.to_bytes()))

    # ---- reads -----------------------------------------------------------------------------

    async def before_read(self, consistency: str, min_versions: dict[str, int]) -> dict[str, int]:
        """Block until this replica may answer a read at ``consistency``. A follower read returns
        the keys of ``min_versions`` whose version this shard has not issued (``_wait_versions``)."""
        if consistency == "leader":
            await self.ensure_serving()
        elif consistency == "linearizable":
            await self.ensure_serving()
            # A read barrier through the log: once it applies, no newer leader can have
            # committed anything we have not applied.
            _unwrap(await self._propose(Barrier(term=self.group.term(), replica=self.address).to_bytes()))
        elif consistency == "follower":
            return await self._wait_versions(min_versions)
        else:
            raise InvalidRequest(f"unknown consistency {consistency!r}")
        return {}

    async def _wait_versions(self, wanted: dict[str, int]) -> dict[str, int]:
        """Wait until this replica's version of each key (per shard, as pushes return it) reaches
        the version asked, or the version this shard's leader holds where that is lower: a
        version a push returned from another shard of the key, or one never issued, would
        never come here. Returns those keys with the leader's version (the client judges
        whether any shard issued it). Only a replica behind the version asks the leader."""
        lagging = self._lagging(wanted)
        if not lagging:
            return {}
        issued = await self._leader_versions(sorted(lagging))
        short = {k: issued[k] for k in lagging if issued[k] < wanted[k]}
        targets = {k: min(v, issued[k]) for k, v in lagging.items()}
        deadline = time.monotonic() + self.cfg.server.barrier_wait
        while lagging := self._lagging(targets):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                key = min(lagging)
                raise Unavailable("replica has not reached min_version", shard=self.shard, key=key,
                                  min_version=targets[key])
            await self._wait_applied(remaining)
        return short

    def _lagging(self, wanted: dict[str, int]) -> dict[str, int]:
        return self.host.lookup(lambda s: {k: v for k, v in wanted.items()
                                           if s.key_version_or_absent(k) < v})

    async def _leader_versions(self, keys: list[str]) -> dict[str, int]:
        """This shard's committed version of ``keys`` (-1: absent), as its serving leader has it."""
        if not self.group.is_leader():
            hint = self.leader_hint()
            if hint is None:
                raise Unavailable("no leader known to check min_version against", shard=self.shard)
            meta = await self._http.rpc(hint, "key_versions", {"keys": keys},
                                        timeout=self.cfg.server.barrier_wait)
            versions = meta.get("versions")
            if not isinstance(versions, dict) or not all(isinstance(versions.get(k), int) for k in keys):
                raise Unavailable("malformed key_versions reply from the leader", shard=self.shard)
            return {k: versions[k] for k in keys}
        await self.ensure_serving()  # its barrier applied: everything committed is applied here
        return self.key_versions(keys)

    def key_versions(self, keys: list[str]) -> dict[str, int]:
        return self.host.lookup(lambda s: {k: s.key_version_or_absent(k) for k in keys})

    def clocks(self, job: str) -> dict[str, int]:
        """Live worker clocks of ``job``; leases are judged by this replica's cluster time."""
        now = self.cluster_time.now()
        return self.host.lookup(lambda s: s.clocks(job, now))

    def describe(self, key: str) -> dict:
        info = self.host.lookup(lambda s: s.describe(key))
        if info is None:
            raise KeyNotFound(f"no key {key!r} on shard {self.shard}", key=key)
        return info

    def status(self) -> dict:
        st = self.group.status()
        leader = st["leader"]
        return {
            "shard": self.shard, "node": self.node_id, "pid": os.getpid(), "raft": self.address,
            "data_url": self.cfg.node(self.node_id).data_url(self.shard),
            "role": st["role"], "term": st["term"], "won_by": st.get("won_by"),
            "leader": self._node_of(leader),
            "leader_url": self.data_url_of(leader) if leader else None,
            "serving": st["role"] == "leader" and self.leadership.serving(st["term"]),
            "commit_index": st["commit_index"], "applied_index": st["applied_index"],
            "log_entries": st["log_entries"], "compactions": st.get("compactions"),
            "log_memory": st.get("log_memory"),  # commands held in memory, released, read back
            "tick_stalls": st.get("tick_stalls"),
            # its lost data was replaced: no vote until it has caught up (kvps.raft.recovery)
            "recovering": st["recovering"], "recovering_reason": st["recovering_reason"],
            "votes_withheld": st["votes_withheld"],
            "pre_votes": st.get("pre_votes"),  # asked, won, avoided, granted (kvps.raft.prevote)
            "quiet": st.get("quiet"),  # a still group's slower heartbeats (kvps.raft.quiet)
            "in_flight_bytes": self.batcher.accepted_bytes,
            **self.stats.view(),
            "peers": self.stats.peer_lag(self.group) if st["role"] == "leader" else {},
        }

    def expose_metrics(self) -> bytes:
        st = self.group.status()
        serving = st["role"] == "leader" and self.leadership.serving(st["term"])
        tables = self.host.lookup(lambda s: [(i["key"], i["rows"], i["bytes"]) for i in s.keys()
                                             if i["kind"] == "table"])
        return self.stats.expose(self.group, st, serving=serving,
                                 in_flight_bytes=self.batcher.accepted_bytes, tables=tables)

    def _node_of(self, address: str | None) -> int | None:
        if address is None:
            return None
        return next((n.id for n in self.cfg.nodes if n.raft_address(self.shard) == address), None)


def _push_ids(cmd: Push | Set) -> list[tuple[str, int]]:
    if isinstance(cmd, Set):
        return [(cmd.client, cmd.seq)]
    return [(p.client, p.seq) for p in cmd.pushes]


def _unwrap(result: Any) -> dict:
    """Domain errors travel as values through Raft; raise them here, at the edge."""
    if isinstance(result, KvpsError):
        raise result
    return result
