"""Which role each route of the node admin API needs, and the middleware that checks it.

One table for every route the admin app serves, whichever module adds it (``admin.py``,
``snapshot_api.py``, ``meta_service.py``, ``identity.py``): the checks cannot be forgotten in a
handler, and ``tests/admin/test_admin.py`` fails when a served route has no entry. A route missing
from the table needs ``admin``. Roles: ``kvps.service.auth``.
"""
from __future__ import annotations

import logging
from typing import Any

from aiohttp import web

from kvps.service.auth import TokenStore

__all__ = ["ADMIN_ROUTES", "authorize", "route_role"]

log = logging.getLogger("kvps.node")

OPEN = None  # answered without a token: probes and Prometheus scrapes

ADMIN_ROUTES: dict[tuple[str, str], str | None] = {
    ("GET", "/healthz"): OPEN,
    ("GET", "/readyz"): OPEN,
    ("GET", "/metrics"): OPEN,
    ("GET", "/v1/node"): "read",
    ("GET", "/v1/cluster"): "read",
    ("GET", "/v1/shards/{id}"): "read",
    ("GET", "/v1/keys"): "read",
    ("GET", "/v1/assignment"): "read",
    ("GET", "/v1/meta"): "read",
    ("GET", "/v1/identity"): "read",
    ("GET", "/v1/snapshots"): "read",
    ("GET", "/v1/openapi.json"): "read",
    ("POST", "/v1/snapshots"): "admin",
    ("POST", "/v1/snapshots/restore"): "admin",
    ("POST", "/v1/snapshots/{id}/restore"): "admin",
    ("DELETE", "/v1/snapshots/{id}"): "admin",
    ("POST", "/v1/nodes"): "admin",
    ("POST", "/v1/nodes/{id}/drain"): "admin",
    ("POST", "/v1/nodes/{id}/incarnation"): "admin",
    ("POST", "/v1/nodes/{id}/zone"): "admin",
    ("POST", "/v1/moves"): "admin",
    ("POST", "/v1/rebalance"): "admin",
}


def route_role(method: str, path: str) -> str | None:
    """The role a route (method, pattern) needs; None: open. HEAD is GET's."""
    return ADMIN_ROUTES.get(("GET" if method == "HEAD" else method, path), "admin")


def authorize(tokens: TokenStore, node_id: int) -> Any:
    """The admin app's middleware: ``Unauthorized`` (401) without a valid token, ``Forbidden``
    (403) with too small a role."""

    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        match = request.match_info
        if match.http_exception is None:  # no such route: aiohttp's 404 / 405, nothing to guard
            pattern = match.route.resource.canonical
            needs = route_role(request.method, pattern)
            if needs is not OPEN:
                # Unauthorized / Forbidden: answered and logged (with the request id) by the
                # admin app's error middleware, which runs outside this one (kvps.node.admin)
                tokens.check(request.headers.get("Authorization"), needs, f"{request.method} {pattern}")
        return await handler(request)

    return middleware
