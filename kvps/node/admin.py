"""The node's admin HTTP API (aiohttp) and the views it serves.

``/healthz``, ``/readyz`` (every hosted replica knows a leader), ``/metrics`` (the node's series
and its replicas', merged), ``/v1/node`` (this node's replicas), ``/v1/cluster`` (every node's
replicas, gathered on request: the map clients route with), ``/v1/shards/{id}``, ``/v1/keys``,
``/v1/assignment``, ``/v1/openapi.json``; the snapshot routes (``kvps.node.snapshot_api``) and the
membership routes (``kvps.node.meta_service``) are added by their owners. Every route but
``/healthz``, ``/readyz`` and ``/metrics`` needs a token of the role ``kvps.node.access`` names.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from aiohttp import web

from kvps.assignment import Assignment
from kvps.config import ClusterConfig
from kvps.errors import KvpsError
from kvps.node import identity
from kvps.node.access import authorize
from kvps.node.metrics import merge_expositions
from kvps.node.openapi import document
from kvps.replica.metrics import CONTENT_TYPE

if TYPE_CHECKING:
    from kvps.node.node import Node

__all__ = ["build_cluster_map", "cluster_view", "make_app", "metrics_text", "node_view", "shard_view"]


def node_view(node: "Node") -> dict[str, Any]:
    replicas = []
    for rp in node.replicas.values():
        alive = rp.proc is not None and rp.proc.poll() is None
        st = rp.status or {}
        if not alive or st.get("pid") != rp.proc.pid:
            st = {}  # a status polled from a process that has since died or been replaced
        replicas.append({
            "shard": rp.shard, "node": node.node_id, "alive": alive,
            "pid": rp.proc.pid if alive else None, "restarts": rp.restarts,
            "raft": node.cfg.node(node.node_id).raft_address(rp.shard),
            "data_url": node.cfg.node(node.node_id).data_url(rp.shard),
            "role": st.get("role", "unknown"), "term": st.get("term"),
            "leader": st.get("leader"), "serving": st.get("serving", False),
            "commit_index": st.get("commit_index"), "applied_index": st.get("applied_index"),
            "log_entries": st.get("log_entries"), "recovering": st.get("recovering", False),
            "recovering_reason": st.get("recovering_reason"),
        })
    return {"node": node.node_id, "admin_url": node.cfg.node(node.node_id).admin_url,
            "replicas": replicas}

async def cluster_view(node: "Node") -> dict[str, Any]:
    async def fetch(node_id: int) -> dict[str, Any] | None:
        if node_id == node.node_id:
            return node_view(node)
        try:
            return await node.http.json("GET", node.cfg.node(node_id).admin_url + "/v1/node",
                                        timeout=0.5)
        except KvpsError:
            return None

    views = await asyncio.gather(*(fetch(n.id) for n in node.cfg.nodes))
    return node.membership.annotate(build_cluster_map(node.cfg, views, node.assignment))

def make_app(node: "Node") -> web.Application:
    app = web.Application(middlewares=[authorize(node.tokens, node.node_id)])  # roles: kvps.node.access

    async def healthz(request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(request: web.Request) -> web.Response:
        missing = [rp.shard for rp in node.replicas.values()
                   if not rp.status or (rp.status.get("leader") is None
                                        and rp.status.get("leader_url") is None)]
        if missing:
            return web.json_response({"ready": False, "shards_without_leader": missing}, status=503)
        return web.json_response({"ready": True})

    async def this_node(request: web.Request) -> web.Response:
        return web.json_response(node_view(node))

    async def cluster(request: web.Request) -> web.Response:
        return web.json_response(await cluster_view(node))

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=await metrics_text(node), headers={"Content-Type": CONTENT_TYPE})

    async def shard(request: web.Request) -> web.Response:
        try:
            shard_id = int(request.match_info["id"])
        except ValueError:
            shard_id = -1
        if not 0 <= shard_id < node.cfg.shards:
            return web.json_response({"error": "KeyNotFound", "message": "no such shard"}, status=404)
        return web.json_response(await shard_view(node, shard_id))

    async def keys(request: web.Request) -> web.Response:
        from kvps_client import Client  # the node reads keys like any client would
        try:
            async with Client([node.cfg.node(node.node_id).admin_url], token=node.token,
                              timeout=5.0, ssl=node._client_ssl) as c:
                return web.json_response({"keys": await c.keys()})
        except KvpsError as exc:
            return web.json_response(exc.to_dict(), status=exc.http_status)

    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/node", this_node)
    app.router.add_get("/v1/cluster", cluster)
    app.router.add_get("/v1/shards/{id}", shard)
    node.snapshots.add_routes(app)

    async def get_assignment(request: web.Request) -> web.Response:
        return web.json_response(node.assignment.to_json())

    app.router.add_get("/v1/assignment", get_assignment)
    node.membership.add_routes(app)
    identity.add_routes(app, node)

    async def openapi(request: web.Request) -> web.Response:
        return web.json_response(document())

    app.router.add_get("/v1/keys", keys)
    app.router.add_get("/v1/openapi.json", openapi)
    return app

async def metrics_text(node: "Node") -> str:
    """This node's series plus every local replica's, as one exposition."""
    for rp in node.replicas.values():
        up = rp.proc is not None and rp.proc.poll() is None
        node.metrics.replica_up.labels(shard=str(rp.shard), node=str(node.node_id)).set(1 if up else 0)

    async def one(rp: Any) -> str:
        try:
            return await node.http.text(node.cfg.node(node.node_id).data_url(rp.shard) + "/metrics",
                                        timeout=1.0)
        except KvpsError:
            return ""

    texts = await asyncio.gather(*(one(rp) for rp in node.replicas.values()))
    return merge_expositions([node.metrics.expose(), *texts])

async def shard_view(node: "Node", shard_id: int) -> dict[str, Any]:
    """One shard in detail: its replicas, and the leader's view of lag, batching, hot keys."""
    cmap = await cluster_view(node)
    view = cmap["shards"][shard_id]
    leader = next((r for r in view["replicas"] if r.get("role") == "leader"), None)
    detail: dict[str, Any] = {}
    if leader is not None:
        try:
            detail = await node.http.json("GET", leader["data_url"] + "/v1/status", timeout=1.0)
        except KvpsError:
            pass
    counters = detail.get("counters", {})
    batches = counters.get("batches", 0)
    return {**view,
            "lag": detail.get("peers", {}),
            "hot_keys": detail.get("hot_keys", []),
            "in_flight_bytes": detail.get("in_flight_bytes"),
            "batches": batches,
            "mean_batch_pushes": round(counters.get("batched_pushes", 0) / batches, 2) if batches else None,
            "counters": counters}


def build_cluster_map(cfg: ClusterConfig, views: list[dict[str, Any] | None],
                      assignment: Assignment | None = None) -> dict[str, Any]:
    """Merge per-node views into the cluster map clients route with."""
    assignment = assignment or Assignment.initial(cfg)
    by_replica: dict[tuple[int, int], dict] = {}
    nodes = []
    for node_cfg, view in zip(cfg.nodes, views):
        nodes.append({"id": node_cfg.id, "admin_url": node_cfg.admin_url, "reachable": view is not None})
        for rep in (view or {}).get("replicas", []):
            by_replica[(rep["shard"], rep["node"])] = rep
    shards = []
    for s in range(cfg.shards):
        reps = []
        for n in assignment.nodes_of(s):
            rep = by_replica.get((s, n)) or {
                "shard": s, "node": n, "alive": False, "pid": None, "role": "unknown",
                "raft": cfg.node(n).raft_address(s), "data_url": cfg.node(n).data_url(s),
                "term": None, "leader": None, "commit_index": None, "applied_index": None}
            reps.append(rep)
        leaders = [r for r in reps if r.get("role") == "leader"]
        leader = max(leaders, key=lambda r: r.get("term") or 0) if leaders else None
        shards.append({
            "id": s,
            "leader": leader["node"] if leader else None,
            "leader_url": leader["data_url"] if leader else None,
            "term": max((r.get("term") or 0) for r in reps),
            "replicas": reps,
        })
    return {
        "cluster": {"shards": cfg.shards, "replicas": cfg.replicas, "block_bytes": cfg.block_bytes,
                    "max_push_bytes": cfg.raft.max_command_bytes // 2,
                    "assignment_version": assignment.version},
        "nodes": nodes,
        "shards": shards,
    }
