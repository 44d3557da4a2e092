"""Tokens carry roles: every route but the probes needs a token, and each role gets exactly its
routes. The routes are enumerated from the real routers and looked up in the tables below, so a new
route fails here until someone decides which role it needs (and the server agrees)."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import types
import urllib.error
import urllib.request

import numpy as np
import pytest

import kvps_client as kc
from kvps.delta import frame
from kvps.node.local import wait_until
from kvps.service.auth import TokenStore

pytestmark = pytest.mark.cluster

ROLES = ("read", "write", "admin")
OPEN = None

# (method, route) -> the least role that may call it; OPEN: no token. Written out here, not read
# from kvps.node.access: this is the specification the server is checked against.
ADMIN_API = {
    ("GET", "/healthz"): OPEN, ("GET", "/readyz"): OPEN, ("GET", "/metrics"): OPEN,
    **{("GET", p): "read" for p in ("/v1/node", "/v1/cluster", "/v1/shards/{id}", "/v1/keys",
                                    "/v1/assignment", "/v1/meta", "/v1/identity", "/v1/snapshots",
                                    "/v1/openapi.json")},
    **{r: "admin" for r in (("POST", "/v1/nodes"), ("POST", "/v1/nodes/{id}/drain"),
                            ("POST", "/v1/nodes/{id}/incarnation"), ("POST", "/v1/nodes/{id}/zone"),
                            ("POST", "/v1/moves"),
                            ("POST", "/v1/rebalance"), ("POST", "/v1/snapshots"),
                            ("POST", "/v1/snapshots/restore"), ("POST", "/v1/snapshots/{id}/restore"),
                            ("DELETE", "/v1/snapshots/{id}"))},
}
DATA_ROUTES = {("GET", "/healthz"): OPEN, ("GET", "/metrics"): OPEN, ("GET", "/v1/status"): "read",
               ("GET", "/v1/snapshots/{snap_id}/file"): "read"}
DATA_OPS = {
    **{op: "read" for op in ("pull", "pull_rows", "stored_rows", "describe", "keys", "key_versions",
                             "clocks", "state_hash", "snapshot_status", "snapshot_catalog")},
    **{op: "write" for op in ("push", "set", "set_rows", "create_key", "create_keys", "create_table", "delete_key",
                              "clock_tick", "hyperparams")},
    **{op: "admin" for op in ("membership", "snapshot_step", "snapshot_prepare")},
}


def allowed(role: str, needs: str) -> bool:
    return ROLES.index(role) >= ROLES.index(needs)


def call(method: str, url: str, token: str | None, body: bytes | None = None) -> tuple[int, dict | None]:
    req = urllib.request.Request(url, data=body, method=method,
                                 headers={"Authorization": f"Bearer {token}"} if token is not None else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, None
    except urllib.error.HTTPError as exc:
        data = exc.read()
        try:
            return exc.code, json.loads(data)
        except ValueError:
            return exc.code, None


def admin_routes(cluster) -> set[tuple[str, str]]:
    from kvps.node.admin import make_app
    from kvps.node.node import Node
    node = Node(cluster.cfg, 0, cluster.config_path, cluster.data_dir / "node-0",
                TokenStore(cluster.data_dir / "token"))
    return {(r.method, r.resource.canonical) for r in make_app(node).router.routes() if r.method != "HEAD"}


def data_routes(cluster) -> set[tuple[str, str]]:
    from kvps.replica.dataplane import make_app
    app = make_app(types.SimpleNamespace(cfg=cluster.cfg), TokenStore(cluster.data_dir / "token"))
    return {(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}


def assert_refused(status: int, body: dict | None, role: str, needs: str, what: str) -> None:
    assert status == 403, f"{what} answered {status} to a {role} token (needs {needs})"
    assert body["error"] == "Forbidden" and body["fields"]["role"] == role, (what, body)
    assert body["fields"]["needs"] == needs, (what, body)


def test_admin_api_every_route_but_the_probes_needs_a_token_and_each_role_gets_exactly_its_routes(
        cluster, tokens):
    served = admin_routes(cluster)
    assert served == set(ADMIN_API), "classify the new route in ADMIN_API (and kvps.node.access)"
    base = cluster.endpoints[1]  # not the first node: forwarding must not skip the check
    for method, route in sorted(served):
        needs = ADMIN_API[(method, route)]
        # bodies and ids that every handler refuses cheaply: nothing is created, joined or moved
        url = base + route.replace("{id}", "0" if method == "GET" else "no-such-id")
        body = b'{"label": 7}' if method != "GET" else None
        for bad in (None, "", "wrong-token"):
            status, reply = call(method, url, bad, body)
            if needs is OPEN:
                assert status not in (401, 403), f"{method} {route} is open, answered {status}"
            else:
                assert status == 401 and reply["error"] == "Unauthorized", (method, route, bad, status)
        for role in ROLES:
            status, reply = call(method, url, tokens[role], body)
            if needs is OPEN or allowed(role, needs):
                assert status not in (401, 403), f"{method} {route}: {role} token refused ({reply})"
            else:
                assert_refused(status, reply, role, needs, f"{method} {route}")


def state_hash(base: str, token: str) -> str:
    req = urllib.request.Request(base + "/v1/rpc/state_hash", data=frame.encode(frame.KIND_REQUEST, {}),
                                 method="POST", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return frame.decode(resp.read()).meta["hash"]


def test_data_plane_every_route_needs_a_token_and_each_role_gets_exactly_its_ops(cluster, tokens):
    from kvps.replica.dataplane import HANDLERS
    assert set(HANDLERS) == set(DATA_OPS), "classify the new op in DATA_OPS (and kvps.replica.access)"
    assert data_routes(cluster) == set(DATA_ROUTES) | {("POST", "/v1/rpc/{op}")}
    base = wait_until(lambda: (cluster.leader(0) or {}).get("data_url"), 30, "a leader of shard 0")
    calls = [(m, r.replace("{snap_id}", "no-such-snapshot"), DATA_ROUTES[(m, r)], None)
             for m, r in sorted(DATA_ROUTES)]
    calls += [("POST", f"/v1/rpc/{op}", DATA_OPS[op], frame.encode(frame.KIND_REQUEST, {}))
              for op in sorted(DATA_OPS)]
    before = state_hash(base, tokens["read"])
    for method, route, needs, body in calls:  # too small a role: a typed 403, nothing changes
        for role in ROLES:
            if needs is not OPEN and not allowed(role, needs):
                assert_refused(*call(method, base + route, tokens[role], body), role, needs,
                               f"{method} {route}")
        if needs is not OPEN:
            status, reply = call(method, base + route, None, body)
            assert status == 401 and reply["error"] == "Unauthorized", (method, route, status)
    assert state_hash(base, tokens["read"]) == before
    for method, route, needs, body in calls:  # enough of a role: past the check (the empty
        for role in ROLES:                    # requests are then refused as malformed, or served)
            if needs is OPEN or allowed(role, needs):
                status, reply = call(method, base + route, tokens[role], body)
                assert status not in (401, 403), f"{method} {route}: {role} token refused ({reply})"


def test_a_write_token_trains_a_read_token_only_reads(cluster, tokens, monkeypatch):
    async def train():  # token=None: the client reads $KVPS_TOKEN
        async with kc.Client(cluster.endpoints, seed=0) as ps:
            await ps.create("roles/w", np.zeros(8, np.float32), optimizer=kc.SGD(lr=1.0))
            await ps.push({"roles/w": np.ones(8, np.float32)})
            await ps.set("roles/w", np.full(8, 2.0, np.float32))
            await ps.create_table("roles/t", dim=4)
            await ps.push_rows("roles/t", np.arange(3), np.ones((3, 4), np.float32))
            keys = [k["key"] for k in await ps.keys()]
            with pytest.raises(kc.Forbidden) as err:  # what only nodes do
                await ps.call(0, "snapshot_step", {"op": "drop", "snap_id": "x"})
            return (await ps.pull("roles/w"))["roles/w"], keys, err.value

    monkeypatch.setenv("KVPS_TOKEN", tokens["write"])
    value, keys, err = asyncio.run(train())
    assert np.all(value == 2.0) and {"roles/w", "roles/t"} <= set(keys)
    assert err.role == "write" and err.needs == "admin"

    async def read():
        async with kc.Client(cluster.endpoints, token=tokens["read"], seed=0, timeout=10) as ps:
            value = (await ps.pull("roles/w"))["roles/w"]
            with pytest.raises(kc.Forbidden) as err:  # refused at once, never retried
                await ps.push({"roles/w": np.ones(8, np.float32)})
            return value, err.value

    value, err = asyncio.run(read())
    assert np.all(value == 2.0) and err.role == "read" and err.needs == "write"


def test_status_command_works_with_a_read_token_and_not_without_one(cluster, tokens):
    env = {k: v for k, v in os.environ.items() if k != "KVPS_TOKEN"}

    def kvps(*args: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kvps.cli", "status", "--endpoint",
                               cluster.endpoints[0], *args], capture_output=True, text=True,
                              timeout=60, env={**env, **extra})

    ok = kvps(KVPS_TOKEN=tokens["read"])
    assert ok.returncode == 0 and "shards healthy" in ok.stdout, ok.stderr
    refused = kvps()
    assert refused.returncode == 1 and "Unauthorized" in refused.stderr, refused.stderr


def test_openapi_marks_the_token_and_role_of_every_route(cluster, tokens):
    status, _ = call("GET", cluster.endpoints[0] + "/v1/openapi.json", None)
    assert status == 401
    req = urllib.request.Request(cluster.endpoints[0] + "/v1/openapi.json",
                                 headers={"Authorization": f"Bearer {tokens['read']}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        doc = json.loads(resp.read())
    expected = {**{(m, p): r for (m, p), r in ADMIN_API.items()},
                **{(m, "/replica" + p): r for (m, p), r in DATA_ROUTES.items()}}
    documented = {(m.upper(), p): op for p, ops in doc["paths"].items() for m, op in ops.items()}
    rpc = documented.pop(("POST", "/replica/v1/rpc/{op}"))
    assert set(documented) == set(expected)
    for (method, path), op in documented.items():
        needs = expected[(method, path)]
        if needs is OPEN:
            assert op["security"] == [], (method, path)
            continue
        assert op["security"] == [{"bearer": []}] and op["x-kvps-role"] == needs, (method, path)
        assert f"`{needs}`" in op["description"] and {"401", "403"} <= set(op["responses"]), (method, path)
    assert rpc["security"] == [{"bearer": []}] and rpc["x-kvps-roles"] == DATA_OPS
    assert all(f"`{role}`" in rpc["description"] for role in ROLES)
