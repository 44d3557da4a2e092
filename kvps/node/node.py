"""A node: hosts the replicas of its shards and serves the admin HTTP API.

``server.procs`` says where the replicas run: 1 (the default), in this process
(``ResidentReplica``: one event loop, ``server.raft_threads`` Raft tickers; a replica that halts
is restarted here alone and its status is read in-process); 0, one child process per replica
(restarted when it exits; the node polls each one's ``/v1/status``). Either way restarts follow a capped back-off, and the node follows the metadata
group's assignment (starting and retiring replicas as it changes) and serves the admin app
(``kvps.node.admin``) and, with resident replicas, the wire port (``kvps.service.wire``).
A little past the house's ~450 lines on purpose: supervision of both replica kinds stays in one
place; the admin app, metadata, snapshots and the wire port already live in their own modules.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import shutil
import ssl
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from kvps.assignment import Assignment
from kvps.config import ClusterConfig, NodeConfig
from kvps.errors import ConfigError, InvalidRequest, KvpsError, Unavailable
from kvps.node.admin import make_app
from kvps.node.identity import Identity, known_incarnations, settle
from kvps.node.meta_service import NodeMembership
from kvps.node.metrics import NodeMetrics
from kvps.node.process import python_module_args, spawn, stop_process
from kvps.raft import recovery
from kvps.raft.ticker import Ticker
from kvps.replica.dataplane import answer, rejected
from kvps.replica.resident import ResidentReplica
from kvps.node.snapshot_api import SnapshotService
from kvps.service.connections import ConnectionLimits, connection_series
from kvps.service.ring import ring_series
from kvps.service.auth import TokenStore
from kvps.service.lifecycle import MALLOC_SETTINGS
from kvps.service.http import PeerClient
from kvps.service.wire import WireServer

__all__ = ["Node", "ReplicaProcess"]

log = logging.getLogger("kvps.node")

# Replica status polls: every POLL_PERIOD while anything is unsettled (a replica not answering,
# no leader known, roles or leaders changed within SETTLE_SECONDS), else every
# POLL_PERIOD_STABLE. Each poll is one HTTP request per replica; at 0.2 s that was ~120 requests/s
# on a 3-node, 8-shard cluster, a few percent of two cores spent saying nothing changed.
POLL_PERIOD = 0.2
POLL_PERIOD_STABLE = 1.0
SETTLE_SECONDS = 5.0
RESTART_BACKOFF = (0.2, 5.0)

# A replica process's malloc settings (kvps.service.lifecycle says why).
REPLICA_ENV = {f"MALLOC_{name}_": str(value) for name, value in MALLOC_SETTINGS.items()}


@dataclass
class ReplicaProcess:
    shard: int
    proc: subprocess.Popen | None = None
    restarts: int = 0
    backoff: float = RESTART_BACKOFF[0]
    next_start: float = 0.0
    status: dict[str, Any] | None = None
    status_at: float = 0.0
    last_exit: int | None = None
    started_at: float = field(default_factory=time.monotonic)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.alive else None


class Node:
    def __init__(self, cfg: ClusterConfig, node_id: int, config_path: Path, data_dir: Path,
                 tokens: TokenStore, *, server_ssl: ssl.SSLContext | None = None,
                 client_ssl: ssl.SSLContext | None = None, replace: bool = False,
                 zone: str | None = None) -> None:
        self._server_ssl = server_ssl
        self._client_ssl = client_ssl
        self.cfg = cfg
        self.node_id = node_id
        self.config_path = config_path
        self.data_dir = data_dir
        self.tokens = tokens  # who may call the admin app (kvps.node.access); the first admin
        # token is what this node sends to other nodes and to replicas
        # Which incarnation of this node the data directory is (kvps.node.identity): settled with
        # the other nodes in run() before any replica starts. ``replace``: --replace.
        self.identity: Identity | None = None
        self.replace = replace
        self._recorded = False  # our incarnation seen in the metadata group (--replace: until then
        # it takes over whichever one is recorded)
        self._persisted_incarnations: dict[int, str] = {}
        self.refusal: str | None = None  # why the node stopped itself, if it did
        # The failure domain this node says it is in (--zone, else cluster.toml's); recorded in
        # the metadata group when it differs from what is recorded there (check_zone).
        self.zone = cfg.node(node_id).zone if zone is None else zone
        self._followed: list[dict[str, Any]] = []  # the metadata node list as last followed
        # The node list as last followed (joined nodes): a restart must know the nodes its
        # assignment and the metadata group name before it can ask them for a newer list.
        nodes_path = self.data_dir / "nodes.json"
        if nodes_path.exists():
            self.follow_nodes(json.loads(nodes_path.read_text()))
        # Which shards this node hosts: the config's placement until replicas move (the metadata
        # group's assignment, followed by self.membership; persisted so a restart keeps it).
        self.assignment = self._load_assignment()
        # server.procs = 1: every replica in this process, their groups on one ticker (run()).
        self.resident = cfg.server.procs == 1
        # their Raft groups' threads (server.raft_threads); the metadata group ticks on the first
        self.tickers = [Ticker(name=f"raft-ticker-{i}") for i in range(cfg.server.raft_threads)
                        ] if self.resident else []
        self._secret: bytes | None = None
        self.replicas: dict[int, ReplicaProcess | ResidentReplica] = {}
        for s in self.assignment.shards_of(node_id):
            self.replicas[s] = self._new_replica(s)
        # The metadata group (node list, assignment), followed; the rebalancer on its leader.
        self.membership = NodeMembership(self)
        self._stop_event: asyncio.Event | None = None
        self._stopping = False
        # every call to another kvps process (replicas, other nodes) goes through it
        self.http = PeerClient(token=tokens.admin_token, ssl=client_ssl)
        self.metrics = NodeMetrics(node_id)
        self.snapshots = SnapshotService(self)  # /v1/snapshots and the snapshot schedule
        self.wire: WireServer | None = None  # the binary data plane (server.wire, resident replicas)

    def _wire_server(self) -> WireServer:
        server = self.cfg.server

        async def dispatch(shard: int, op: str, authorization: str, body: memoryview, rid: str) -> list:
            rr = self.replicas.get(shard)
            replica = rr.replica if isinstance(rr, ResidentReplica) and rr.alive else None
            if replica is None:
                raise Unavailable(f"no replica of shard {shard} serves on node {self.node_id}",
                                  shard=shard, node=self.node_id)
            try:
                return await answer(replica, self.tokens, op, authorization, lambda: _ready(body))
            except KvpsError as exc:
                rejected(replica, op, rid, exc)
                raise

        return WireServer(dispatch, tokens=self.tokens, max_body=server.max_request_bytes,
                          body_timeout=server.body_timeout, idle_timeout=server.idle_timeout,
                          per_peer=server.max_connections_per_peer, name=f"node {self.node_id} wire",
                          series=connection_series(self.metrics.registry, self.node_id, "wire"),
                          rings=ring_series(self.metrics.registry, self.node_id))

    @property
    def token(self) -> str:
        """The token this node calls other kvps processes with (the token file's first admin one)."""
        return self.tokens.admin_token()

    # ---- supervision -------------------------------------------------------------------------

    def _new_replica(self, shard: int) -> ReplicaProcess | ResidentReplica:
        if not self.resident:
            return ReplicaProcess(shard)
        rr = ResidentReplica(self.cfg, self.node_id, shard, data_dir=self.data_dir,
                             secret=self._cluster_secret(), tokens=self.tokens,
                             ticker=self._least_loaded_ticker(), server_ssl=self._server_ssl,
                             client_ssl=self._client_ssl)
        rr.backoff = RESTART_BACKOFF[0]
        return rr

    @property
    def ticker(self) -> Ticker | None:
        """The metadata group's ticker (None: replicas in processes of their own)."""
        return self.tickers[0] if self.tickers else None

    def _least_loaded_ticker(self) -> Ticker:
        hosted = {id(t): 0 for t in self.tickers}
        for rr in self.replicas.values():
            if isinstance(rr, ResidentReplica):
                hosted[id(rr.ticker)] += 1
        return min(self.tickers, key=lambda t: hosted[id(t)])

    def _cluster_secret(self) -> bytes:
        if self._secret is None:
            self._secret = (self.config_path.parent / self.cfg.secret_file).read_bytes().strip()
        return self._secret

    def _start(self, rp: ReplicaProcess | ResidentReplica) -> None:
        if recovery.prepare_start(self.data_dir, f"shard-{rp.shard}"):
            log.warning("node %d: the data of its replica of shard %d is gone; it restarts empty "
                        "and withholds its vote until it has caught up", self.node_id, rp.shard)
        if isinstance(rp, ResidentReplica):
            peers, joining = self._membership(rp.shard)
            rp.start(peers=peers, joining=joining, on_down=self._resident_down)
            return
        bind = self.cfg.node(self.node_id).bind
        args = python_module_args("kvps.cli", "replica", "--config", str(self.config_path),
                                  "--node", str(self.node_id), "--shard", str(rp.shard),
                                  *(["--bind", bind] if bind else []),
                                  *self._membership_args(rp.shard))
        log_path = self.data_dir / "logs" / f"shard-{rp.shard}.log"
        rp.proc = spawn(args, log_path, env=REPLICA_ENV)
        rp.started_at = time.monotonic()
        rp.status = None
        log.info("node %d: started replica of shard %d (pid %d)", self.node_id, rp.shard, rp.proc.pid)

    def _resident_down(self, rr: ResidentReplica, reason: str) -> None:
        """A resident replica failed to start or halted (it is being closed): restart it later."""
        rr.next_start = time.monotonic() + rr.backoff
        log.warning("node %d: replica of shard %d restarts in %.1fs (%s)", self.node_id, rr.shard,
                    rr.backoff, reason)
        rr.backoff = min(rr.backoff * 2, RESTART_BACKOFF[1])
        rr.restarts += 1
        self.metrics.replica_restarts.labels(shard=str(rr.shard), node=str(self.node_id)).inc()

    def _supervise_once(self) -> None:
        now = time.monotonic()
        for rp in self.replicas.values():
            if isinstance(rp, ResidentReplica):
                self._supervise_resident(rp, now)
                continue
            if rp.proc is not None and rp.proc.poll() is None:
                if now - rp.started_at > 10.0:
                    rp.backoff = RESTART_BACKOFF[0]  # it stayed up: forget earlier crashes
                continue
            if rp.proc is not None:
                rp.last_exit = rp.proc.returncode
                log.warning("node %d: replica of shard %d exited with %s; restarting in %.1fs",
                            self.node_id, rp.shard, rp.last_exit, rp.backoff)
                rp.proc = None
                rp.status = None
                rp.next_start = now + rp.backoff
                rp.backoff = min(rp.backoff * 2, RESTART_BACKOFF[1])
                rp.restarts += 1
                self.metrics.replica_restarts.labels(shard=str(rp.shard), node=str(self.node_id)).inc()
            if now >= rp.next_start:
                self._start(rp)

    def _supervise_resident(self, rr: ResidentReplica, now: float) -> None:
        if rr.busy:
            return
        if rr.alive:
            if now - rr.started_at > 10.0:
                rr.backoff = RESTART_BACKOFF[0]  # it stayed up: forget earlier failures
            return
        if now >= rr.next_start:
            self._start(rr)

    def _membership(self, shard: int) -> tuple[list[str], bool]:
        """The other members' Raft addresses now and, for a replica placed here by a move that
        has no data yet, whether it joins the existing group instead of bootstrapping one."""
        peers = [self.cfg.node(n).raft_address(shard) for n in self.assignment.nodes_of(shard)
                 if n != self.node_id]
        shard_dir = self.data_dir / f"shard-{shard}"
        joining = self.assignment.epochs[shard] > 0 and not (shard_dir.exists() and any(shard_dir.iterdir()))
        return peers, joining

    def _membership_args(self, shard: int) -> list[str]:
        """``--peers`` and ``--join`` (``_membership``) for a replica process."""
        peers, joining = self._membership(shard)
        return ["--peers", ",".join(peers), *(["--join"] if joining else [])]

    # ---- assignment (which shards this node hosts) ---------------------------------------------

    def _load_assignment(self) -> Assignment:
        path = self.data_dir / "assignment.json"
        if path.exists():
            return Assignment.from_json(json.loads(path.read_text()))
        return Assignment.initial(self.cfg)

    async def set_assignment(self, new: Assignment) -> bool:
        """Follow ``new`` if it is newer: start replicas for shards placed here (the supervisor
        loop starts them), stop the ones moved away and delete their data. False if not newer."""
        if len(new.shards) != self.cfg.shards:
            raise InvalidRequest(f"assignment has {len(new.shards)} shards, the cluster "
                                 f"{self.cfg.shards}", field="assignment")
        if new.version <= self.assignment.version:
            return False
        path = self.data_dir / "assignment.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(new.to_json()))
        os.replace(tmp, path)
        self.assignment = new
        wanted = set(new.shards_of(self.node_id))
        for shard in sorted(wanted - set(self.replicas)):
            self.replicas[shard] = self._new_replica(shard)
            log.info("node %d: now hosts shard %d (assignment %d)", self.node_id, shard, new.version)
        gone = [self.replicas.pop(s) for s in sorted(set(self.replicas) - wanted)]
        for rr in gone:
            if isinstance(rr, ResidentReplica):
                await rr.stop()  # before its data goes
        if gone:
            await asyncio.to_thread(self._retire, gone)
        return True

    def _retire(self, gone: list[ReplicaProcess | ResidentReplica]) -> None:
        for rp in gone:
            if isinstance(rp, ReplicaProcess) and rp.proc is not None:
                stop_process(rp.proc, timeout=5.0)
            # Its Raft group no longer counts it: a stale journal must never rejoin it.
            shutil.rmtree(self.data_dir / f"shard-{rp.shard}", ignore_errors=True)
            recovery.forget_hosted(self.data_dir, f"shard-{rp.shard}")
            log.info("node %d: stopped hosting shard %d; its data is deleted", self.node_id, rp.shard)

    def follow_nodes(self, nodes: list[dict[str, Any]]) -> None:
        """Adopt the metadata group's node list (joined nodes appear; ids never change)."""
        self._followed = [dict(n) for n in nodes]
        known = {n.id: n for n in self.cfg.nodes}
        new = tuple(NodeConfig(id=n["id"], host=n["host"], admin_port=n["admin_port"],
                               port_base=n["port_base"], scheme=n["scheme"],
                               data_dir=known[n["id"]].data_dir if n["id"] in known else f"node-{n['id']}",
                               bind=known[n["id"]].bind if n["id"] in known else "", zone=n.get("zone", ""))
                    for n in nodes)
        path = self.data_dir / "nodes.json"
        if new != self.cfg.nodes or known_incarnations(nodes) != self._persisted_incarnations:
            self._persisted_incarnations = known_incarnations(nodes)
            self.cfg = dataclasses.replace(self.cfg, nodes=new)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(nodes))
            os.replace(tmp, path)

    def known_incarnations(self) -> dict[int, str]:
        """The incarnations the metadata group recorded, as this node last saw them."""
        meta = self.membership.meta
        return known_incarnations(meta.state().nodes if meta is not None else self._followed)

    async def check_incarnation(self, recorded: str | None) -> None:
        """Compare the metadata group's record of this node with this directory's identity:
        record ours when none (or the one --replace took over) is; stop when another
        incarnation holds the id (a replacement took this node's place)."""
        mine = self.identity
        if mine is None or recorded == mine.incarnation:
            self._recorded = self._recorded or mine is not None
            return
        if recorded is None or (self.replace and not self._recorded):
            url = self.cfg.node(self.node_id).admin_url + f"/v1/nodes/{self.node_id}/incarnation"
            try:
                await self.http.json("POST", url, {"incarnation": mine.incarnation, "replaces": recorded},
                                     timeout=5.0)
                log.info("node %d: recorded incarnation %s", self.node_id, mine.incarnation)
            except KvpsError as exc:  # retried on the next follow round
                log.info("node %d: recording its incarnation failed: %s", self.node_id, exc)
            return
        self.refusal = (f"the cluster knows node {self.node_id} as incarnation {recorded}, this data "
                        f"directory is {mine.incarnation}: another node replaced this one")
        log.error("node %d: %s; stopping", self.node_id, self.refusal)
        self.request_stop()

    async def check_zone(self, recorded: str) -> None:
        if self.zone == recorded:
            return
        url = self.cfg.node(self.node_id).admin_url + f"/v1/nodes/{self.node_id}/zone"
        try:
            await self.http.json("POST", url, {"zone": self.zone}, timeout=5.0)
            log.info("node %d: recorded its zone %r", self.node_id, self.zone)
        except KvpsError as exc:  # retried on the next follow round
            log.info("node %d: recording its zone failed: %s", self.node_id, exc)

    def request_stop(self) -> None:
        if self._stop_event is not None:
            self._stop_event.set()

    async def _poll_once(self) -> None:
        async def one(rp: ReplicaProcess | ResidentReplica) -> None:
            if isinstance(rp, ResidentReplica):  # in this process: read, not requested
                rp.status = rp.read_status()
                rp.status_at = time.monotonic()
                return
            url = self.cfg.node(self.node_id).data_url(rp.shard) + "/v1/status"
            try:
                rp.status = await self.http.json("GET", url, timeout=1.0)
                rp.status_at = time.monotonic()
            except KvpsError:
                rp.status = None

        await asyncio.gather(*(one(rp) for rp in self.replicas.values()))

    async def _loop(self) -> None:
        changed_at, last = time.monotonic(), None
        while not self._stopping:
            self._supervise_once()
            await self._poll_once()
            view = self._settled_view()
            if view is None or view != last:
                changed_at, last = time.monotonic(), view
            stable = time.monotonic() - changed_at >= SETTLE_SECONDS
            await asyncio.sleep(POLL_PERIOD_STABLE if stable else POLL_PERIOD)

    def _settled_view(self) -> tuple | None:
        """(shard, role, leader, term) of every replica; None while one is silent or leaderless."""
        view = []
        for shard, rp in sorted(self.replicas.items()):
            st = rp.status
            if not st or (st.get("leader") is None and st.get("leader_url") is None):
                return None
            view.append((shard, st.get("role"), st.get("leader"), st.get("term")))
        return tuple(view)

    async def run(self, stop: asyncio.Event) -> None:
        self._stop_event = stop
        await self.http.open()
        limits = ConnectionLimits(idle_timeout=self.cfg.server.idle_timeout,
                                  per_peer=self.cfg.server.max_connections_per_peer,
                                  registry=self.metrics.registry, node=self.node_id, server="admin")
        app = make_app(self)
        app.middlewares.insert(0, limits.middleware)
        runner = web.AppRunner(app, access_log=None, **limits.runner_kwargs())
        await runner.setup()
        limits.install(runner)
        me = self.cfg.node(self.node_id)
        site = web.TCPSite(runner, me.listen_host, me.admin_port, reuse_address=True,
                           ssl_context=self._server_ssl)
        await site.start()
        log.info("node %d: admin API on %s", self.node_id, me.admin_url)
        if self.resident and self.cfg.server.wire:
            self.wire = self._wire_server()
            await self.wire.start(me.listen_host, self.cfg.wire_port(self.node_id), self._server_ssl)
            log.info("node %d: wire data plane on %s:%d", self.node_id, me.host,
                     self.cfg.wire_port(self.node_id))
        loop_task = schedule_task = None
        try:
            self.identity = await settle(self, replace=self.replace)
            loop_task = asyncio.create_task(self._loop())
            self.membership.start()
            schedule_task = asyncio.create_task(self.snapshots.run_schedule())
            await stop.wait()
        finally:
            self._stopping = True
            tasks = [t for t in (loop_task, schedule_task) if t is not None]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.membership.stop()
            await self.snapshots.close()
            if self.wire is not None:
                await self.wire.close()
            await asyncio.gather(*(rr.stop() for rr in self.replicas.values()
                                   if isinstance(rr, ResidentReplica)), return_exceptions=True)
            await asyncio.to_thread(self._stop_replicas)
            for ticker in self.tickers:
                await asyncio.to_thread(ticker.stop)
            await runner.cleanup()
            await self.http.close()
        if self.refusal is not None:
            raise ConfigError(f"node {self.node_id} stopped: {self.refusal}")

    def _stop_replicas(self) -> None:
        for rp in self.replicas.values():
            if isinstance(rp, ReplicaProcess) and rp.proc is not None:
                stop_process(rp.proc, timeout=5.0)


async def _ready(body: memoryview) -> memoryview:
    return body
