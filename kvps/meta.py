"""The cluster map as replicated state: the node list and the shard -> replicas assignment.

Pure (no I/O). ``MetaState`` is the state machine of the small metadata Raft group that runs on the
cluster's first nodes (``meta_nodes``); ``kvps/meta_service.py`` wires it to a ``ShardGroup``.
Commands are JSON objects (``{"op": ...}``); ``apply`` is deterministic, never raises, and returns
an ``Applied`` (``kvps.machine``) whose result is ``{"ok": ...}`` or a ``KvpsError`` value. The state serializes to canonical JSON
(same commands => same bytes).

Nodes are never deleted from the list, only marked ``removed``: ids stay 0..n-1, so a node's id is
its index in ``ClusterConfig.nodes`` everywhere. A node is ``active`` (may host replicas),
``draining`` (its replicas are moving away; the rebalancer places nothing on it), ``dead`` (the
metadata leader could not reach it for ``server.node_dead_after``: its replicas are re-created
elsewhere, the dead one removed from its group first) or ``removed`` (hosts nothing; its process
exits). ``dead`` is not undone by the node coming back (it is drained like a draining one and
joins again as a new node), only by a replacement: ``kvps node --replace`` records a new
incarnation under the id, an empty node whose replicas recover before they vote, and makes a
dead or removed node active again.

Each node may name a ``zone`` (a failure domain); a node without one is a domain of its own.
Placement keeps a shard's replicas in distinct domains whenever enough domains are live.

``rebalance`` is progress the rebalancer reports (what it is moving, how many moves are done),
replicated so that every node shows it and a new meta leader knows an interrupted move.

``meta_members`` are the nodes that run the metadata group's replicas: the first three at first;
draining one of them moves its metadata replica to another node, one change at a time, like a
shard replica (``set_meta_members`` adds the target, then drops the source).
"""
from __future__ import annotations

import json
from typing import Any

from kvps.assignment import Assignment
from kvps.errors import InvalidRequest, KvpsError, Unavailable, VersionConflict
from kvps.machine import Applied

__all__ = ["LEAVING", "MetaState", "NODE_STATES", "meta_address", "meta_nodes", "plan_meta_move", "plan_move"]

NODE_STATES = ("active", "draining", "dead", "removed")
LEAVING = ("draining", "dead")  # states whose replicas move away
META_REPLICAS = 3
_NODE_FIELDS = ("host", "admin_port", "port_base", "scheme")


def meta_nodes(initial_node_ids: list[int]) -> list[int]:
    """The nodes that run the metadata group: the first three of the initial cluster."""
    return sorted(initial_node_ids)[:META_REPLICAS]


def meta_address(node: Any, shards: int) -> str:
    """Raft address of ``node``'s metadata replica: the port after its shard ports."""
    return f"{node.host}:{node.port_base + 2 * shards}"


class MetaState:
    def __init__(self, nodes: list[dict[str, Any]], assignment: Assignment,
                 meta_members: list[int] | None = None) -> None:
        self.nodes = nodes  # index = node id; {"id", "host", "admin_port", "port_base", "scheme", "state",
        # "incarnation" (once recorded)}
        self.assignment = assignment
        # the nodes running a metadata replica (states written before it existed: the first three)
        self.meta_members = sorted(meta_members) if meta_members is not None else \
            meta_nodes([n["id"] for n in nodes])
        self.version = 0  # bumped by every change
        # auto: even out the load by itself (drains and requested moves run either way)
        self.rebalance: dict[str, Any] = {"moving": None, "moves_done": 0, "last": None, "auto": True}

    @classmethod
    def initial(cls, cfg: Any) -> "MetaState":
        nodes = [{"id": n.id, **{f: getattr(n, f) for f in _NODE_FIELDS}, "state": "active",
                  **({"zone": n.zone} if n.zone else {})} for n in cfg.nodes]
        return cls(nodes, Assignment.initial(cfg))

    # ---- the state machine ---------------------------------------------------------------------

    def apply(self, command: dict[str, Any]) -> Applied:
        op = command.get("op") if isinstance(command, dict) else None
        handler = getattr(self, f"_apply_{op}", None) if isinstance(op, str) else None
        if handler is None:
            return Applied(InvalidRequest(f"unknown meta command {op!r}"))
        try:
            result = handler(command)
        except KvpsError as exc:  # handlers raise only before they change anything
            return Applied(exc)
        except (KeyError, TypeError, ValueError) as exc:
            return Applied(InvalidRequest(f"bad {op} command: {type(exc).__name__}: {exc}"))
        self.version += 1
        return Applied({**result, "version": self.version})

    def _apply_add_node(self, c: dict[str, Any]) -> dict[str, Any]:
        spec = {f: c[f] for f in _NODE_FIELDS}
        incarnation = c.get("incarnation")  # kvps.node.identity; None from older joiners
        zone = c.get("zone") or ""
        if not isinstance(zone, str):
            raise InvalidRequest("a node's zone must be a string")
        for node in self.nodes:  # the same node asking again (a retried join) gets its id back
            if {f: node[f] for f in _NODE_FIELDS} == spec and node["state"] != "removed":
                known = node.get("incarnation")
                if incarnation and known and known != incarnation:
                    # the same address, another data directory: never the old id (its replicas
                    # would vote with empty logs); the old node leaves first
                    raise InvalidRequest(
                        f"node {node['id']} is registered at {spec['host']} with these ports as another "
                        f"incarnation ({known}); a node with a new data directory cannot take its id. "
                        f"Drain node {node['id']} (kvps node drain {node['id']}), then join again")
                if incarnation and not known:
                    node["incarnation"] = incarnation
                return {"ok": True, "id": node["id"], "existing": True}
        for node in self.nodes:
            if node["state"] != "removed" and node["host"] == spec["host"] and (
                    node["admin_port"] == spec["admin_port"] or node["port_base"] == spec["port_base"]):
                raise InvalidRequest(f"node {node['id']} already uses these ports on {spec['host']}")
        node_id = len(self.nodes)
        self.nodes.append({"id": node_id, **spec, "state": "active",
                           **({"incarnation": incarnation} if incarnation else {}),
                           **({"zone": zone} if zone else {})})
        return {"ok": True, "id": node_id}

    def _apply_set_incarnation(self, c: dict[str, Any]) -> dict[str, Any]:
        """Record the incarnation a node's data directory is (``kvps.node.identity``). A recorded
        one is only replaced by a node that names it in ``replaces`` (``--replace``)."""
        node_id, incarnation, replaces = int(c["id"]), c["incarnation"], c.get("replaces")
        if not 0 <= node_id < len(self.nodes) or not isinstance(incarnation, str) or not incarnation:
            raise InvalidRequest(f"bad incarnation for node {node_id}")
        node = self.nodes[node_id]
        known = node.get("incarnation")
        if known is not None and known != incarnation and known != replaces:
            raise InvalidRequest(f"node {node_id} is incarnation {known}; {incarnation} does not replace it")
        node["incarnation"] = incarnation
        if known is not None and known == replaces and node["state"] in ("dead", "removed"):
            # a replacement (--replace) of a node declared dead or already removed: a new, empty
            # node under the old id (its replicas recover before they vote), so it may host again
            node["state"] = "active"
        return {"ok": True}

    def _apply_set_zone(self, c: dict[str, Any]) -> dict[str, Any]:
        """A node's failure domain, as the node itself says at start (``kvps node --zone``)."""
        node_id, zone = int(c["id"]), c["zone"]
        if not 0 <= node_id < len(self.nodes) or not isinstance(zone, str) or len(zone) > 64:
            raise InvalidRequest(f"bad zone for node {node_id}")
        if zone:
            self.nodes[node_id]["zone"] = zone
        else:
            self.nodes[node_id].pop("zone", None)
        return {"ok": True}

    def _apply_set_node_state(self, c: dict[str, Any]) -> dict[str, Any]:
        node_id, state = int(c["id"]), c["state"]
        if state not in NODE_STATES or not 0 <= node_id < len(self.nodes):
            raise InvalidRequest(f"bad node state change {node_id} -> {state!r}")
        current = self.nodes[node_id]["state"]
        if current == "removed" or (current == "dead" and state in ("active", "draining")):
            raise InvalidRequest(f"node {node_id} is {current}: it cannot become {state}")
        if state == "removed" and self.assignment.shards_of(node_id):
            raise InvalidRequest(f"node {node_id} still hosts shards {self.assignment.shards_of(node_id)}")
        if state == "removed" and node_id in self.meta_members:
            raise InvalidRequest(f"node {node_id} still runs a metadata replica")
        self.nodes[node_id]["state"] = state
        return {"ok": True}

    def _apply_set_assignment(self, c: dict[str, Any]) -> dict[str, Any]:
        new = Assignment.from_json(c["assignment"])
        if new.version != self.assignment.version + 1 or len(new.shards) != len(self.assignment.shards):
            raise VersionConflict("assignment", self.assignment.version + 1, new.version)
        if any(n >= len(self.nodes) or self.nodes[n]["state"] == "removed"
               for nodes in new.shards for n in nodes):
            raise InvalidRequest("assignment places a replica on an unknown or removed node")
        self.assignment = new
        return {"ok": True}

    def _apply_set_meta_members(self, c: dict[str, Any]) -> dict[str, Any]:
        """One change of the metadata group's member list: one node added or one dropped."""
        new = sorted(int(n) for n in c["members"])
        old = set(self.meta_members)
        if len(set(new)) != len(new) or len(old.symmetric_difference(new)) != 1 or len(new) < 2:
            raise InvalidRequest(f"metadata members {self.meta_members} -> {new}: one change at a time")
        if any(not 0 <= n < len(self.nodes) or self.nodes[n]["state"] == "removed" for n in new):
            raise InvalidRequest("metadata members must be known, not removed nodes")
        self.meta_members = new
        return {"ok": True}

    def _apply_rebalance(self, c: dict[str, Any]) -> dict[str, Any]:
        """Progress from the rebalancer, or ``auto`` switched; only the fields given change."""
        for name in ("moving", "moves_done", "last", "auto"):
            if name in c:
                self.rebalance[name] = c[name]
        return {"ok": True}

    def _apply_request_move(self, c: dict[str, Any]) -> dict[str, Any]:
        """Queue one move for the rebalancer (it runs one at a time)."""
        shard, source, target = int(c["shard"]), int(c["source"]), int(c["target"])
        if self.rebalance.get("moving"):
            raise Unavailable("a move is in progress")
        if not 0 <= shard < len(self.assignment.shards):
            raise InvalidRequest(f"no shard {shard}")
        nodes = self.assignment.nodes_of(shard)
        if source not in nodes or target in nodes:
            raise InvalidRequest(f"shard {shard} is on nodes {list(nodes)}: cannot move {source} -> {target}")
        if not 0 <= target < len(self.nodes) or self.nodes[target]["state"] != "active":
            raise InvalidRequest(f"node {target} is not an active node")
        self.rebalance["moving"] = {"shard": shard, "source": source, "target": target}
        return {"ok": True}

    # ---- views -------------------------------------------------------------------------------

    def active_nodes(self) -> list[int]:
        return [n["id"] for n in self.nodes if n["state"] == "active"]

    def domain(self, node_id: int) -> str:
        """The failure domain of a node: its zone, or the node itself when it names none."""
        return self.nodes[node_id].get("zone") or f"node-{node_id}"

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "nodes": self.nodes, "assignment": self.assignment.to_json(),
                "rebalance": self.rebalance, "meta_members": self.meta_members}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "MetaState":
        state = cls([dict(n) for n in data["nodes"]], Assignment.from_json(data["assignment"]),
                    data.get("meta_members"))
        state.version = int(data["version"])
        state.rebalance = dict(data.get("rebalance") or state.rebalance)
        return state

    def snapshot(self) -> bytes:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def restore(cls, data: bytes) -> "MetaState":
        return cls.from_json(json.loads(data))


def plan_move(state: MetaState, replicas: int) -> tuple[int, int, int] | None:
    """The next replica move ``(shard, source, target)``, or None when the placement is settled.

    In order: an interrupted move (recorded in ``rebalance.moving``); a replica on a dead or
    draining node, to the least-loaded active node outside the failure domains of the shard's
    other replicas; a shard with two replicas in one domain, one of them to such a node; then,
    while two active nodes differ by more than one replica, one replica from the more to the less
    loaded where that keeps the shard's domains distinct (the most uneven pair first: with zones of
    different sizes the load can only be as even as the zones allow). A replica with
    no such target stays where it is (the shard keeps its replicas distinct rather than full).
    Ties break by node id, so every leader plans alike.
    """
    moving = state.rebalance.get("moving")
    if moving and "shard" in moving:
        return int(moving["shard"]), int(moving["source"]), int(moving["target"])
    if moving:
        return None  # a metadata replica moves (``plan_meta_move``)
    a = state.assignment
    active = state.active_nodes()
    if not active:
        return None
    load = a.load(active)

    def target(shard: int, source: int) -> int | None:
        """The least-loaded active node that may take ``source``'s replica of ``shard``."""
        others = [n for n in a.nodes_of(shard) if n != source]
        taken = {state.domain(n) for n in others}
        free = [n for n in active if n not in others and n != source and state.domain(n) not in taken]
        return min(free, key=lambda n: (load[n], n)) if free else None

    for state_name in LEAVING[::-1]:  # a dead node's replicas first: their shards run short
        for node in state.nodes:
            if node["state"] != state_name:
                continue
            for shard in a.shards_of(node["id"]):
                to = target(shard, node["id"])
                if to is not None:
                    return shard, node["id"], to
    for shard, nodes in enumerate(a.shards):  # two replicas in one failure domain
        seen: dict[str, int] = {}
        for n in sorted(nodes, key=lambda n: (-load.get(n, 0), n)):
            if state.domain(n) in seen and state.nodes[n]["state"] == "active":
                to = target(shard, n)
                if to is not None:
                    return shard, n, to
            seen.setdefault(state.domain(n), n)
    if not state.rebalance.get("auto", True):
        return None
    # the most loaded to the least loaded node first; where zones forbid every such move (a
    # zone of one node must hold a replica of every shard), the next most uneven pair
    pairs = sorted(((hi, lo) for hi in active for lo in active if load[hi] - load[lo] > 1),
                   key=lambda p: (load[p[1]] - load[p[0]], p[0], p[1]))
    for hi, lo in pairs:
        for shard in a.shards_of(hi):
            others = {state.domain(n) for n in a.nodes_of(shard) if n != hi}
            if lo not in a.nodes_of(shard) and len(a.nodes_of(shard)) <= replicas \
                    and state.domain(lo) not in others:
                return shard, hi, lo
    return None


def plan_meta_move(state: MetaState) -> tuple[int, int] | None:
    """The next metadata replica move ``(source, target)``, or None: an interrupted one first;
    then, once a draining or dead member hosts no shard replica any more, its metadata replica moves to
    the least-loaded active node that runs none (ties by node id)."""
    moving = state.rebalance.get("moving")
    if moving:
        return (int(moving["source"]), int(moving["target"])) if moving.get("meta") else None
    candidates = [n for n in state.active_nodes() if n not in state.meta_members]
    load = state.assignment.load(candidates)
    for node in state.meta_members:
        if state.nodes[node]["state"] in LEAVING and not state.assignment.shards_of(node) and candidates:
            return node, min(candidates, key=lambda n: (load[n], n))
    return None
