"""The replica's data endpoint (aiohttp): frames in, frames out, typed errors as JSON.

``POST /v1/rpc/{op}`` with a request frame; the reply is a response frame (200) or
``{"error": ClassName, "message", "fields"}`` with the error class's HTTP status. Every call but
``/healthz`` and ``/metrics`` needs ``Authorization: Bearer <token>`` of the role
``kvps.replica.access`` names (401 without a valid token, 403 with too small a role). Foreign exceptions are converted to kvps errors here, at one
boundary; nothing that arrives here is ever unpickled. Past the house's ~450 lines on purpose:
one handler per op, side by side with the table that routes them.
"""
from __future__ import annotations

import asyncio
import logging
import re
import uuid
from collections.abc import Awaitable, Callable, Sequence

import numpy as np
from aiohttp import web

from kvps.service.auth import TokenStore
from kvps.command import (
    MAX_BATCH_KEYS, SNAPSHOT_ID, ClockTick, CreateKey, CreateKeys, CreateTable, DeleteKey, Hyperparams, Set, SetRows, SnapshotStep,
)
from kvps.delta import frame, lossy
from kvps.delta.pack import PACK_MAX_BYTES, pack_into
from kvps.errors import InvalidRequest, KeyNotFound, KvpsError, RequestTooLarge, Timeout
from kvps.delta.xor import xor_delta
from kvps.replica import requests as rq
from kvps.replica.access import OPEN_ROUTES, op_role, route_role
from kvps.replica.membership import membership_rpc
from kvps.merge import PushRequest, content_digest
from kvps.placement import DenseLayout
from kvps.replica.metrics import CONTENT_TYPE
from kvps.replica.replica import Replica

__all__ = ["OPEN_ROUTES", "answer", "error_response", "make_app", "rejected", "request_id_of"]

log = logging.getLogger("kvps.dataplane")

Handler = Callable[[Replica, frame.Frame], Awaitable[tuple[dict, Sequence[np.ndarray]]]]

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def request_id_of(request: web.Request) -> str:
    """The caller's ``X-Request-Id`` when it is sane, else a fresh one; echoed in the reply."""
    given = request.headers.get("X-Request-Id", "")
    return given if _REQUEST_ID.match(given) else uuid.uuid4().hex[:16]


def error_response(exc: KvpsError, request_id: str) -> web.Response:
    return web.json_response(exc.to_dict(), status=exc.http_status,
                             headers={"X-Request-Id": request_id})


def make_app(replica: Replica, tokens: TokenStore) -> web.Application:
    cfg = replica.cfg.server
    app = web.Application(client_max_size=cfg.max_request_bytes)

    async def rpc(request: web.Request) -> web.StreamResponse:
        op = request.match_info["op"]
        rid = request_id_of(request)
        try:
            parts = await answer(replica, tokens, op, request.headers.get("Authorization"),
                                 lambda: _read_body(request, cfg.max_request_bytes, cfg.body_timeout))
        except KvpsError as exc:
            rejected(replica, op, rid, exc)
            return error_response(exc, rid)
        return await _send_parts(request, parts, rid)

    async def status(request: web.Request) -> web.Response:
        rid = request_id_of(request)
        try:
            tokens.check(request.headers.get("Authorization"), route_role("GET", "/v1/status"),
                         "GET /v1/status")
        except KvpsError as exc:
            replica.stats.rejected(type(exc).__name__)
            return error_response(exc, rid)
        return web.json_response(replica.status(), headers={"X-Request-Id": rid})

    async def healthz(request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def snapshot_file(request: web.Request) -> web.StreamResponse:
        """This replica's file of a user snapshot (a replica that lacks it fetches it from here)."""
        rid = request_id_of(request)
        try:
            tokens.check(request.headers.get("Authorization"),
                         route_role("GET", "/v1/snapshots/{snap_id}/file"), "read snapshot files")
            snap_id = request.match_info["snap_id"]
            if not SNAPSHOT_ID.match(snap_id):
                raise InvalidRequest(f"bad snapshot id {snap_id!r}")
            path = replica.snapshots.file_path(snap_id)
            if not path.is_file():
                raise KeyNotFound(f"no file of snapshot {request.match_info['snap_id']!r} here")
        except KvpsError as exc:
            return error_response(exc, rid)
        return web.FileResponse(path, headers={"X-Request-Id": rid,
                                               "Content-Type": "application/octet-stream"})

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=replica.expose_metrics(), headers={"Content-Type": CONTENT_TYPE})

    app.router.add_post("/v1/rpc/{op}", rpc)
    app.router.add_get("/v1/status", status)
    app.router.add_get("/v1/snapshots/{snap_id}/file", snapshot_file)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    return app


async def answer(replica: Replica, tokens: TokenStore, op: str, authorization: str | None,
                 body: Callable[[], Awaitable[bytes | memoryview]]) -> list:
    """One operation, whatever carried it (HTTP here, a node's wire port: ``kvps.service.wire``):
    the caller's role checked, ``body()`` read only then, the response frame's parts returned.
    A refusal is raised as its ``KvpsError``."""
    cfg = replica.cfg.server
    tokens.check(authorization, op_role(op), op)
    handler = HANDLERS.get(op)
    if handler is None:
        raise InvalidRequest(f"unknown operation {op!r}", op=op)
    req = frame.decode(await body(), max_raw_bytes=cfg.max_raw_bytes, kinds=(frame.KIND_REQUEST,))
    meta, arrays, *codecs = await handler(replica, req)
    codec = req.meta.get("accept_codec", "none")
    if codec not in ("none", "lz4", "shuffle-lz4", "auto"):
        codec = "none"
    # a handler may choose per array (e.g. compress deltas, not raw weights)
    return frame.encode_parts(frame.KIND_RESPONSE, meta, arrays, codec=codecs[0] if codecs else codec)


def rejected(replica: Replica, op: str, request_id: str, exc: KvpsError) -> None:
    """Count a refused operation; log it unless it is routine (a 5xx is logged by its raiser, a
    NotLeader is how clients find leaders)."""
    replica.stats.rejected(type(exc).__name__)
    if exc.http_status < 500 and exc.http_status != 421:
        log.info("shard %d %s [%s] rejected: %s: %s", replica.shard, op, request_id,
                 type(exc).__name__, exc.message)


async def _read_body(request: web.Request, limit: int, timeout: float) -> bytes | memoryview:
    """The whole body, refused early when too large and bounded in time (slow clients)."""
    if request.content_length is not None and request.content_length > limit:
        raise RequestTooLarge("request body too large", limit=limit, size=request.content_length)
    try:
        async with asyncio.timeout(timeout):
            if request.content_length is None:  # chunked: aiohttp's read (it checks the cap)
                return await request.read()
            return await _read_exactly(request, request.content_length)
    except web.HTTPRequestEntityTooLarge as exc:
        raise RequestTooLarge("request body too large", limit=limit) from exc
    except TimeoutError:
        raise Timeout(f"request body not received within {timeout}s") from None


async def _read_exactly(request: web.Request, size: int) -> memoryview:
    """The body, copied once into a buffer of its declared size (``request.read()`` grows a
    bytearray chunk by chunk and then copies it into bytes: ~3 copies of every pushed byte).
    ``np.empty``, not ``bytearray(size)``: every byte is written below, so zeroing it first would
    be one more pass over the body."""
    view, pos = memoryview(np.empty(size, np.uint8)), 0
    while pos < size:
        chunk = await request.content.readany()
        if not chunk:
            raise InvalidRequest(f"body ended after {pos} of {size} bytes")
        end = pos + len(chunk)
        if end > size:  # aiohttp's parser stops at Content-Length; checked anyway
            raise InvalidRequest("body longer than its Content-Length")
        view[pos:end] = chunk
        pos = end
    return view


async def _send_parts(request: web.Request, parts: list, request_id: str) -> web.StreamResponse:
    resp = web.StreamResponse(status=200, headers={"Content-Type": "application/x-kvps-frame",
                                                   "X-Request-Id": request_id})
    resp.content_length = sum(len(p) for p in parts)
    await resp.prepare(request)
    for part in parts:
        await resp.write(part)
    await resp.write_eof()
    return resp


# ---- handlers -------------------------------------------------------------------------------------

async def _push(replica: Replica, req: frame.Frame):
    client, seq, floor = rq.client_ids(req.meta)
    dense = tuple((rq.key(it), rq.field(it, "block", int), _dense_grad(replica.describe, req, it))
                  for it in rq.items(req.meta, "dense"))
    rows = tuple((rq.key(it), rq.array(req, it.get("ids")), _row_grads(replica.describe, req, it))
                 for it in rq.items(req.meta, "rows"))
    if not dense and not rows:
        raise InvalidRequest("empty push")
    result = await replica.push(PushRequest(client, seq, floor, dense, rows,
                                            digest=content_digest(dense, rows)))
    return {"versions": result["versions"]}, ()


Describe = Callable[[str], dict]  # a key's description (its dtype, blocks, layout)


def _dense_grad(describe: Describe, req: frame.Frame, it: dict) -> np.ndarray:
    """A dense gradient part, decoded to the key's dtype if a lossy codec sent it."""
    encoding = rq.field(it, "encoding", str, "raw")
    if encoding == "raw":
        return rq.packed(req, it) if "packed" in it else rq.array(req, it.get("array"))
    key, block = rq.key(it), rq.field(it, "block", int)
    if encoding in ("fp16", "bf16"):
        return lossy.widen(rq.array(req, it.get("array")), encoding,
                           np.dtype(describe(key)["dtype"]), repr(key))
    if encoding == "topk":
        info = describe(key)
        if info.get("kind") != "dense" or block not in info.get("blocks", []):
            raise InvalidRequest(f"block {block} of {key!r} is not on this shard", key=key)
        layout = DenseLayout(tuple(info["shape"]), info["dtype"], info["block_rows"])
        return lossy.topk_expand(rq.array(req, it.get("idx")), rq.array(req, it.get("array")),
                                 layout.block_shape(block), np.dtype(info["dtype"]), repr(key))
    raise InvalidRequest(f"unknown gradient encoding {encoding!r}", field="encoding")


def _row_grads(describe: Describe, req: frame.Frame, it: dict) -> np.ndarray:
    encoding = rq.field(it, "encoding", str, "raw")
    grads = rq.array(req, it.get("grads"))
    if encoding == "raw":
        return grads
    return lossy.widen(grads, encoding, np.dtype(describe(rq.key(it))["dtype"]), repr(rq.key(it)))


async def _pull(replica: Replica, req: frame.Frame):
    consistency = rq.field(req.meta, "consistency", str, "leader")
    deltas = rq.field(req.meta, "delta", bool, False)
    full_codec = req.meta.get("accept_codec", "none")
    if full_codec not in ("none", "lz4", "shuffle-lz4", "auto"):
        full_codec = "none"
    items = []
    wanted: dict[str, int] = {}  # key -> its version on this shard a follower must have reached
    for it in rq.items(req.meta, "dense"):
        key, blocks = rq.key(it), rq.field(it, "blocks", list)
        have = rq.field(it, "have", list, [None] * len(blocks))
        if len(have) != len(blocks) or not all(isinstance(b, int) for b in blocks):
            raise InvalidRequest("'blocks' and 'have' must be lists of equal length", key=key)
        min_version = rq.field(it, "min_version", int, 0)
        if min_version:
            wanted[key] = max(wanted.get(key, 0), min_version)
        items.append((key, blocks, have))
    short = await replica.before_read(consistency, wanted)
    # a client on this host asks for the blocks' places in the leader's shared-memory mirror,
    # from which it reads them next time (kvps.delta.mirror)
    mirror = replica.mirror.open() \
        if consistency == "leader" and rq.field(req.meta, "mirror", bool, False) else None
    out_meta, arrays, codecs = [], [], []
    small, small_values = [], []  # full blocks to pack, for a client that takes them packed
    packing = rq.field(req.meta, "packed", bool, False) and full_codec == "none"
    for key, blocks, have in items:
        if mirror is not None:
            current, slots = replica.host.read_mirrored(key, blocks)
        else:
            current, slots = replica.host.lookup(lambda s: s.read_blocks(key, blocks)), None
        for i, (block, held, (version, value)) in enumerate(zip(blocks, have, current)):
            entry = {"key": key, "block": block, "version": version, "array": None}
            if slots is not None:
                entry["mirror"] = slots[i]
            if held != version:
                base = replica.host.remembered(key, block, held) if deltas and isinstance(held, int) else None
                entry["array"] = len(arrays)
                if base is not None and base.shape == value.shape:
                    # exact: the client XORs it onto the version it holds
                    entry["base"] = held
                    arrays.append(xor_delta(value, base))
                    codecs.append("shuffle-lz4")
                elif packing and value.nbytes <= PACK_MAX_BYTES:
                    del entry["array"]  # packed / at / shape instead, below
                    small.append(entry)
                    small_values.append(value)
                else:
                    arrays.append(value)
                    codecs.append(full_codec)
            out_meta.append(entry)
    codecs += ["none"] * pack_into(small, small_values, arrays)
    replica.stats.count_pull(sum(a.nbytes for a in arrays))
    shared = {"mirror": str(mirror.path)} if mirror is not None and not mirror.closed else {}
    return {"blocks": out_meta, **_short(short), **shared}, arrays, codecs


def _short(short: dict[str, int]) -> dict:
    """Keys whose min_version this shard has not issued, with the version it has (the client
    raises ``VersionNotIssued`` when no shard of a key issued it)."""
    return {"short": short} if short else {}


async def _pull_rows(replica: Replica, req: frame.Frame):
    """Rows ``ids``; with ``have`` (the versions the caller holds, -1 for none) only the rows
    whose version differs come back, with their positions in ``ids``."""
    key = rq.key(req.meta)
    ids = rq.array(req, req.meta.get("ids"))
    min_version = rq.field(req.meta, "min_version", int, 0)
    short = _short(await replica.before_read(rq.field(req.meta, "consistency", str, "leader"),
                                             {key: min_version} if min_version else {}))
    if "have" not in req.meta:
        values, versions = replica.host.lookup(lambda s: s.read_rows(key, ids))
        replica.stats.count_pull(values.nbytes)
        return {"rows": 0, "versions": 1, **short}, (values, versions)
    have = rq.array(req, req.meta.get("have"))
    if have.shape != ids.shape or have.dtype != np.int64:
        raise InvalidRequest("'have' must be int64 versions, one per id", key=key)
    current, values = replica.host.lookup(lambda s: s.changed_rows(key, ids, have))
    changed = np.flatnonzero(current != have)  # (m,) positions in ids
    replica.stats.count_pull(values.nbytes)
    return ({"changed": 0, "versions": 1, "rows": 2, **short}, (changed.astype(np.int64), current[changed], values),
            ["shuffle-lz4", "shuffle-lz4", "none"])


async def _stored_rows(replica: Replica, req: frame.Frame):
    """Every written row of a table on this shard (for export)."""
    key = rq.key(req.meta)
    await replica.before_read(rq.field(req.meta, "consistency", str, "leader"), {})
    ids, values = replica.host.lookup(lambda s: s.stored_rows(key))
    replica.stats.count_pull(values.nbytes)
    return {"ids": 0, "rows": 1}, (ids, values)


async def _set_rows(replica: Replica, req: frame.Frame):
    cmd = SetRows(key=rq.key(req.meta), ids=rq.array(req, req.meta.get("ids")),
                  values=rq.array(req, req.meta.get("rows")))
    return await replica.write(cmd), ()


async def _create_key(replica: Replica, req: frame.Frame):
    m = req.meta
    shape = rq.field(m, "shape", list)
    cmd = CreateKey(key=rq.key(m), shape=tuple(shape), dtype=rq.field(m, "dtype", str),
                    block_rows=rq.field(m, "block_rows", int), optimizer=rq.field(m, "optimizer", dict),
                    merge=rq.field(m, "merge", str, "sum"), blocks=rq.blocks(req))
    return await replica.write(cmd), ()


async def _create_keys(replica: Replica, req: frame.Frame):
    """Many dense keys' creates (this shard's blocks of each) in one Raft entry: ``{"results":
    [...]}``, one per key in order, ``{"created": bool}`` or the key's error."""
    defs = rq.items(req.meta, "keys")
    if not 1 <= len(defs) <= MAX_BATCH_KEYS:
        raise InvalidRequest(f"'keys' must name 1-{MAX_BATCH_KEYS} keys", field="keys")
    cmds = tuple(CreateKey(key=rq.key(m), shape=tuple(rq.field(m, "shape", list)), dtype=rq.field(m, "dtype", str),
                           block_rows=rq.field(m, "block_rows", int), optimizer=rq.field(m, "optimizer", dict),
                           merge=rq.field(m, "merge", str, "sum"), blocks=rq.blocks(req, m))
                 for m in defs)
    return await replica.write(CreateKeys(cmds)), ()


async def _create_table(replica: Replica, req: frame.Frame):
    m = req.meta
    cmd = CreateTable(key=rq.key(m), dim=rq.field(m, "dim", int), dtype=rq.field(m, "dtype", str),
                      optimizer=rq.field(m, "optimizer", dict), init=rq.field(m, "init", dict),
                      merge=rq.field(m, "merge", str, "sum"), lifecycle=m.get("lifecycle"))
    return await replica.write(cmd), ()


async def _delete_key(replica: Replica, req: frame.Frame):
    return await replica.write(DeleteKey(key=rq.key(req.meta))), ()


async def _set(replica: Replica, req: frame.Frame):
    client, seq, floor = rq.client_ids(req.meta)
    expected = rq.field(req.meta, "expected_version", (int, type(None)), None)
    cmd = Set(now=replica.cluster_time.now(), client=client, seq=seq, floor=floor, key=rq.key(req.meta),
              blocks=rq.blocks(req), expected_version=expected)
    result = await replica.write(cmd)
    return {"versions": result["versions"]}, ()


async def _clock_tick(replica: Replica, req: frame.Frame):
    m = req.meta
    cmd = ClockTick(now=replica.cluster_time.now(), job=rq.field(m, "job", str), worker=rq.field(m, "worker", str),
                    step=rq.field(m, "step", int), lease_s=rq.field(m, "lease_s", (int, float)))
    return await replica.write(cmd), ()


async def _hyperparams(replica: Replica, req: frame.Frame):
    m = req.meta
    cmd = Hyperparams(key=rq.key(m), step=rq.field(m, "step", int), values=rq.field(m, "values", dict))
    return await replica.write(cmd), ()


async def _clocks(replica: Replica, req: frame.Frame):
    await replica.before_read(rq.field(req.meta, "consistency", str, "leader"), {})
    return {"clocks": replica.clocks(rq.field(req.meta, "job", str))}, ()


async def _describe(replica: Replica, req: frame.Frame):
    """One key's info (``key``), or several's (``keys``: ``{"infos": [...]}`` in their order;
    ``KeyNotFound`` for the first one missing)."""
    await replica.before_read(rq.field(req.meta, "consistency", str, "leader"), {})
    if "keys" not in req.meta:
        return {"info": replica.describe(rq.key(req.meta))}, ()
    keys = rq.field(req.meta, "keys", list)
    if not 1 <= len(keys) <= MAX_BATCH_KEYS or not all(isinstance(k, str) for k in keys):
        raise InvalidRequest(f"'keys' must be 1-{MAX_BATCH_KEYS} strings", field="keys")
    return {"infos": [replica.describe(k) for k in keys]}, ()


async def _keys(replica: Replica, req: frame.Frame):
    await replica.before_read(rq.field(req.meta, "consistency", str, "leader"), {})
    return {"keys": replica.host.lookup(lambda s: s.keys())}, ()


async def _key_versions(replica: Replica, req: frame.Frame):
    """The leader's versions of ``keys`` on this shard (-1: absent), for a follower that is
    behind a read's min_version."""
    keys = rq.field(req.meta, "keys", list)
    if not all(isinstance(k, str) for k in keys):
        raise InvalidRequest("'keys' must be a list of strings", field="keys")
    await replica.before_read("leader", {})
    return {"versions": replica.key_versions(keys)}, ()


async def _state_hash(replica: Replica, req: frame.Frame):
    return {"hash": replica.host.lookup(lambda s: s.state_hash()),
            "applied_index": replica.group.status()["applied_index"]}, ()


async def _snapshot_step(replica: Replica, req: frame.Frame):
    m = req.meta
    cmd = SnapshotStep(op=rq.field(m, "op", str), snap_id=rq.field(m, "snap_id", str),
                       at=rq.field(m, "at", (int, float), 0.0), label=rq.field(m, "label", str, ""),
                       digest=rq.field(m, "digest", str, ""), size=rq.field(m, "size", int, 0))
    return {"result": await replica.snapshot_step(cmd)}, ()


async def _snapshot_status(replica: Replica, req: frame.Frame):
    """This replica's own view (no leader needed): the catalog entry and its file."""
    snap_id = rq.field(req.meta, "snap_id", str)
    entry = replica.host.lookup(lambda s: s.snapshot_entry(snap_id))
    return {**replica.snapshots.status(snap_id, entry), "replica": replica.address,
            "node": replica.node_id}, ()


async def _snapshot_catalog(replica: Replica, req: frame.Frame):
    await replica.before_read(rq.field(req.meta, "consistency", str, "leader"), {})
    return {"snapshots": replica.host.lookup(lambda s: s.snapshot_catalog())}, ()


async def _snapshot_prepare(replica: Replica, req: frame.Frame):
    m = req.meta
    sources = rq.field(m, "sources", list, [])
    if not all(isinstance(u, str) and u.startswith(("http://", "https://")) for u in sources):
        raise InvalidRequest("sources must be data URLs", field="sources")
    return await replica.snapshots.prepare(rq.field(m, "snap_id", str), rq.field(m, "digest", str),
                                           sources), ()


HANDLERS: dict[str, Handler] = {
    "push": _push,
    "pull": _pull,
    "pull_rows": _pull_rows,
    "stored_rows": _stored_rows,
    "set_rows": _set_rows,
    "create_key": _create_key,
    "create_keys": _create_keys,
    "create_table": _create_table,
    "delete_key": _delete_key,
    "set": _set,
    "describe": _describe,
    "keys": _keys,
    "key_versions": _key_versions,
    "state_hash": _state_hash,
    "clock_tick": _clock_tick,
    "clocks": _clocks,
    "hyperparams": _hyperparams,
    "membership": membership_rpc,
    "snapshot_step": _snapshot_step,
    "snapshot_status": _snapshot_status,
    "snapshot_catalog": _snapshot_catalog,
    "snapshot_prepare": _snapshot_prepare,
}
