"""The metadata Raft group in a node process: ``MetaState`` behind a ``ShardGroup``.

The nodes in ``meta_members`` (the first three of the initial cluster until one of them is
drained) each run one metadata replica inside their node process (its Raft port is the one after
the node's shard ports, ``kvps.meta.meta_address``). Any replica proposes: pysyncobj forwards a
follower's proposal to the leader. Reads are the local replica's applied state (a follower may be
a little behind; every reader compares versions, which only grow); a replica that knows no leader
(an election, or it was removed from the group) also asks the other members.

Nodes that do not run a metadata replica read the map from one that does (``GET /v1/meta``). A
node follows ``meta_members`` (persisted in ``meta_members.json`` next to ``assignment.json``): it
starts a replica that joins the group when it is added, and stops its replica when it is dropped
(``kvps.rebalance.MetaMover`` moves one, like a shard replica).
"""
from __future__ import annotations

import copy
import json
import logging
import threading
from pathlib import Path
from typing import Any

from kvps.config import ClusterConfig
from kvps.errors import ConnectError, InvalidRequest, KvpsError, NotDrainable, Unavailable
from kvps.meta import MetaState, meta_address
from kvps.raft import bridge, recovery
from kvps.raft.first_election import stand_first
from kvps.raft.group import ShardGroup

__all__ = ["MetaService", "NodeMembership"]

log = logging.getLogger("kvps.meta")


class MetaService:
    def __init__(self, cfg: ClusterConfig, node_id: int, members: list[int], data_dir: Path,
                 secret: bytes, *, join: bool = False, ticker: Any = None) -> None:
        """``ticker``: the node's ``kvps.raft.ticker.Ticker`` when its replicas run in its process
        (the metadata group is ticked with them); None: a tick thread of its own."""
        self._lock = threading.Lock()
        self._state = MetaState.initial(cfg)
        addresses = [meta_address(cfg.node(n), cfg.shards) for n in members]
        self.address = meta_address(cfg.node(node_id), cfg.shards)
        self.journal_dir = data_dir / "meta"
        if recovery.prepare_start(data_dir, "meta"):  # its journal is gone: no vote until caught up
            log.warning("node %d: the metadata replica's data is gone; it restarts empty and "
                        "withholds its vote until it has caught up", node_id)
        self.group = ShardGroup(
            self_address=self.address, peers=[a for a in addresses if a != self.address],
            raft=cfg.raft, secret=secret, context="kvps/meta", journal_dir=self.journal_dir,
            applier=self._apply, snapshot_state=self._snapshot, restore_state=self._restore,
            bind_address=cfg.node(node_id).raft_bind(int(self.address.rsplit(":", 1)[1])),
            ticker=ticker)
        if join:  # a replica added to a running group: it must not depose the leader meanwhile
            from kvps.raft.membership import hold_elections
            hold_elections(self.group, 30.0)
        elif members and members[0] == node_id:  # a fresh group elects the first metadata node
            stand_first(self.group)

    # ---- tick thread -------------------------------------------------------------------------

    def _apply(self, data: bytes) -> Any:
        try:
            command = json.loads(bytes(data))
        except ValueError as exc:
            return InvalidRequest(f"undecodable meta command: {exc}")
        with self._lock:
            return self._state.apply(command).result  # the metadata state asks for no effects

    def _snapshot(self) -> bytes:
        with self._lock:
            return self._state.snapshot()

    def _restore(self, data: Any) -> None:
        state = MetaState.restore(bytes(data))
        with self._lock:
            self._state = state

    # ---- any thread --------------------------------------------------------------------------

    def state(self) -> MetaState:
        """A copy of the applied state."""
        with self._lock:
            return copy.deepcopy(self._state)

    def view(self) -> dict[str, Any]:
        st = self.group.status()
        with self._lock:
            data = self._state.to_json()
        return {**copy.deepcopy(data), "raft": {"address": self.address, "role": st["role"],
                                                "leader": st["leader"], "term": st["term"],
                                                "commit_index": st["commit_index"],
                                                "applied_index": st["applied_index"]}}

    def version(self) -> int:
        """The applied state's version (bumped by every change), without copying it."""
        with self._lock:
            return self._state.version

    def is_leader(self) -> bool:
        return self.group.is_leader()

    def hears_leader(self) -> bool:
        from kvps.raft.membership import hears_leader
        return hears_leader(self.group)

    async def propose(self, command: dict[str, Any]) -> dict[str, Any]:
        """Replicate ``command``; its result, or ``VersionConflict`` / ``Unavailable``."""
        result = await bridge.propose(self.group, json.dumps(command, sort_keys=True).encode())
        if isinstance(result, BaseException):  # VersionConflict, Unavailable (busy), InvalidRequest
            raise result
        return result

    def stop(self) -> None:
        self.group.stop()


class NodeMembership:
    """A node's side of elastic membership: runs its metadata replica (on the first three
    nodes), follows the metadata state (node list, assignment), runs the rebalancer on the
    metadata leader, and serves ``GET /v1/meta``, ``POST /v1/nodes`` (join) and
    ``POST /v1/nodes/{id}/drain``. Nodes without a metadata replica forward those to one."""

    FOLLOW_PERIOD = 0.3

    def __init__(self, node: Any) -> None:
        from kvps.meta import meta_nodes
        self.node = node
        self._members_path = node.data_dir / "meta_members.json"
        self.meta_ids = json.loads(self._members_path.read_text()) if self._members_path.exists() \
            else meta_nodes([n.id for n in node.cfg.nodes])
        self.meta: MetaService | None = None
        self.version = -1
        self.view: dict[str, Any] | None = None  # the newest metadata state seen
        self._tasks: list[Any] = []
        # the tasks next to the local replica that act while it leads: the rebalancer, the node watch
        self._leader_tasks: list[Any] = []
        self.watch: Any = None  # kvps.node.liveness.NodeWatch, while this node runs a metadata replica

    def secret(self) -> bytes:
        return (self.node.config_path.parent / self.node.cfg.secret_file).read_bytes().strip()

    def start(self) -> None:
        import asyncio
        if self.node.node_id in self.meta_ids:
            self._start_meta(join=False)
        self._tasks.append(asyncio.create_task(self._follow()))

    def _start_meta(self, *, join: bool) -> None:
        import asyncio

        from kvps.node.rebalance import MetaMover, MetaStore, Mover, Rebalancer
        self.meta = MetaService(self.node.cfg, self.node.node_id, self.meta_ids, self.node.data_dir,
                                self.secret(), join=join, ticker=self.node.ticker)
        http = self.node.http
        mover = Mover(http, MetaStore(self.meta), self._node_config, timeout=600)
        meta_mover = MetaMover(http, self.meta, self._node_config, self.node.cfg.shards, timeout=600)
        from kvps.node.leaders import LeaderBalancer
        leaders = LeaderBalancer(mover) if self.node.cfg.server.spread_leaders else None
        from kvps.node.liveness import NodeWatch
        self.watch = NodeWatch(self.meta, http, self._node_config, self.node.node_id, replicas=self.node.cfg.replicas,
                               dead_after=self.node.cfg.server.node_dead_after)
        self._leader_tasks = [
            asyncio.create_task(Rebalancer(self.meta, mover, self.node.cfg.replicas, meta_mover=meta_mover,
                                           leaders=leaders).run()),
            asyncio.create_task(self.watch.run())]

    async def _stop_meta(self) -> None:
        """This node's metadata replica was removed from the group: stop it and follow the
        members from now on. Its journal stays (the journal's own threads may still write it);
        ``meta_members.json``, written first, keeps a restart from starting it again, and only a
        drain removes a metadata replica, so the node itself is removed next."""
        import asyncio
        meta, tasks, self.meta, self._leader_tasks, self.watch = self.meta, self._leader_tasks, None, [], None
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if meta is not None:
            await asyncio.to_thread(meta.stop)
        log.info("node %d: no longer runs a metadata replica", self.node.node_id)

    async def _follow_members(self, members: list[int]) -> None:
        if members == self.meta_ids:
            return
        tmp = self._members_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(members))
        tmp.replace(self._members_path)
        self.meta_ids = list(members)
        if self.node.node_id in members and self.meta is None:
            log.info("node %d: now runs a metadata replica (members %s)", self.node.node_id, members)
            self._start_meta(join=True)
        elif self.node.node_id not in members and self.meta is not None:
            await self._stop_meta()

    def _node_config(self, node_id: int) -> Any:
        """A node's addresses; the metadata state may know a node the follow loop has not yet
        given this node (a move planned right after a join)."""
        if node_id >= len(self.node.cfg.nodes) and self.meta is not None:
            self.node.follow_nodes(self.meta.state().nodes)
        return self.node.cfg.node(node_id)

    async def stop(self) -> None:
        import asyncio
        tasks = [*self._tasks, *self._leader_tasks]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.meta is not None:
            await asyncio.to_thread(self.meta.stop)

    # ---- following ---------------------------------------------------------------------------

    async def fetch(self) -> dict[str, Any] | None:
        """The newest metadata state: the local replica's while it knows a leader, else the
        newest a member answers with (the local replica may have been removed from the group)."""
        own = self.meta.view() if self.meta is not None else None
        if own is not None and self.meta is not None and self.meta.hears_leader():
            return own
        best = own
        for n in self.meta_ids:
            if n == self.node.node_id or n >= len(self.node.cfg.nodes):
                continue
            try:
                data = await self.node.http.json("GET", self.node.cfg.node(n).admin_url + "/v1/meta",
                                                 timeout=1.0)
            except KvpsError:
                continue
            if not isinstance(data, dict) or not isinstance(data.get("version"), int):
                continue
            if best is None or data["version"] > best["version"]:
                best = data
            if own is None:
                break
        return best

    async def _follow(self) -> None:
        import asyncio
        while True:
            try:
                await self.follow_once()
            except Exception:  # noqa: BLE001 - a bad map must not stop following; logged
                log.exception("node %d: following the metadata state failed", self.node.node_id)
            await asyncio.sleep(self.FOLLOW_PERIOD)

    async def follow_once(self) -> None:
        from kvps.assignment import Assignment
        meta = self.meta
        if meta is not None and meta.hears_leader() and meta.version() <= self.version:
            data = None  # nothing new, and no copy of the state made to find that out
        else:
            data = await self.fetch()
        if data is None or data["version"] <= self.version:
            if self.view is not None and self.node.node_id < len(self.view["nodes"]):  # until recorded
                await self.node.check_incarnation(self.view["nodes"][self.node.node_id].get("incarnation"))
            return
        self.view, self.version = data, data["version"]
        self.node.follow_nodes(data["nodes"])
        if "meta_members" in data:
            await self._follow_members([int(n) for n in data["meta_members"]])
        await self.node.set_assignment(Assignment.from_json(data["assignment"]))
        me = data["nodes"][self.node.node_id] if self.node.node_id < len(data["nodes"]) else None
        if me is not None:
            await self.node.check_incarnation(me.get("incarnation"))
            await self.node.check_zone(me.get("zone", ""))
        mine = self.node.identity.incarnation if self.node.identity is not None else None
        # (a replacement whose incarnation is not recorded yet is not the removed node)
        if me is not None and me["state"] == "removed" and not self.node.replicas \
                and me.get("incarnation") in (None, mine):
            log.info("node %d: removed from the cluster; exiting", self.node.node_id)
            self.node.request_stop()

    # ---- HTTP --------------------------------------------------------------------------------

    def add_routes(self, app: Any) -> None:
        from aiohttp import web

        from kvps.node.admin import path_id

        async def get_meta(request: web.Request) -> web.Response:
            data = await self.fetch()
            if data is None:
                raise Unavailable("no metadata replica answered")
            return web.json_response(data)

        async def join(request: web.Request) -> web.Response:
            return await self.guarded(request, self._join)

        async def drain(request: web.Request) -> web.Response:
            return await self.guarded(request, lambda meta, body: self._drain(meta, path_id(request, "node")))

        async def move(request: web.Request) -> web.Response:
            return await self.guarded(request, self._move)

        async def rebalance(request: web.Request) -> web.Response:
            return await self.guarded(request, self._rebalance)

        async def zone(request: web.Request) -> web.Response:
            return await self.guarded(request, lambda meta, body: self._zone(meta, path_id(request, "node"), body))

        app.router.add_get("/v1/meta", get_meta)
        app.router.add_post("/v1/nodes", join)
        app.router.add_post("/v1/nodes/{id}/drain", drain)
        app.router.add_post("/v1/moves", move)
        app.router.add_post("/v1/rebalance", rebalance)
        app.router.add_post("/v1/nodes/{id}/zone", zone)

    async def guarded(self, request: Any, action: Any) -> Any:
        """Body read as a JSON object (the token and its role were checked by the app,
        ``kvps.node.access``), ``action(meta, body)`` run on this node's metadata replica (or the
        call forwarded to a node that runs one). Refusals are answered and logged by the admin
        app's middleware (``kvps.node.admin``)."""
        from aiohttp import web

        from kvps.node.admin import json_body
        body = await json_body(request)
        if self.meta is None:
            return await self._forward(request, body)
        return web.json_response(await action(self.meta, body))

    async def _forward(self, request: Any, body: dict[str, Any]) -> Any:
        """A node without a metadata replica passes the call to one that has it (this node's
        token: the caller's was checked already)."""
        from aiohttp import web
        for n in self.meta_ids:
            url = self.node.cfg.node(n).admin_url + request.rel_url.path
            try:
                return web.json_response(await self.node.http.json("POST", url, body, timeout=10.0))
            except ConnectError:
                continue
            except KvpsError as exc:
                return web.json_response(exc.to_dict(), status=exc.http_status)
        raise Unavailable("no metadata node answered")

    async def _join(self, meta: MetaService, body: dict[str, Any]) -> dict[str, Any]:
        import dataclasses

        from kvps.config import NodeConfig, dump_cluster
        spec = {"host": _field(body, "host", str), "admin_port": _field(body, "admin_port", int),
                "port_base": _field(body, "port_base", int), "scheme": self.node.cfg.nodes[0].scheme}
        incarnation = body.get("incarnation")  # kvps.node.identity (older joiners send none)
        if incarnation is not None and (not isinstance(incarnation, str) or not 0 < len(incarnation) <= 64):
            raise InvalidRequest("field 'incarnation' must be a short string", field="incarnation")
        zone = body.get("zone") or ""
        if not isinstance(zone, str) or len(zone) > 64:
            raise InvalidRequest("field 'zone' must be a short string", field="zone")
        result = await meta.propose({"op": "add_node", **spec, "incarnation": incarnation, "zone": zone})
        nodes = meta.state().nodes
        cfg = dataclasses.replace(self.node.cfg, nodes=tuple(
            NodeConfig(id=n["id"], host=n["host"], admin_port=n["admin_port"], port_base=n["port_base"],
                       data_dir=f"node-{n['id']}", scheme=n["scheme"], zone=n.get("zone", "")) for n in nodes),
            secret_file="secret", token_file="token")
        want_secret = body.get("want_secret", True)
        if not isinstance(want_secret, bool):
            raise InvalidRequest("field 'want_secret' must be a boolean", field="want_secret")
        from kvps.service.auth import read_tokens
        tokens = "\n".join(f"{t} {r}" for t, r in read_tokens(self.node.tokens.path))  # every role's
        return {"id": result["id"], "config": dump_cluster(cfg),
                **({"secret": self.secret().decode(), "tokens": tokens} if want_secret else {}),
                "meta_members": meta.state().meta_members,
                # the new node hosts nothing until the rebalancer places replicas on it (the
                # config's placement, computed over the grown node list, does not apply)
                "assignment": meta.state().assignment.to_json()}

    async def _move(self, meta: MetaService, body: dict[str, Any]) -> dict[str, Any]:
        """Queue one move (``Unavailable`` while another runs); the rebalancer carries it out."""
        await meta.propose({"op": "request_move", "shard": _field(body, "shard", int),
                            "source": _field(body, "source", int), "target": _field(body, "target", int)})
        return {"accepted": True, "rebalance": meta.state().rebalance}

    async def _rebalance(self, meta: MetaService, body: dict[str, Any]) -> dict[str, Any]:
        """``{"auto": false}`` stops evening out the load (drains and queued moves still run)."""
        await meta.propose({"op": "rebalance", "auto": _field(body, "auto", bool)})
        return meta.state().rebalance

    async def _zone(self, meta: MetaService, node_id: int, body: dict[str, Any]) -> dict[str, Any]:
        """Record a node's zone (a node records its own at start: ``Node.check_zone``)."""
        zone = body.get("zone")
        if not isinstance(zone, str) or len(zone) > 64:
            raise InvalidRequest("field 'zone' must be a string of at most 64 characters", field="zone")
        if not 0 <= node_id < len(meta.state().nodes):
            raise InvalidRequest(f"no node {node_id}", field="id")
        return await meta.propose({"op": "set_zone", "id": node_id, "zone": zone})

    async def _drain(self, meta: MetaService, node_id: int) -> dict[str, Any]:
        state = meta.state()
        if not 0 <= node_id < len(state.nodes):
            raise InvalidRequest(f"no node {node_id}", field="id")
        members = state.meta_members
        if node_id in members and state.nodes[node_id]["state"] == "active" and not [
                n for n in state.active_nodes() if n not in members]:
            raise NotDrainable(
                f"node {node_id} cannot be drained now: it runs a replica of the metadata Raft "
                f"group (nodes {', '.join(map(str, members))} do), and no active node outside that "
                f"group can take the replica over. Join a node first (kvps node join), then drain "
                f"node {node_id}", node=node_id, meta_nodes=members)
        if state.nodes[node_id]["state"] == "active":
            await meta.propose({"op": "set_node_state", "id": node_id, "state": "draining"})
        return {"id": node_id, "state": meta.state().nodes[node_id]["state"]}

    def annotate(self, cmap: dict[str, Any]) -> dict[str, Any]:
        """Node states and rebalancing progress, added to a cluster map."""
        view = self.view or {}
        states = {n["id"]: n["state"] for n in view.get("nodes", [])}
        zones = {n["id"]: n.get("zone", "") for n in view.get("nodes", [])}
        for node in cmap["nodes"]:
            node["state"] = states.get(node["id"], "active")
            node["zone"] = zones.get(node["id"], "")
        cmap["membership"] = {"version": view.get("version"), "rebalance": view.get("rebalance"),
                              "meta_nodes": view.get("meta_members", self.meta_ids)}
        return cmap


def _field(body: dict[str, Any], name: str, kind: type) -> Any:
    """A field of an admin request's JSON body, checked: missing or mistyped is ``InvalidRequest``."""
    value = body.get(name)
    if value is None:
        raise InvalidRequest(f"missing field {name!r}", field=name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise InvalidRequest(f"field {name!r} must be {kind.__name__}", field=name)
    if kind is int and not 0 <= value < 1 << 31:
        raise InvalidRequest(f"field {name!r} is out of range", field=name)
    return value
