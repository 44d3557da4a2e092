"""The metadata Raft group in a node process: ``MetaState`` behind a ``ShardGroup``.

The first three nodes of the initial cluster (``kvps.meta.meta_nodes``) each run one metadata
replica inside their node process (its Raft port is the one after the node's shard ports,
``kvps.meta.meta_address``). Any replica proposes: pysyncobj forwards a follower's proposal to the
leader. Reads are the local replica's applied state (a follower may be a little behind; every
reader compares versions, which only grow).

Nodes that do not run a metadata replica read the map from one that does (``GET /v1/meta``).
"""
from __future__ import annotations

import copy
import json
import logging
import threading
from pathlib import Path
from typing import Any

from kvps.config import ClusterConfig
from kvps.errors import InvalidRequest, NotDrainable, Unavailable, VersionConflict
from kvps.meta import MetaState, meta_address
from kvps.raft import bridge
from kvps.raft.group import ShardGroup

__all__ = ["MetaService"]

log = logging.getLogger("kvps.meta")


class MetaService:
    def __init__(self, cfg: ClusterConfig, node_id: int, members: list[int], data_dir: Path,
                 secret: bytes) -> None:
        self._lock = threading.Lock()
        self._state = MetaState.initial(cfg)
        addresses = [meta_address(cfg.node(n), cfg.shards) for n in members]
        self.address = meta_address(cfg.node(node_id), cfg.shards)
        self.group = ShardGroup(
            self_address=self.address, peers=[a for a in addresses if a != self.address],
            raft=cfg.raft, secret=secret, context="kvps/meta", journal_dir=data_dir / "meta",
            applier=self._apply, snapshot_state=self._snapshot, restore_state=self._restore)

    # ---- tick thread -------------------------------------------------------------------------

    def _apply(self, data: bytes) -> Any:
        try:
            command = json.loads(bytes(data))
        except ValueError as exc:
            return {"error": f"undecodable meta command: {exc}"}
        with self._lock:
            return self._state.apply(command)

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
                                                "leader": st["leader"], "term": st["term"]}}

    def is_leader(self) -> bool:
        return self.group.is_leader()

    async def propose(self, command: dict[str, Any]) -> dict[str, Any]:
        """Replicate ``command``; its result, or ``VersionConflict`` / ``Unavailable``."""
        result = await bridge.propose(self.group, json.dumps(command, sort_keys=True).encode())
        if isinstance(result, BaseException):
            raise result
        if "error" in result:
            if result.get("conflict"):
                raise VersionConflict(result["error"])
            if result.get("busy"):
                raise Unavailable(result["error"])
            raise InvalidRequest(f"meta command {command.get('op')} refused: {result['error']}")
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
        self.meta_ids = meta_nodes([n.id for n in node.cfg.nodes])
        self.meta: MetaService | None = None
        self.version = -1
        self.view: dict[str, Any] | None = None  # the newest metadata state seen
        self._tasks: list[Any] = []

    def secret(self) -> bytes:
        return (self.node.config_path.parent / self.node.cfg.secret_file).read_bytes().strip()

    def start(self) -> None:
        import asyncio
        if self.node.node_id in self.meta_ids:
            self.meta = MetaService(self.node.cfg, self.node.node_id, self.meta_ids,
                                    self.node.data_dir, self.secret())
        self._tasks.append(asyncio.create_task(self._follow()))
        if self.meta is not None:
            from kvps.rebalance import MetaStore, Mover, Rebalancer, _Http
            http = _Http(self.node._session, self.node.token)
            mover = Mover(http, MetaStore(self.meta), self._node_config, timeout=600)
            self._tasks.append(asyncio.create_task(
                Rebalancer(self.meta, mover, self.node.cfg.replicas).run()))

    def _node_config(self, node_id: int) -> Any:
        """A node's addresses; the metadata state may know a node the follow loop has not yet
        given this node (a move planned right after a join)."""
        if node_id >= len(self.node.cfg.nodes) and self.meta is not None:
            self.node.follow_nodes(self.meta.state().nodes)
        return self.node.cfg.node(node_id)

    async def stop(self) -> None:
        import asyncio
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.meta is not None:
            await asyncio.to_thread(self.meta.stop)

    # ---- following ---------------------------------------------------------------------------

    async def fetch(self) -> dict[str, Any] | None:
        """The newest metadata state: the local replica's, else the first metadata node's."""
        if self.meta is not None:
            return self.meta.view()
        import aiohttp
        for n in self.meta_ids:
            url = self.node.cfg.node(n).admin_url + "/v1/meta"
            try:
                async with self.node._session.get(url, timeout=aiohttp.ClientTimeout(total=1.0)) as r:
                    if r.status == 200:
                        return await r.json()
            except (aiohttp.ClientError, OSError, ValueError, TimeoutError):
                continue
        return None

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
        data = await self.fetch()
        if data is None or data["version"] <= self.version:
            return
        self.view, self.version = data, data["version"]
        self.node.follow_nodes(data["nodes"])
        await self.node.set_assignment(Assignment.from_json(data["assignment"]))
        me = data["nodes"][self.node.node_id] if self.node.node_id < len(data["nodes"]) else None
        if me is not None and me["state"] == "removed" and not self.node.replicas:
            log.info("node %d: removed from the cluster; exiting", self.node.node_id)
            self.node.request_stop()

    # ---- HTTP --------------------------------------------------------------------------------

    def add_routes(self, app: Any) -> None:
        from aiohttp import web

        from kvps.errors import KvpsError

        async def get_meta(request: web.Request) -> web.Response:
            data = await self.fetch()
            if data is None:
                return web.json_response({"error": "Unavailable", "message": "no metadata replica answered"},
                                         status=503)
            return web.json_response(data)

        async def guarded(request: web.Request, action) -> web.Response:
            try:
                self.node._check_token(request)
                if self.meta is None:
                    return await self._forward(request)
                return web.json_response(await action(await request.json()))
            except KvpsError as exc:
                return web.json_response(exc.to_dict(), status=exc.http_status)
            except ValueError as exc:
                return web.json_response({"error": "InvalidRequest", "message": str(exc)}, status=400)

        async def join(request: web.Request) -> web.Response:
            return await guarded(request, self._join)

        async def drain(request: web.Request) -> web.Response:
            node_id = request.match_info["id"]
            return await guarded(request, lambda body: self._drain(int(node_id)))

        async def move(request: web.Request) -> web.Response:
            return await guarded(request, self._move)

        async def rebalance(request: web.Request) -> web.Response:
            return await guarded(request, self._rebalance)

        app.router.add_get("/v1/meta", get_meta)
        app.router.add_post("/v1/nodes", join)
        app.router.add_post("/v1/nodes/{id}/drain", drain)
        app.router.add_post("/v1/moves", move)
        app.router.add_post("/v1/rebalance", rebalance)

    async def _forward(self, request: Any) -> Any:
        import aiohttp
        from aiohttp import web
        body = await request.read()
        for n in self.meta_ids:
            url = self.node.cfg.node(n).admin_url + request.rel_url.path
            try:
                async with self.node._session.post(url, data=body, headers={
                        "Authorization": request.headers.get("Authorization", ""),
                        "Content-Type": "application/json"}, timeout=aiohttp.ClientTimeout(total=10)) as r:
                    return web.Response(body=await r.read(), status=r.status,
                                        content_type="application/json")
            except (aiohttp.ClientError, OSError, TimeoutError):
                continue
        return web.json_response({"error": "Unavailable", "message": "no metadata node answered"}, status=503)

    async def _join(self, body: dict[str, Any]) -> dict[str, Any]:
        import dataclasses

        from kvps.config import NodeConfig, dump_cluster
        assert self.meta is not None
        spec = {"host": str(body["host"]), "admin_port": int(body["admin_port"]),
                "port_base": int(body["port_base"]), "scheme": self.node.cfg.nodes[0].scheme}
        result = await self.meta.propose({"op": "add_node", **spec})
        nodes = self.meta.state().nodes
        cfg = dataclasses.replace(self.node.cfg, nodes=tuple(
            NodeConfig(id=n["id"], host=n["host"], admin_port=n["admin_port"], port_base=n["port_base"],
                       data_dir=f"node-{n['id']}", scheme=n["scheme"]) for n in nodes),
            secret_file="secret", token_file="token")
        return {"id": result["id"], "config": dump_cluster(cfg), "secret": self.secret().decode(),
                # the new node hosts nothing until the rebalancer places replicas on it (the
                # config's placement, computed over the grown node list, does not apply)
                "assignment": self.meta.state().assignment.to_json()}

    async def _move(self, body: dict[str, Any]) -> dict[str, Any]:
        """Queue one move (``Unavailable`` while another runs); the rebalancer carries it out."""
        assert self.meta is not None
        await self.meta.propose({"op": "request_move", "shard": int(body["shard"]),
                                 "source": int(body["source"]), "target": int(body["target"])})
        return {"accepted": True, "rebalance": self.meta.state().rebalance}

    async def _rebalance(self, body: dict[str, Any]) -> dict[str, Any]:
        """``{"auto": false}`` stops evening out the load (drains and queued moves still run)."""
        assert self.meta is not None
        if not isinstance(body.get("auto"), bool):
            raise InvalidRequest("body must be {\"auto\": true|false}", field="auto")
        await self.meta.propose({"op": "rebalance", "auto": body["auto"]})
        return self.meta.state().rebalance

    async def _drain(self, node_id: int) -> dict[str, Any]:
        assert self.meta is not None
        if node_id in self.meta_ids:
            raise NotDrainable(
                f"node {node_id} cannot be drained: it runs a replica of the metadata Raft group "
                f"(nodes {', '.join(map(str, self.meta_ids))} do), and those replicas do not move "
                f"to other nodes. To retire its host, restart node {node_id} on a new machine with "
                f"the same host address, or with a cluster.toml that points its host at the new "
                f"address (deploy/README.md)", node=node_id, meta_nodes=self.meta_ids)
        state = self.meta.state()
        if not 0 <= node_id < len(state.nodes):
            raise InvalidRequest(f"no node {node_id}", field="id")
        if state.nodes[node_id]["state"] == "active":
            await self.meta.propose({"op": "set_node_state", "id": node_id, "state": "draining"})
        return {"id": node_id, "state": self.meta.state().nodes[node_id]["state"]}

    def annotate(self, cmap: dict[str, Any]) -> dict[str, Any]:
        """Node states and rebalancing progress, added to a cluster map."""
        view = self.view or {}
        states = {n["id"]: n["state"] for n in view.get("nodes", [])}
        for node in cmap["nodes"]:
            node["state"] = states.get(node["id"], "active")
        cmap["membership"] = {"version": view.get("version"), "rebalance": view.get("rebalance"),
                              "meta_nodes": self.meta_ids}
        return cmap
