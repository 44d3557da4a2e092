"""Which role each data-plane route and operation needs (roles: ``kvps.service.auth``).

``read`` reads, ``write`` is what a training worker does, ``admin`` is what only nodes do to their
replicas (membership changes, the snapshot protocol). Every operation is classified here:
``tests/admin/test_admin.py`` fails when a handler or route has no entry. An unclassified route
needs ``admin``; an unknown operation any valid token (it is then refused as unknown).
"""
from __future__ import annotations

__all__ = ["OPEN_ROUTES", "OP_ROLES", "ROUTE_ROLES", "op_role", "route_role"]

# Routes that answer without a token (read-only, no data): everything else needs one.
OPEN_ROUTES = frozenset({("GET", "/healthz"), ("GET", "/metrics")})

ROUTE_ROLES = {
    ("GET", "/v1/status"): "read",
    ("GET", "/v1/snapshots/{snap_id}/file"): "read",  # kvps export --snapshot reads these
}

OP_ROLES = {
    "pull": "read", "pull_rows": "read", "stored_rows": "read", "describe": "read", "keys": "read",
    "clocks": "read", "state_hash": "read", "snapshot_status": "read", "snapshot_catalog": "read",
    "key_versions": "read",  # a follower behind a read's min_version asks its leader
    "push": "write", "set": "write", "set_rows": "write", "create_key": "write", "create_keys": "write",
    "create_table": "write", "delete_key": "write", "clock_tick": "write", "hyperparams": "write",
    "membership": "admin", "snapshot_step": "admin", "snapshot_prepare": "admin",
}


def route_role(method: str, path: str) -> str | None:
    """The role a route (its pattern) needs; None: open."""
    if (method, path) in OPEN_ROUTES:
        return None
    return ROUTE_ROLES.get((method, path), "admin")


def op_role(op: str) -> str:
    """The role ``POST /v1/rpc/{op}`` needs. An unknown op needs only a valid token: the caller
    learns it is unknown (``InvalidRequest``) only once authenticated."""
    return OP_ROLES.get(op, "read")
