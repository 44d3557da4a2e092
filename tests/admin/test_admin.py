"""Admin API, metrics, authentication and hostile input, against one real cluster (``conftest.py``:
shared with ``test_roles.py``)."""
from __future__ import annotations

import asyncio
import http.client
import json
import socket
import types
import urllib.error
import urllib.request

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

import kvps_client as kc
from kvps.service.auth import TokenStore
from kvps.replica.dataplane import HANDLERS, OPEN_ROUTES, make_app
from kvps.delta import frame
from kvps.node.local import wait_until
from kvps.placement import block_shard

pytestmark = pytest.mark.cluster


def client(cluster) -> kc.Client:
    return kc.Client(cluster.endpoints, token=cluster.token, seed=0)


def get(url: str, token: str | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def post(url: str, body: bytes, token: str | None, headers: dict | None = None) -> tuple[int, bytes, dict]:
    hdrs = {"Authorization": f"Bearer {token}"} if token else {}
    req = urllib.request.Request(url, data=body, method="POST", headers={**hdrs, **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), dict(exc.headers)


def leader_url(cluster, shard: int) -> str:
    return cluster.wait_leader(shard)["data_url"]


def state_hash(url: str, token: str) -> str:
    status, body, _ = post(url + "/v1/rpc/state_hash", frame.encode(frame.KIND_REQUEST, {}), token)
    assert status == 200
    return frame.decode(body).meta["hash"]


def test_metrics_are_valid_prometheus_and_count_what_happened(cluster):
    async def main():
        async with client(cluster) as ps:
            await ps.create("m/w", np.zeros(64, np.float32))
            for _ in range(3):
                await ps.push({"m/w": np.ones(64, np.float32)})
            await ps.pull("m/w")
            with pytest.raises(kc.ShapeMismatch):
                await ps.push({"m/w": np.ones(3, np.float32)})
    asyncio.run(main())
    shard = block_shard("m/w", 0, cluster.cfg.shards)
    leader_node = cluster.wait_leader(shard)["node"]
    status, body = get(cluster.cfg.node(leader_node).admin_url + "/metrics")
    assert status == 200
    samples = [s for f in text_string_to_metric_families(body.decode()) for s in f.samples]  # parses

    def value(name, **labels):
        return sum(s.value for s in samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))
    assert value("kvps_pushes_total", shard=str(shard)) >= 3
    assert value("kvps_pulls_total", shard=str(shard)) >= 1
    assert value("kvps_commit_seconds_count", shard=str(shard)) >= 3
    assert value("kvps_is_leader", shard=str(shard)) == 1
    assert value("kvps_replica_up", node=str(leader_node)) == len(cluster.cfg.shards_on(leader_node))
    assert value("kvps_term", shard=str(shard)) >= 1
    # the log's commands held in memory: the three small pushes at most (the rest is released)
    held = [s.value for s in samples if s.name == "kvps_log_held_bytes" and s.labels["shard"] == str(shard)]
    assert len(held) == 1 and 0 <= held[0] < 64 * 1024, held
    # the node process's collector clock (installed before start-up's heap was frozen)
    assert value("kvps_gc_collections_total", node=str(leader_node), process="node", generation="2") >= 1
    # the client refused the wrong shape itself; a raw wrong-shape push reaches the server:
    bad = frame.encode(frame.KIND_REQUEST, {"client": "x", "seq": 1, "floor": 1,
                                            "dense": [{"key": "m/w", "block": 0, "array": 0}]},
                       [np.ones(3, np.float32)])
    assert post(leader_url(cluster, shard) + "/v1/rpc/push", bad, cluster.token)[0] == 400
    _, body = get(cluster.cfg.node(leader_node).admin_url + "/metrics")
    samples = [s for f in text_string_to_metric_families(body.decode()) for s in f.samples]
    assert value("kvps_rejected_requests_total", reason="ShapeMismatch") >= 1


def test_shard_detail_shows_lag_batches_and_hot_keys(cluster, tokens):
    async def main():
        async with client(cluster) as ps:
            await ps.create("hot/w", np.zeros(1024, np.float32))
            await asyncio.gather(*(ps.push({"hot/w": np.ones(1024, np.float32)}) for _ in range(8)))
    asyncio.run(main())
    shard = block_shard("hot/w", 0, cluster.cfg.shards)
    status, body = get(cluster.endpoints[0] + f"/v1/shards/{shard}", tokens["read"])
    view = json.loads(body)
    assert status == 200 and view["id"] == shard and view["leader"] is not None
    assert len(view["replicas"]) == 3
    assert len(view["lag"]) == 2 and all("lag_entries" in p and "lag_seconds" in p for p in view["lag"].values())
    assert view["hot_keys"][0]["key"] == "hot/w"
    assert view["batches"] >= 1 and view["mean_batch_pushes"] >= 1
    assert get(cluster.endpoints[0] + "/v1/shards/99", tokens["read"])[0] == 404


def test_keys_endpoint_lists_keys(cluster, tokens):
    async def main():
        async with client(cluster) as ps:
            await ps.create("keys/a", np.zeros(4, np.float32))
            await ps.create_table("keys/t", dim=4)
    asyncio.run(main())
    status, body = get(cluster.endpoints[1] + "/v1/keys", tokens["read"])
    names = {k["key"]: k["kind"] for k in json.loads(body)["keys"]}
    assert status == 200 and names["keys/a"] == "dense" and names["keys/t"] == "table"


def _replica_routes(cluster) -> list[tuple[str, str]]:
    """Every (method, path) the replica's router serves, with {op} expanded."""
    stub = types.SimpleNamespace(cfg=cluster.cfg)
    app = make_app(stub, TokenStore(cluster.data_dir / "token"))
    routes = []
    for route in app.router.routes():
        path = route.resource.canonical
        paths = [path.replace("{op}", op) for op in [*HANDLERS, "no-such-op"]] if "{op}" in path else [path]
        routes += [(route.method, p) for p in paths if route.method != "HEAD"]
    return routes


@pytest.mark.parametrize("token", [None, "wrong-token", ""])
def test_every_data_route_refuses_a_missing_or_wrong_token(cluster, token):
    base = leader_url(cluster, 0)
    routes = _replica_routes(cluster)
    assert len(routes) > len(HANDLERS)  # the router really was enumerated
    before = state_hash(base, cluster.token)
    for method, path in routes:
        if (method, path) in OPEN_ROUTES:
            continue
        body = frame.encode(frame.KIND_REQUEST, {"key": "x"}) if method == "POST" else None
        path = path.replace("{snap_id}", "some-snapshot")
        if method == "POST":
            status, data, _ = post(base + path, body, token)
        else:
            status, data = get(base + path, token)
        assert status == 401, f"{method} {path} answered {status} to token {token!r}"
        assert json.loads(data)["error"] == "Unauthorized"
    assert state_hash(base, cluster.token) == before


def test_token_rotation_without_downtime(cluster):
    token_file = cluster.data_dir / "token"
    old, original = cluster.token, token_file.read_text()
    base = leader_url(cluster, 0)
    status_ok = lambda tok: get(base + "/v1/status", tok)[0] == 200  # noqa: E731
    try:
        token_file.write_text(f"{old}\nnew-token-for-rotation\n")
        wait_until(lambda: status_ok("new-token-for-rotation"), 10, "the new token to be accepted")
        assert status_ok(old)  # both valid during the window
        token_file.write_text("new-token-for-rotation\n")
        wait_until(lambda: not status_ok(old), 10, "the old token to be refused")
        assert status_ok("new-token-for-rotation")
    finally:
        token_file.write_text(original)
        wait_until(lambda: status_ok(old), 10, "the original token back")


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_announced_2gib_body_is_refused_without_allocating(cluster):
    leader = wait_until(lambda: cluster.leader(0), 30, "a leader")
    host, port = leader["data_url"].removeprefix("http://").split(":")
    before = _rss_kib(leader["pid"])
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.putrequest("POST", "/v1/rpc/push")
    conn.putheader("Authorization", f"Bearer {cluster.token}")
    conn.putheader("Content-Length", str(2 << 30))
    conn.endheaders()
    conn.send(b"\0" * 65536)
    resp = conn.getresponse()
    assert resp.status == 413
    assert json.loads(resp.read())["error"] == "RequestTooLarge"
    conn.close()
    assert _rss_kib(leader["pid"]) - before < 64 * 1024  # far below 2 GiB
    assert state_hash(leader["data_url"], cluster.token)  # still serving


def test_slow_client_is_cut_off(cluster):
    leader = wait_until(lambda: cluster.leader(0), 30, "a leader")
    host, port = leader["data_url"].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/rpc/push HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n"
                  b"Authorization: Bearer " + cluster.token.encode() + b"\r\n\r\n" + b"\0" * 10)
        reply = s.recv(4096)  # blocks until the server gives up on the body (body_timeout=1s)
    assert b" 504 " in reply.split(b"\r\n")[0] and b"Timeout" in reply


def test_body_cut_short_by_the_client_is_refused_and_the_replica_keeps_serving(cluster):
    leader = wait_until(lambda: cluster.leader(0), 30, "a leader")
    host, port = leader["data_url"].removeprefix("http://").split(":")
    before = state_hash(leader["data_url"], cluster.token)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/rpc/push HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n"
                  b"Authorization: Bearer " + cluster.token.encode() + b"\r\n\r\n" + b"\0" * 10)
        s.shutdown(socket.SHUT_WR)  # EOF after 10 of the 1000 bytes
        reply = s.recv(4096)
    assert reply == b"" or b" 400 " in reply.split(b"\r\n")[0]
    assert state_hash(leader["data_url"], cluster.token) == before  # serving, nothing changed


def test_nonfinite_gradients_skipped_and_counted(cluster):
    async def main():
        async with client(cluster) as ps:
            await ps.create("nan/w", np.zeros(8, np.float32))
            await ps.push({"nan/w": np.full(8, np.inf, np.float32)})   # skip mode: answered ok
            await ps.push({"nan/w": np.ones(8, np.float32)})
            return await ps.get("nan/w")
    value, version = asyncio.run(main())
    assert np.all(value == 1) and version == 1
    shard = block_shard("nan/w", 0, cluster.cfg.shards)
    _, body = get(cluster.cfg.node(cluster.wait_leader(shard)["node"]).admin_url + "/metrics")
    assert 'kvps_nonfinite_pushes_total{action="skipped"' in body.decode()


def test_client_errors_carry_the_request_id_the_server_logged(cluster):
    async def conflict():
        async with client(cluster) as ps:
            await ps.create("rid/v", np.zeros(2, np.float32))
            with pytest.raises(kc.VersionConflict) as info:
                await ps.set("rid/v", np.ones(2, np.float32), expected_version=5)
            return info.value, ps.client_id
    err, client_id = asyncio.run(conflict())
    rid = err.fields["request_id"]
    assert rid.startswith(client_id[:12])
    logs = "".join(p.read_text() for p in cluster.data_dir.glob("node-*/logs/*.log"))
    assert rid in logs  # one id joins the client's exception and the server's log line


def test_request_ids_are_echoed(cluster):
    base = leader_url(cluster, 0)
    status, _, headers = post(base + "/v1/rpc/keys", frame.encode(frame.KIND_REQUEST, {}),
                              cluster.token, {"X-Request-Id": "trace-42"})
    assert status == 200 and headers["X-Request-Id"] == "trace-42"
    status, _, headers = post(base + "/v1/rpc/nope", b"junk", cluster.token, {"X-Request-Id": "bad id!"})
    assert status == 400 and headers["X-Request-Id"] != "bad id!" and len(headers["X-Request-Id"]) == 16


# ---- fuzz: thousands of hostile requests over real HTTP ---------------------------------------

_json = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                     max_leaves=6)
_fields = ["key", "client", "seq", "floor", "dense", "rows", "blocks", "have", "shape", "dtype",
           "block_rows", "optimizer", "init", "dim", "ids", "grads", "array", "block", "consistency",
           "expected_version", "min_version", "merge", "accept_codec"]
_meta = st.dictionaries(st.sampled_from(_fields), _json | st.just("fz/w") | st.just(0), max_size=6)
_arrays = st.lists(st.sampled_from([np.zeros(4, np.float32), np.full(4, np.nan, np.float32),
                                    np.arange(3, dtype=np.int64), np.zeros((2, 2), np.float64),
                                    np.zeros(0, np.uint8), np.ones(1024, np.float32)]), max_size=3)
_request = st.one_of(
    st.tuples(st.sampled_from(sorted(HANDLERS) + ["bogus"]), _meta, _arrays).map(
        lambda t: (t[0], frame.encode(frame.KIND_REQUEST, t[1], t[2]))),
    st.tuples(st.sampled_from(sorted(HANDLERS)), st.binary(max_size=200)),
)

ALLOWED = {200, 400, 404, 409, 410, 413, 421, 429, 503, 504}


def test_fuzz_data_endpoints_never_5xx_and_never_change_state_on_rejection(cluster):
    async def setup():
        async with client(cluster) as ps:
            await ps.create("fz/w", np.zeros(4, np.float32))
    asyncio.run(setup())
    shard = block_shard("fz/w", 0, cluster.cfg.shards)
    base = leader_url(cluster, shard)
    seen = {"requests": 0, "rejected": 0}

    @settings(max_examples=2500, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(_request)
    def one(req):
        op, body = req
        before = state_hash(base, cluster.token)
        status, data, _ = post(base + "/v1/rpc/" + op, body, cluster.token)
        seen["requests"] += 1
        assert status in ALLOWED, f"{op}: HTTP {status}: {data[:300]!r}"
        if status != 200:
            seen["rejected"] += 1
            assert json.loads(data)["error"]
            assert state_hash(base, cluster.token) == before, f"rejected {op} changed the state"

    one()
    assert seen["rejected"] > 500  # the fuzz mostly produced junk, and all of it was refused cleanly
    assert state_hash(base, cluster.token)  # and the replica still serves


def test_tls_for_client_and_admin_traffic(tmp_path, cluster_factory):
    import ssl

    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    ca_pem, cert_pem, key_pem = tmp_path / "ca.pem", tmp_path / "cert.pem", tmp_path / "key.pem"
    ca.cert_pem.write_to_path(str(ca_pem))
    cert.cert_chain_pems[0].write_to_path(str(cert_pem))
    cert.private_key_pem.write_to_path(str(key_pem))
    c = cluster_factory(shards=1, tls_cert=cert_pem, tls_key=key_pem, tls_ca=ca_pem).start()
    assert c.endpoints[0].startswith("https://")

    async def main(ssl_arg):
        async with kc.Client(c.endpoints, token=c.token, seed=0, ssl=ssl_arg, timeout=5) as ps:
            await ps.create("tls/w", np.zeros(4, np.float32))
            await ps.push({"tls/w": np.ones(4, np.float32)})
            value, n = (await ps.pull("tls/w"))["tls/w"], len(await ps.keys())
            assert ps.stats.wire_requests > 0  # the node's wire port, over TLS too
            return value, n

    value, n = asyncio.run(main(str(ca_pem)))
    assert np.all(value == 1) and n == 1
    # admin API over https, verified with the CA; /v1/keys goes through the node's own client
    ctx = ssl.create_default_context(cafile=str(ca_pem))
    req = urllib.request.Request(c.endpoints[0] + "/v1/keys", headers={"Authorization": f"Bearer {c.token}"})
    with urllib.request.urlopen(req, context=ctx, timeout=5) as resp:
        assert [k["key"] for k in json.loads(resp.read())["keys"]] == ["tls/w"]
    # a client that does not trust the CA gets no answer it could be fooled by
    with pytest.raises(kc.Unavailable):
        asyncio.run(main(None))
    # and plain http to a TLS port is refused
    with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
        urllib.request.urlopen(c.endpoints[0].replace("https://", "http://") + "/healthz", timeout=5)


def test_openapi_document_matches_the_routers_and_live_responses(cluster):
    import jsonschema

    from kvps.node.admin import make_app
    from kvps.node.node import Node
    from kvps.node.openapi import ADMIN_PATHS, DATA_PATHS

    status, body = get(cluster.endpoints[0] + "/v1/openapi.json", cluster.token)
    doc = json.loads(body)
    assert status == 200 and doc["openapi"].startswith("3.1")
    node = Node(cluster.cfg, 0, cluster.config_path, cluster.data_dir / "node-0",
                TokenStore(cluster.data_dir / "token"))
    served = {(r.method.lower(), r.resource.canonical) for r in make_app(node).router.routes()
              if r.method != "HEAD"}
    assert served == {(m, p) for p, ops in ADMIN_PATHS.items() for m in ops}
    assert {(m.lower(), p) for m, p in _replica_routes(cluster) if "{op}" not in p and "/rpc/" not in p} \
        | {("post", "/v1/rpc/{op}")} == {(m, p) for p, ops in DATA_PATHS.items() for m in ops}
    ops = doc["paths"]["/replica/v1/rpc/{op}"]["post"]["parameters"][0]["schema"]["enum"]
    assert sorted(ops) == sorted(HANDLERS)
    # live responses of every JSON admin route validate against the documented schema
    asyncio.run(_make_some_keys(cluster))
    for path, ops_ in ADMIN_PATHS.items():
        if "get" not in ops_:
            continue
        content = ops_["get"]["responses"]["200"]["content"]
        if "application/json" not in content or path == "/v1/openapi.json":
            continue
        # /readyz answers 503 for a moment after an earlier test's fault in this module's cluster
        url = cluster.endpoints[0] + path.replace("{id}", "0")
        status, body = wait_until(lambda: (lambda r: r if r[0] == 200 else None)(get(url, cluster.token)),
                                  30, f"200 from {path}", 0.1)
        jsonschema.validate(json.loads(body), content["application/json"]["schema"])


async def _make_some_keys(cluster):
    async with client(cluster) as ps:
        await ps.create("oa/w", np.zeros(4, np.float32))
        await ps.push({"oa/w": np.ones(4, np.float32)})
