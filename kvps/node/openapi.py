"""The OpenAPI 3.1 document for the node admin API and the replica data API.

Served at ``GET /v1/openapi.json`` by every node. ``tests/admin/test_admin.py`` checks it against the
real routers (every route documented, nothing documented that is not served) and validates live
responses against the schemas here, so the document cannot drift from the handlers. Security and
the role each route needs are added by ``document()`` from the access tables the servers enforce
(``kvps.node.access``, ``kvps.replica.access``), never written by hand here.
"""
from __future__ import annotations

from typing import Any

from kvps.node import access as admin_access
from kvps.replica import access as data_access

__all__ = ["ADMIN_PATHS", "DATA_PATHS", "document"]

_int = {"type": "integer"}
_str = {"type": "string"}
_bool = {"type": "boolean"}
_opt_int = {"type": ["integer", "null"]}
_opt_str = {"type": ["string", "null"]}

REPLICA_VIEW = {
    "type": "object",
    "required": ["shard", "node", "alive", "pid", "role", "raft", "data_url", "term",
                 "commit_index", "applied_index"],
    "properties": {
        "shard": _int, "node": _int, "alive": _bool, "pid": _opt_int, "restarts": _int,
        "role": {"enum": ["leader", "follower", "candidate", "unknown"]},
        "raft": _str, "data_url": _str, "term": _opt_int, "leader": _opt_int,
        "wire": {**_str, "description": "host:port of its node's wire port, the binary data "
                 "plane (kvps/delta/wire.py), while the node serves one; clients call the replica "
                 "there instead of at data_url"},
        "won_by": {"enum": ["election", "transfer", "fast-failover", None],
                   "description": "how this replica won the leadership it holds: an election "
                   "(after a pre-vote majority), a transfer the previous leader asked for (a "
                   "move, the leader spreader) or a fast failover (the leader's process was "
                   "gone); null unless it leads"},
        "serving": _bool, "commit_index": _opt_int, "applied_index": _opt_int,
        "log_entries": _opt_int,
        "recovering": {**_bool, "description": "its lost data was replaced, or its journal was "
                       "damaged: it withholds its Raft vote until it has caught up with the leader"},
        "recovering_reason": {**_opt_str, "description": "why it is recovering (null when not)"},
    },
}
SHARD_VIEW = {
    "type": "object",
    "required": ["id", "leader", "leader_url", "term", "replicas"],
    "properties": {"id": _int, "leader": _opt_int, "leader_url": _opt_str, "term": _int,
                   "replicas": {"type": "array", "items": REPLICA_VIEW}},
}
CLUSTER = {
    "type": "object",
    "required": ["cluster", "nodes", "shards"],
    "properties": {
        "cluster": {"type": "object", "required": ["shards", "replicas", "block_bytes", "max_push_bytes"],
                    "properties": {"shards": _int, "replicas": _int, "block_bytes": _int,
                                   "max_push_bytes": _int}},
        "nodes": {"type": "array", "items": {
            "type": "object", "required": ["id", "admin_url", "reachable"],
            "properties": {"id": _int, "admin_url": _str, "reachable": _bool}}},
        "shards": {"type": "array", "items": SHARD_VIEW},
    },
}
NODE = {"type": "object", "required": ["node", "admin_url", "replicas"],
        "properties": {"node": _int, "admin_url": _str, "replicas": {"type": "array", "items": REPLICA_VIEW},
                       # server.procs = 1: the Raft tickers of the node's process (kvps/raft/ticker.py)
                       "tickers": {"type": "array", "items": {"type": "object", "properties": {
                           "groups": _int, "rounds": _int, "ticks": _int,
                           "stalls": {"type": "object", "properties": {
                               "max_seconds": {"type": "number"}, "over_100ms": _int,
                               "tick_max_seconds": {"type": "number"},
                               "late_max_seconds": {"type": "number"}}}}}}}}
SHARD_DETAIL = {
    "allOf": [SHARD_VIEW, {
        "type": "object",
        "required": ["lag", "hot_keys", "batches", "mean_batch_pushes", "counters"],
        "properties": {
            "lag": {"type": "object", "additionalProperties": {
                "type": "object", "required": ["connected", "match_index", "lag_entries", "lag_seconds"],
                "properties": {"connected": _bool, "match_index": _opt_int, "lag_entries": _opt_int,
                               "lag_seconds": {"type": ["number", "null"]}}}},
            "hot_keys": {"type": "array", "items": {"type": "object", "required": ["key", "push_bytes"],
                                                    "properties": {"key": _str, "push_bytes": _int}}},
            "in_flight_bytes": _opt_int, "batches": _int,
            "mean_batch_pushes": {"type": ["number", "null"]},
            "counters": {"type": "object", "additionalProperties": _int},
        }}],
}
KEYS = {"type": "object", "required": ["keys"],
        "properties": {"keys": {"type": "array", "items": {
            "type": "object", "required": ["key", "kind", "dtype"],
            "properties": {"key": _str, "kind": {"enum": ["dense", "table"]}, "dtype": _str}}}}}
READY = {"type": "object", "required": ["ready"],
         "properties": {"ready": _bool, "shards_without_leader": {"type": "array", "items": _int}}}
ASSIGNMENT = {"type": "object", "required": ["version", "shards"],
              "properties": {"version": _int, "changed": _bool, "shards": {"type": "array", "items": {
                  "type": "object", "required": ["id", "nodes", "epoch"],
                  "properties": {"id": _int, "nodes": {"type": "array", "items": _int}, "epoch": _int}}}}}
SNAPSHOT = {"type": "object", "required": ["id", "label", "created", "time", "size", "keys", "shards", "digests"],
            "properties": {"id": _str, "label": _str, "created": {"type": "number"},
                           "time": {"type": ["number", "null"]}, "size": _int, "keys": _int,
                           "shards": _int, "complete": _bool,
                           "digests": {"type": "object", "additionalProperties": _str}}}
SNAPSHOTS = {"type": "object", "required": ["snapshots"],
             "properties": {"snapshots": {"type": "array", "items": SNAPSHOT}}}
RESTORED = {"type": "object", "required": ["restored", "time", "keys", "fetched_files"],
            "properties": {"restored": _str, "time": {"type": "number"}, "label": _str, "keys": _int,
                           "shards": _int, "fetched_files": _int}}
META = {"type": "object", "required": ["version", "nodes", "assignment", "rebalance"],
        "properties": {
            "version": _int, "assignment": ASSIGNMENT,
            "nodes": {"type": "array", "items": {
                "type": "object", "required": ["id", "host", "admin_port", "port_base", "state"],
                "properties": {"id": _int, "host": _str, "admin_port": _int, "port_base": _int,
                               "scheme": _str, "zone": _str,
                               "state": {"enum": ["active", "draining", "dead", "removed"]}}}},
            "rebalance": {"type": "object", "required": ["moving", "moves_done"],
                          "properties": {"moving": {"type": ["object", "null"]}, "moves_done": _int,
                                         "last": {"type": ["object", "null"]}}},
            "raft": {"type": "object"}}}
ERROR = {"type": "object", "required": ["error", "message"],
         "properties": {"error": _str, "message": _str, "fields": {"type": "object"}}}


def _json(schema: dict, description: str = "OK") -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _text(description: str, media: str = "text/plain") -> dict:
    return {"description": description, "content": {media: {"schema": _str}}}


ADMIN_PATHS: dict[str, dict[str, Any]] = {
    "/healthz": {"get": {"summary": "The node process is up", "responses": {"200": _text("ok")}}},
    "/readyz": {"get": {"summary": "Every hosted replica knows a leader",
                        "responses": {"200": _json(READY), "503": _json(READY, "not ready")}}},
    "/metrics": {"get": {"summary": "Prometheus text format, kvps_ prefix (node and its replicas)",
                         "responses": {"200": _text("exposition", "text/plain; version=0.0.4")}}},
    "/v1/node": {"get": {"summary": "This node's replicas", "responses": {"200": _json(NODE)}}},
    "/v1/cluster": {"get": {"summary": "The cluster map clients route with",
                            "responses": {"200": _json(CLUSTER)}}},
    "/v1/shards/{id}": {"get": {
        "summary": "One shard: replicas, lag, batching, hot keys",
        "parameters": [{"name": "id", "in": "path", "required": True, "schema": _int}],
        "responses": {"200": _json(SHARD_DETAIL), "404": _json(ERROR, "no such shard")}}},
    "/v1/keys": {"get": {"summary": "Every key (dense and tables)", "responses": {"200": _json(KEYS)}}},
    "/v1/assignment": {
        "get": {"summary": "Which nodes host each shard's replicas, as this node follows it",
                "responses": {"200": _json(ASSIGNMENT)}}},
    "/v1/snapshots": {
        "get": {"summary": "Complete snapshots, oldest first (?all=1: unfinished ones too)",
                "responses": {"200": _json(SNAPSHOTS), "401": _json(ERROR)}},
        "post": {"summary": "Take a snapshot of every shard, consistent at its timestamp ({\"label\": ...})",
                 "responses": {"201": _json(SNAPSHOT), "400": _json(ERROR), "401": _json(ERROR),
                               "503": _json(ERROR, "abandoned (nothing listed)")}}},
    "/v1/snapshots/restore": {"post": {
        "summary": "Restore the newest snapshot at or before {\"at\": unix time | ISO 8601}",
        "responses": {"200": _json(RESTORED), "400": _json(ERROR), "401": _json(ERROR),
                      "404": _json(ERROR, "no snapshot that early")}}},
    "/v1/snapshots/{id}": {"delete": {
        "summary": "Drop a snapshot (its files on every replica)",
        "parameters": [{"name": "id", "in": "path", "required": True, "schema": _str}],
        "responses": {"200": _json({"type": "object", "properties": {"dropped": _bool}}),
                      "401": _json(ERROR)}}},
    "/v1/snapshots/{id}/restore": {"post": {
        "summary": "Put every key back as it was in this snapshot (every replica checks its file first)",
        "parameters": [{"name": "id", "in": "path", "required": True, "schema": _str}],
        "responses": {"200": _json(RESTORED), "401": _json(ERROR), "404": _json(ERROR),
                      "500": _json(ERROR, "a replica's file is damaged: nothing restored")}}},
    "/v1/meta": {"get": {"summary": "The metadata group's state: nodes, assignment, rebalancing progress",
                         "responses": {"200": _json(META), "503": _json(ERROR, "no metadata replica answered")}}},
    "/v1/nodes": {"post": {
        "summary": "Join: add a node (host, admin_port, port_base); answers its id, cluster.toml and (unless want_secret is false) the secret",
        "requestBody": {"required": True, "content": {"application/json": {"schema": {
            "type": "object", "required": ["host", "admin_port", "port_base"],
            "properties": {"host": _str, "admin_port": _int, "port_base": _int,
                           "incarnation": _str, "want_secret": {"type": "boolean"}}}}}},
        "responses": {"200": _json({"type": "object", "required": ["id", "config"],
                                    "properties": {"id": _int, "config": _str, "secret": _str}}),
                      "400": _json(ERROR), "401": _json(ERROR)}}},
    "/v1/identity": {"get": {
        "summary": "This node's incarnation and the incarnations it knows the others by (a starting "
                   "node asks before it starts any replica)",
        "responses": {"200": _json({"type": "object", "required": ["node", "incarnation", "known"],
                                    "properties": {"node": _int,
                                                   "incarnation": _opt_str,
                                                   "known": {"type": "object",
                                                             "additionalProperties": _str}}}),
                      "401": _json(ERROR)}}},
    "/v1/nodes/{id}/incarnation": {"post": {
        "summary": "Record which incarnation node {id}'s data directory is (a node records its own); "
                   "a recorded one is replaced only by naming it in replaces (--replace)",
        "parameters": [{"name": "id", "in": "path", "required": True, "schema": _int}],
        "requestBody": {"required": True, "content": {"application/json": {"schema": {
            "type": "object", "required": ["incarnation"],
            "properties": {"incarnation": _str, "replaces": _opt_str}}}}},
        "responses": {"200": _json({"type": "object"}), "400": _json(ERROR), "401": _json(ERROR)}}},
    "/v1/nodes/{id}/zone": {"post": {
        "summary": "Record node {id}'s failure domain (a node records its own at start: kvps node --zone "
                   "or cluster.toml); replicas of a shard are kept in distinct zones",
        "parameters": [{"name": "id", "in": "path", "required": True, "schema": _int}],
        "requestBody": {"required": True, "content": {"application/json": {"schema": {
            "type": "object", "required": ["zone"], "properties": {"zone": _str}}}}},
        "responses": {"200": _json({"type": "object"}), "400": _json(ERROR), "401": _json(ERROR)}}},
    "/v1/nodes/{id}/drain": {"post": {
        "summary": "Drain a node: its replicas move away one at a time, then it is removed and exits",
        "parameters": [{"name": "id", "in": "path", "required": True, "schema": _int}],
        "responses": {"200": _json({"type": "object", "required": ["id", "state"],
                                    "properties": {"id": _int, "state": _str}}),
                      "400": _json(ERROR), "401": _json(ERROR),
                      "409": _json(ERROR, "NotDrainable: a metadata node, and no node to take its replica")}}},
    "/v1/moves": {"post": {
        "summary": "Queue one replica move (the rebalancer runs it; 503 while another move runs)",
        "requestBody": {"required": True, "content": {"application/json": {"schema": {
            "type": "object", "required": ["shard", "source", "target"],
            "properties": {"shard": _int, "source": _int, "target": _int}}}}},
        "responses": {"200": _json({"type": "object"}), "400": _json(ERROR), "401": _json(ERROR),
                      "503": _json(ERROR)}}},
    "/v1/rebalance": {"post": {
        "summary": "Switch automatic evening-out of replicas on or off ({\"auto\": bool})",
        "requestBody": {"required": True, "content": {"application/json": {"schema": {
            "type": "object", "required": ["auto"], "properties": {"auto": _bool}}}}},
        "responses": {"200": _json({"type": "object"}), "400": _json(ERROR), "401": _json(ERROR)}}},
    "/v1/openapi.json": {"get": {"summary": "This document", "responses": {"200": _json({"type": "object"})}}},
}

DATA_PATHS: dict[str, dict[str, Any]] = {
    "/v1/rpc/{op}": {"post": {
        "summary": "Data-plane operation on one shard replica (binary kvps frames, see docs/architecture.md)",
        "parameters": [{"name": "op", "in": "path", "required": True, "schema": {"enum": [
            "push", "pull", "pull_rows", "stored_rows", "set_rows", "create_key", "create_keys", "create_table", "delete_key", "set",
            "describe", "keys", "key_versions", "state_hash", "clock_tick", "clocks", "hyperparams", "membership", "snapshot_step",
            "snapshot_status", "snapshot_catalog", "snapshot_prepare"]}}],
        "requestBody": {"required": True, "content": {"application/x-kvps-frame": {"schema": _str}}},
        "responses": {"200": {"description": "response frame",
                              "content": {"application/x-kvps-frame": {"schema": _str}}},
                      **{code: _json(ERROR, why) for code, why in [
                          ("400", "invalid request"), ("401", "missing or wrong token"),
                          ("404", "no such key"), ("409", "version conflict or key exists"),
                          ("413", "body too large"), ("421", "not the leader (fields.leader_hint)"),
                          ("429", "overloaded"), ("503", "unavailable"), ("504", "timeout")]}}}},
    "/v1/snapshots/{snap_id}/file": {"get": {
        "summary": "This replica's file of a user snapshot (replicas that lack it fetch it from here)",
        "parameters": [{"name": "snap_id", "in": "path", "required": True, "schema": _str}],
        "responses": {"200": {"description": "the snapshot file",
                              "content": {"application/octet-stream": {"schema": _str}}},
                      "401": _json(ERROR), "404": _json(ERROR)}}},
    "/v1/status": {"get": {"summary": "This replica's Raft status",                    "responses": {"200": _json({"type": "object"}), "401": _json(ERROR)}}},
    "/healthz": {"get": {"summary": "The replica process is up", "responses": {"200": _text("ok")}}},
    "/metrics": {"get": {"summary": "This replica's metrics",
                         "responses": {"200": _text("exposition", "text/plain; version=0.0.4")}}},
}


_BEARER = [{"bearer": []}]
_ROLE_DOES = {"read": "reads", "write": "what a training worker does", "admin": "everything"}


def _role_text(needs: str) -> str:
    return f"Needs a token with role `{needs}` or above (roles: read < write < admin)."


def _rpc_role_text() -> str:
    by_role = {role: sorted(op for op, r in data_access.OP_ROLES.items() if r == role)
               for role in ("read", "write", "admin")}
    return "Needs a token whose role allows the operation (read < write < admin): " + "; ".join(
        f"`{role}` ({_ROLE_DOES[role]}): {', '.join(ops)}" for role, ops in by_role.items()) + "."


def _secured(paths: dict[str, dict[str, Any]], role_of: Any) -> dict[str, dict[str, Any]]:
    """``paths`` with each operation's security, role (``x-kvps-role``; the rpc route's roles per
    op in ``x-kvps-roles``), description and 401/403 answers, from ``role_of(METHOD, path)``."""
    out: dict[str, dict[str, Any]] = {}
    for path, ops in paths.items():
        out[path] = {}
        for method, op in ops.items():
            if path == "/v1/rpc/{op}":
                needs, extra, text = "read", {"x-kvps-roles": dict(data_access.OP_ROLES)}, _rpc_role_text()
            else:
                needs = role_of(method.upper(), path)
                extra, text = {"x-kvps-role": needs}, _role_text(needs) if needs else ""
            if needs is None:
                out[path][method] = {**op, "security": [], "description": "Open: no token needed."}
                continue
            out[path][method] = {
                **op, **extra, "security": _BEARER, "description": text,
                "responses": {**op["responses"], "401": _json(ERROR, "Unauthorized: missing or wrong token"),
                              "403": _json(ERROR, "Forbidden: the token's role is too small")}}
    return out


def document() -> dict[str, Any]:
    data = {f"/replica{path}": ops
            for path, ops in _secured(DATA_PATHS, data_access.route_role).items()}
    return {
        "openapi": "3.1.0",
        "info": {"title": "kvps", "version": "1", "description":
                 "Node admin API. Paths under /replica/ are served by each shard replica's data "
                 "endpoint (its own port, see /v1/cluster), without the /replica prefix. Every "
                 "route but /healthz, /readyz and /metrics needs a bearer token; tokens carry a "
                 "role (read < write < admin), and each route names the one it needs "
                 "(x-kvps-role; 401 without a valid token, 403 with too small a role)."},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "paths": {**_secured(ADMIN_PATHS, admin_access.route_role), **data},
    }
