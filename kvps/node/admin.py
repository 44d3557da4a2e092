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
import json
import logging
import re
from typing import TYPE_CHECKING, Any

from aiohttp import web

from kvps.assignment import Assignment
from kvps.config import ClusterConfig
from kvps.errors import InvalidRequest, KeyNotFound, KvpsError, RequestTooLarge, Timeout
from kvps.node import identity
from kvps.node.access import authorize
from kvps.node.metrics import merge_expositions
from kvps.node.openapi import document
from kvps.replica.dataplane import request_id_of
from kvps.replica.metrics import CONTENT_TYPE

if TYPE_CHECKING:
    from kvps.node.node import Node

__all__ = ["ADMIN_MAX_BODY", "build_cluster_map", "cluster_view", "json_body", "make_app",
           "metrics_text", "node_view", "path_id", "shard_view"]

log = logging.getLogger("kvps.admin")

# Admin bodies are a few fields (the largest, a join, is ~100 bytes): anything near this is hostile.
ADMIN_MAX_BODY = 64 * 1024

# ASCII digits only: str.isdigit() and int() also accept "²", "١" or "1_0".
_ID = re.compile(r"^[0-9]{1,9}$")


def path_id(request: web.Request, what: str) -> int:
    """The ``{id}`` of an admin path as a non-negative integer; anything else is ``InvalidRequest``."""
    text = request.match_info["id"]
    if not _ID.match(text):
        raise InvalidRequest(f"bad {what} id {text[:64]!r}: a non-negative integer", field="id")
    return int(text)


async def json_body(request: web.Request) -> dict[str, Any]:
    """The request's body as a JSON object (``{}`` when there is none); anything else, including
    JSON nested past the parser's recursion limit, is ``InvalidRequest``."""
    raw = await request.read()  # cached by the middleware (can_read_body is False after that)
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise InvalidRequest(f"the body is not JSON: {str(exc)[:100]}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    return body


def _refusal(status: int, reason: str) -> tuple[KvpsError, int]:
    """aiohttp's own refusals (no such route, method, a body over the cap) as kvps errors, with
    aiohttp's status (405 stays 405: an ``InvalidRequest`` the client need not retry)."""
    if status == 413:
        return RequestTooLarge(f"admin request bodies are at most {ADMIN_MAX_BODY} bytes"), 413
    if status == 404:
        return KeyNotFound("no such admin route"), 404
    return InvalidRequest(reason), status


def _error_middleware(node: "Node"):
    """One boundary for every admin route: the body read here (capped, within
    ``server.body_timeout``; handlers get it cached), kvps errors and aiohttp's 4xx answered as
    kvps error JSON, each refusal a log line. Anything else is a bug: aiohttp logs it as a 500."""
    body_timeout = node.cfg.server.body_timeout

    @web.middleware
    async def errors(request: web.Request, handler: Any) -> web.StreamResponse:
        rid = request_id_of(request)
        try:
            if request.can_read_body:
                try:
                    await asyncio.wait_for(request.read(), body_timeout)
                except asyncio.TimeoutError:
                    raise Timeout(f"the request body did not arrive within {body_timeout} s") from None
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            err, status = _refusal(exc.status, exc.reason)
        except KvpsError as exc:
            err, status = exc, exc.http_status
        if status < 500:
            log.info("node %d: %s %s [%s] refused: %s: %s", node.node_id, request.method,
                     request.rel_url.path[:200], rid, type(err).__name__, err.message)
        return web.json_response(err.to_dict(), status=status, headers={"X-Request-Id": rid})

    return errors


def node_view(node: "Node") -> dict[str, Any]:
    replicas = []
    for rp in node.replicas.values():
        alive, pid = rp.alive, rp.pid
        st = rp.status or {}
        if not alive or st.get("pid") != pid:
            st = {}  # a status polled from a process that has since died or been replaced
        replicas.append({
            "shard": rp.shard, "node": node.node_id, "alive": alive,
            "pid": pid, "restarts": rp.restarts,
            "raft": node.cfg.node(node.node_id).raft_address(rp.shard),
            "data_url": node.cfg.node(node.node_id).data_url(rp.shard),
            # where its node serves the binary data plane (kvps.delta.wire), while it does
            **({"wire": f"{node.cfg.node(node.node_id).host}:{node.cfg.wire_port(node.node_id)}"}
               if getattr(node, "wire", None) is not None else {}),
            "role": st.get("role", "unknown"), "term": st.get("term"), "won_by": st.get("won_by"),
            "leader": st.get("leader"), "serving": st.get("serving", False),
            "commit_index": st.get("commit_index"), "applied_index": st.get("applied_index"),
            "log_entries": st.get("log_entries"), "recovering": st.get("recovering", False),
            "recovering_reason": st.get("recovering_reason"),
        })
    return {"node": node.node_id, "admin_url": node.cfg.node(node.node_id).admin_url,
            "replicas": replicas, "tickers": [t.status() for t in node.tickers]}

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
    app = web.Application(client_max_size=ADMIN_MAX_BODY,  # roles: kvps.node.access
                          middlewares=[_error_middleware(node), authorize(node.tokens, node.node_id)])

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
        shard_id = path_id(request, "shard")
        if shard_id >= node.cfg.shards:
            raise KeyNotFound(f"no shard {shard_id}", shard=shard_id)
        return web.json_response(await shard_view(node, shard_id))

    async def keys(request: web.Request) -> web.Response:
        from kvps_client import Client  # the node reads keys like any client would
        async with Client([node.cfg.node(node.node_id).admin_url], token=node.token,
                          timeout=5.0, ssl=node._client_ssl) as c:
            return web.json_response({"keys": await c.keys()})

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
        up = rp.alive
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
