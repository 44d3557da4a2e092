"""Every admin route fuzzed over real HTTP, as the data plane is in test_admin.py.

The routes come from the node's admin router itself (``kvps.node.admin.make_app``, with the
snapshot and membership routes their owners add), so a route added later without a case in
``SPECS`` fails ``test_every_admin_route_has_a_fuzz_case``. Each hostile request (malformed or
non-object JSON, a missing or mistyped field, an oversized or absurdly nested body, a bad path id,
a bad query value) must get a typed 4xx (kvps error JSON), leave a log line naming its request id,
and change nothing: the metadata state, the snapshot catalog and every replica's state hash.
Replay a failure with ``KVPS_FUZZ_SEED=<seed>`` (the seed is in the failure message).
"""
from __future__ import annotations

import asyncio
import http.client
import json
import os
import urllib.parse
import uuid
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

import kvps.errors
import kvps_client as kc
from conftest import module_cluster, wait_for
from kvps.command import SNAPSHOT_ID
from kvps.config import ServerConfig
from kvps.node.admin import ADMIN_MAX_BODY

pytestmark = pytest.mark.cluster

SEED = int(os.environ.get("KVPS_FUZZ_SEED", "20240607"))
EXAMPLES = int(os.environ.get("KVPS_FUZZ_EXAMPLES", "400"))


@dataclass(frozen=True)
class Spec:
    """What a route takes, so the fuzz knows what is hostile for it."""
    token: bool = False                                 # needs the token
    ids: str | None = None                              # the kind of its {id}: shard, node, snapshot
    fields: dict[str, tuple[type, ...]] = field(default_factory=dict)   # JSON body fields
    required: tuple[str, ...] = ()
    query: tuple[str, ...] = ()                         # query parameters it reads


_INT = (int,)
SPECS: dict[tuple[str, str], Spec] = {
    ("GET", "/healthz"): Spec(),
    ("GET", "/readyz"): Spec(),
    ("GET", "/metrics"): Spec(),
    ("GET", "/v1/node"): Spec(),
    ("GET", "/v1/cluster"): Spec(),
    ("GET", "/v1/shards/{id}"): Spec(ids="shard"),
    ("GET", "/v1/keys"): Spec(),
    ("GET", "/v1/openapi.json"): Spec(),
    ("GET", "/v1/assignment"): Spec(),
    ("GET", "/v1/meta"): Spec(),
    ("GET", "/v1/snapshots"): Spec(token=True, query=("all",)),
    ("POST", "/v1/snapshots"): Spec(token=True, fields={"label": (str,)}),
    ("POST", "/v1/snapshots/restore"): Spec(token=True, fields={"at": (int, float, str)},
                                            required=("at",)),
    ("DELETE", "/v1/snapshots/{id}"): Spec(token=True, ids="snapshot"),
    ("POST", "/v1/snapshots/{id}/restore"): Spec(token=True, ids="snapshot"),
    ("POST", "/v1/nodes"): Spec(token=True, fields={"host": (str,), "admin_port": _INT, "port_base": _INT},
                                required=("host", "admin_port", "port_base")),
    ("POST", "/v1/nodes/{id}/drain"): Spec(token=True, ids="node"),
    ("GET", "/v1/identity"): Spec(token=True),
    ("POST", "/v1/nodes/{id}/incarnation"): Spec(token=True, ids="node"),
    ("POST", "/v1/nodes/{id}/zone"): Spec(token=True, ids="node", fields={"zone": (str,)}, required=("zone",)),
    ("POST", "/v1/moves"): Spec(token=True, fields={"shard": _INT, "source": _INT, "target": _INT},
                                required=("shard", "source", "target")),
    ("POST", "/v1/rebalance"): Spec(token=True, fields={"auto": (bool,)}, required=("auto",)),
}

NODES, SHARDS = 3, 1


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from module_cluster(tmp_path_factory, "adminfuzz", nodes=NODES, shards=SHARDS,
                              server=ServerConfig(body_timeout=2.0))


def admin_routes(cluster) -> set[tuple[str, str]]:
    from kvps.node.admin import make_app
    from kvps.node.node import Node
    from kvps.service.auth import TokenStore
    node = Node(cluster.cfg, 0, cluster.config_path, cluster.data_dir / "node-0",
                TokenStore(cluster.data_dir / "token"))
    return {(r.method, r.resource.canonical) for r in make_app(node).router.routes()
            if r.method != "HEAD"}


def test_every_admin_route_has_a_fuzz_case(cluster):
    routes = admin_routes(cluster)
    assert len(routes) >= 15  # the router really was enumerated
    missing = sorted(routes - set(SPECS))
    assert not missing, f"admin routes without a fuzz case in SPECS: {missing}"
    assert not set(SPECS) - routes, f"SPECS names routes no longer served: {sorted(set(SPECS) - routes)}"


# ---- hostile inputs --------------------------------------------------------------------------

_json = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats()
                     | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                     max_leaves=6)

_bad_ids = {
    "shard": st.one_of(st.integers(SHARDS, 2**40).map(str), st.integers(-2**40, -1).map(str)),
    "node": st.one_of(st.integers(NODES, 2**40).map(str), st.integers(-2**40, -1).map(str)),
    # well-formed ids that name no snapshot (the cluster has none) and malformed ones
    "snapshot": st.one_of(st.from_regex(r"\Anosuch[a-z0-9]{0,8}\Z"), st.just("x" * 65),
                          st.text(min_size=1, max_size=12).filter(lambda t: not t.isascii() or " " in t)),
}
_any_bad_id = st.one_of(
    st.sampled_from(["", "abc", "1.5", "1e3", "0x1", " 1", "1 ", "+1", "1_0", "²", "١", "9" * 40,
                     "-0", "..", "%", "null", "[]"]),
    st.text(max_size=10).filter(lambda t: not t.isdigit() or not t.isascii()),
)


def _wrong_type(kinds: tuple[type, ...]):
    def ok(v):
        if isinstance(v, bool):
            return bool in kinds
        return isinstance(v, kinds) and not (int in kinds and isinstance(v, int) and not 0 <= v < 2**31)
    return _json.filter(lambda v: v is not None and not ok(v))


def _bodies(spec: Spec):
    """Bodies that break the route's contract, each in one way."""
    junk = [
        st.binary(max_size=40).filter(lambda b: _not_json_object(b)),               # malformed
        _json.filter(lambda v: not isinstance(v, dict)).map(lambda v: json.dumps(v).encode()),   # not an object
        st.just(b"[" * 200_00 + b"]" * 200_00),                                        # deep, small
        st.just(b'{"pad": "' + b"x" * (ADMIN_MAX_BODY + 10) + b'"}'),                 # oversized
        st.just(b'{"a": 1'),                                                           # truncated
    ]
    if spec.required:
        junk.append(st.sampled_from(spec.required).map(
            lambda name: json.dumps({k: _valid(v) for k, v in spec.fields.items() if k != name}).encode()))
    if spec.fields:
        junk.append(st.sampled_from(sorted(spec.fields)).flatmap(
            lambda name: _wrong_type(spec.fields[name]).map(
                lambda bad: json.dumps({**{k: _valid(v) for k, v in spec.fields.items()}, name: bad}).encode())))
    return st.one_of(*junk)


def _not_json_object(b: bytes) -> bool:
    try:
        return not isinstance(json.loads(b), dict) and bool(b.strip())
    except (ValueError, RecursionError):
        return bool(b.strip())


def _valid(kinds: tuple[type, ...]):
    """A field value of the right type that would still be refused as a whole request (never a
    real join, move or restore: the body always breaks another field)."""
    return {str: "127.0.0.1", int: 1, bool: True}.get(kinds[0], 0)


@st.composite
def hostile(draw, route):
    """(method, path, query, body, token, must_be_4xx) for one route."""
    method, path = route
    spec = SPECS[route]
    token = draw(st.sampled_from([True] * 9 + [False])) if spec.token else draw(st.booleans())
    query, body, must = "", b"", False
    if spec.ids is not None:
        bad = draw(st.one_of(_bad_ids[spec.ids], _any_bad_id))
        if route == ("DELETE", "/v1/snapshots/{id}"):  # deleting an absent snapshot is idempotent
            bad = draw(st.one_of(_any_bad_id, _bad_ids["snapshot"]).filter(lambda t: not SNAPSHOT_ID.match(t)))
        path = path.replace("{id}", urllib.parse.quote(bad, safe=""))
        must = True
        if method == "POST":
            body = draw(st.one_of(st.just(b""), _bodies(spec), st.just(b"{}")))
    elif spec.fields:
        body, must = draw(_bodies(spec)), True
    elif spec.query:
        name = draw(st.sampled_from(spec.query))
        value = draw(st.text(max_size=10).filter(lambda v: v not in ("0", "1", "true", "false")))
        query, must = "?" + urllib.parse.urlencode({name: value}), True
    else:  # a route that takes nothing: junk it ignores, or an oversized body it must refuse
        query = "?" + urllib.parse.urlencode(draw(st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2)))
        body = draw(st.one_of(st.just(b""), st.binary(max_size=30),
                              st.just(b"x" * (ADMIN_MAX_BODY + 10))))
    return method, path, query, body, token, must


def send(base: str, method: str, path: str, body: bytes, headers: dict) -> tuple[int, bytes, dict]:
    url = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=15)  # a hang fails the test
    try:
        conn.request(method, path, body=body or None, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read(), dict(resp.headers)
    finally:
        conn.close()


def fingerprint(cluster) -> dict:
    """What no refused admin request may change."""
    meta = cluster.admin("GET", "/v1/meta")
    meta.pop("raft", None)  # role, term, indexes: moved by elections and heartbeats, not requests
    hashes = {(n, s): (cluster.state_hash(n, s) or (None,))[0] for n in range(NODES) for s in range(SHARDS)}
    return {"meta": meta, "snapshots": cluster.admin("GET", "/v1/snapshots?all=1"), "hashes": hashes}


def answered_fingerprint(cluster) -> dict:
    """``fingerprint`` once every replica answers (a state-hash call can time out on a loaded
    machine: a missing answer is not a changed state)."""
    return wait_for(lambda: (lambda f: f if all(f["hashes"].values()) else None)(fingerprint(cluster)),
                    30, "every replica to answer with its state hash")


def test_fuzz_admin_routes_refuse_hostile_input_typed_logged_and_harmless(cluster):
    routes = sorted(SPECS)
    before = answered_fingerprint(cluster)
    refused: list[tuple[int, str]] = []
    seen = {"requests": 0}
    error_names = {n for n in dir(kvps.errors) if isinstance(getattr(kvps.errors, n), type)}

    @seed(SEED)
    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.filter_too_much])
    @given(st.sampled_from(routes).flatmap(lambda r: st.tuples(st.just(r), hostile(r))),
           st.integers(0, NODES - 1))
    def one(case, node):
        route, (method, path, query, body, token, must) = case
        rid = "fz-" + uuid.uuid4().hex[:12]
        headers = {"X-Request-Id": rid, **({"Authorization": f"Bearer {cluster.token}"} if token else {})}
        status, data, _ = send(cluster.endpoints[node], method, path + query, body, headers)
        seen["requests"] += 1
        what = f"{method} {path}{query} body {body[:80]!r}: HTTP {status} {data[:300]!r}"
        assert status < 500 or (route == ("GET", "/readyz") and status == 503), what
        if must:
            assert 400 <= status < 500, what
        if status >= 400:
            err = json.loads(data)
            assert err["error"] in error_names and isinstance(err["message"], str), what
            refused.append((node, rid))
            if method != "GET":
                assert answered_fingerprint(cluster) == before, f"refused {what} changed the state"

    try:
        one()
    except BaseException as exc:
        raise AssertionError(f"admin fuzz failed with seed {SEED} (replay: KVPS_FUZZ_SEED={SEED}): "
                             f"{exc}") from exc
    assert len(refused) > EXAMPLES // 2
    assert answered_fingerprint(cluster) == before
    # every refusal is a log line on the node that refused it, with the caller's request id
    def logged() -> bool:
        logs = {n: (cluster.data_dir / f"node-{n}" / "logs" / "node.log").read_text() for n in range(NODES)}
        return all(rid in logs[n] for n, rid in refused)
    wait_for(logged, 10, "a log line for every refused request")
    # and every node still serves, a real client included
    for base in cluster.endpoints:
        assert send(base, "GET", "/v1/cluster", b"", {"Authorization": f"Bearer {cluster.token}"})[0] == 200

    async def train():
        async with kc.Client(cluster.endpoints, token=cluster.token, seed=0) as ps:
            await ps.create("fz/after", np.zeros(4, np.float32))
            await ps.push({"fz/after": np.ones(4, np.float32)})
            return (await ps.pull("fz/after"))["fz/after"]
    assert np.all(asyncio.run(train()) == 1)
