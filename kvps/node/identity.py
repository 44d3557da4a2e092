"""Which incarnation of a node this data directory is, and whether the cluster agrees.

Raft is safe only while every member keeps its log, term and vote. A node whose whole data
directory was lost (a disk replaced, a PersistentVolume gone) and that starts again under its old
id comes back with empty replicas that would vote at once: with their votes a member that lacks
acknowledged entries can win an election, and those entries are overwritten. Per-shard markers
(``kvps.raft.recovery``) cannot catch it: they were lost with the directory.

So each node directory holds ``identity.json``: the node id and an *incarnation*, a random id made
when the directory is first used. The incarnation is recorded in the metadata group (the node's
entry in the node list, ``set_incarnation``), which every node follows and serves at
``GET /v1/identity``. Before a node starts any replica it asks the other nodes:

* its directory has an identity the cluster knows, or one the cluster has not recorded yet: start;
* its directory has none and the cluster has recorded an incarnation for this id: **refused**, with
  a message saying what to do (join as a new node and drain the old id; or ``--replace``);
* its directory has none and no other node knows an incarnation for the id (a new cluster, whose
  nodes all start empty): start as a new incarnation. With no other node answering yet it waits
  (a lone wiped node must not take silence for a new cluster);
* its identity is another incarnation than the recorded one (an old disk put back after a
  replacement): refused.

``--replace`` makes a new incarnation on purpose and writes ``REPLACED`` into the node directory:
every replica of such a node that starts without data comes up recovering (no vote until it has
caught up, ``kvps.raft.recovery``), so replacing a node loses nothing.

A directory from before identities existed (replicas' data but no ``identity.json``) is adopted:
it is not a lost directory.
"""
from __future__ import annotations

import json
import logging
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvps.errors import ConfigError, InvalidRequest, KvpsError
from kvps.raft.disk import fsync_dir
from kvps.raft.recovery import REPLACED

__all__ = ["IDENTITY", "Identity", "add_routes", "decide", "known_incarnations", "settle"]

log = logging.getLogger("kvps.node")

IDENTITY = "identity.json"
ASK_PERIOD = 0.2        # between rounds of asking the other nodes
KNOWN_WAIT = 3.0        # a node with an identity waits at most this long for answers


@dataclass(frozen=True)
class Identity:
    node: int
    incarnation: str

    @classmethod
    def load(cls, node_dir: Path) -> "Identity | None":
        path = node_dir / IDENTITY
        if not path.exists():
            return None
        try:
            data = json.loads(path.read_text())
            return cls(int(data["node"]), str(data["incarnation"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{path} is damaged ({exc}); it says which incarnation of a node this "
                              f"directory is: restore it, or start with --replace") from None

    def save(self, node_dir: Path) -> None:
        """Durably, before any replica of this incarnation starts."""
        node_dir.mkdir(parents=True, exist_ok=True)
        tmp = node_dir / (IDENTITY + ".tmp")
        with open(tmp, "w") as f:
            json.dump({"node": self.node, "incarnation": self.incarnation}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, node_dir / IDENTITY)
        fsync_dir(node_dir)


def known_incarnations(nodes: list[dict[str, Any]]) -> dict[int, str]:
    """``{node id: incarnation}`` recorded in a metadata node list."""
    return {int(n["id"]): n["incarnation"] for n in nodes if n.get("incarnation")}


def _has_data(node_dir: Path) -> bool:
    """Replicas' data or markers from before identities: a directory in use, not a lost one."""
    hosted = node_dir / "hosted"
    return (hosted.is_dir() and any(hosted.iterdir())) or (node_dir / "assignment.json").exists()


def decide(node_id: int, mine: Identity | None, answers: list[dict[str, Any]], *,
           replace: bool, peers: int) -> tuple[str, str]:
    """``(verdict, reason)``: verdict ``"start"``, ``"new"`` (make an incarnation), ``"wait"`` or
    ``"refuse"``. ``answers``: the other nodes' ``/v1/identity`` replies so far; ``peers``: how
    many other nodes there are."""
    recorded = {a["known"][str(node_id)] for a in answers if str(node_id) in a.get("known", {})}
    if replace:
        return "new", "started with --replace"
    if mine is not None:
        if mine.node != node_id:
            return "refuse", f"this data directory belongs to node {mine.node}, not node {node_id}"
        other = recorded - {mine.incarnation}
        if other:
            return "refuse", (f"this data directory is incarnation {mine.incarnation} of node {node_id}, "
                              f"but the cluster knows node {node_id} as incarnation {sorted(other)[0]} "
                              f"(it was replaced): this directory is stale. Wipe it and join as a new node")
        return "start", "known incarnation"
    if recorded:
        return "refuse", (
            f"node {node_id}'s data directory is missing or empty, but the cluster knows node {node_id} "
            f"(incarnation {sorted(recorded)[0]}): its replicas would vote with empty logs and could "
            f"lose acknowledged pushes. Start a new node instead (kvps node join) and drain node "
            f"{node_id}; or, if this host takes node {node_id}'s place, start it with --replace (its "
            f"replicas come back recovering and vote only once they have caught up)")
    if peers == 0 or answers:
        return "new", "no other node knows this id (a new cluster)"
    return "wait", "no other node has answered yet"


async def settle(node: Any, *, replace: bool = False, clock: Any = None) -> Identity:
    """This node's identity, checked with the other nodes (see the module docstring); raises
    ``ConfigError`` when the node must not start under its id."""
    import asyncio
    import time
    clock = clock or time.monotonic
    node_dir: Path = node.data_dir
    mine = Identity.load(node_dir)
    if mine is None and not replace and _has_data(node_dir):
        mine = Identity(node.node_id, uuid.uuid4().hex)  # a directory from before identities
        mine.save(node_dir)
        log.info("node %d: adopted its data directory as incarnation %s", node.node_id, mine.incarnation)
    others = [n for n in node.cfg.nodes if n.id != node.node_id]
    started, said = clock(), 0.0
    while True:
        answers = await _ask(node, others)
        verdict, reason = decide(node.node_id, mine, answers, replace=replace, peers=len(others))
        if verdict == "wait" and mine is not None:
            verdict = "start"
        if verdict == "start" and mine is not None and len(answers) < len(others) \
                and clock() - started < KNOWN_WAIT:
            verdict = "wait"  # give the others a moment to say whether they know another incarnation
        if verdict == "refuse":
            raise ConfigError(f"node {node.node_id} refused to start: {reason}")
        if verdict == "start":
            return mine
        if verdict == "new":
            fresh = Identity(node.node_id, uuid.uuid4().hex)
            if replace:
                (node_dir / REPLACED).parent.mkdir(parents=True, exist_ok=True)
                (node_dir / REPLACED).write_text(f"replaced by incarnation {fresh.incarnation}\n")
            fresh.save(node_dir)
            log.warning("node %d: new incarnation %s (%s)", node.node_id, fresh.incarnation, reason)
            return fresh
        if clock() - said > 10.0:
            said = clock()
            log.warning("node %d: its data directory holds no identity; waiting for another node "
                        "to say whether the cluster knows node %d", node.node_id, node.node_id)
        await asyncio.sleep(ASK_PERIOD)  # a round of asking, not a wait on a condition here


async def _ask(node: Any, others: list[Any]) -> list[dict[str, Any]]:
    import asyncio

    async def one(n: Any) -> dict[str, Any] | None:
        try:
            data = await node.http.json("GET", n.admin_url + "/v1/identity", timeout=1.0)
        except KvpsError:
            return None
        return data if isinstance(data, dict) and isinstance(data.get("known"), dict) else None

    return [a for a in await asyncio.gather(*(one(n) for n in others)) if a is not None]


def add_routes(app: Any, node: Any) -> None:
    """``GET /v1/identity``: this node's incarnation and the ones it knows of the others.
    ``POST /v1/nodes/{id}/incarnation``: record a node's incarnation in the metadata group."""
    from aiohttp import web

    async def get_identity(request: web.Request) -> web.Response:  # token: kvps.node.access
        mine = node.identity
        return web.json_response({"node": node.node_id, "incarnation": mine.incarnation if mine else None,
                                  "known": {str(k): v for k, v in node.known_incarnations().items()}})

    async def record(meta: Any, body: dict[str, Any], node_id: int) -> dict[str, Any]:
        incarnation, replaces = body.get("incarnation"), body.get("replaces")
        if not isinstance(incarnation, str) or not incarnation or len(incarnation) > 64:
            raise InvalidRequest("field 'incarnation' must be a non-empty string", field="incarnation")
        if replaces is not None and not isinstance(replaces, str):
            raise InvalidRequest("field 'replaces' must be a string or null", field="replaces")
        return await meta.propose({"op": "set_incarnation", "id": node_id,
                                   "incarnation": incarnation, "replaces": replaces})

    async def post_incarnation(request: web.Request) -> web.Response:
        from kvps.node.admin import path_id  # ASCII digits only ("²" passes str.isdigit, not int)
        return await node.membership.guarded(
            request, lambda meta, body: record(meta, body, path_id(request, "node")))

    app.router.add_get("/v1/identity", get_identity)
    app.router.add_post("/v1/nodes/{id}/incarnation", post_incarnation)
