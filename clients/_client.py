"""The asyncio client.

Lifecycle: the constructor does no I/O; ``async with`` (or ``open()``) fetches the cluster map;
``aclose()`` closes; a closed client cannot be reopened. This module is the public API: it
turns keys, blocks and rows into per-shard requests. How a request reaches the shard's leader
(hints, retries with back-off, one send) is ``_sender``; dense blocks and chunking ``_dense``;
whole-model transfer ``_transfer``. Past the house's ~450 lines on purpose: every public call
in one class, each a few lines; what they share lives in the modules named here.

Exactly-once pushes: every push request to a shard carries ``(client_id, seq, floor)``; retries
reuse the same bytes, so a push whose reply was lost is answered from the shard's applied table
instead of being applied again. ``floor`` is the lowest seq this client may still retry.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import ssl as ssl_
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

import numpy as np

from kvps.command import MAX_BATCH_KEYS
from kvps.delta import frame
from kvps.delta.pack import PACK_MAX_BYTES, pack_into, unpack
from kvps.delta.xor import apply_xor
from kvps.errors import (
    CodecError, InvalidRequest, KvpsError, RejectedError, Unavailable, VersionNotIssued, error_from_dict,
)
from kvps.initializer import Zeros, initializer_to_dict
from kvps.optimizer import Add, clipped, optimizer_to_dict
from kvps.placement import DenseLayout, block_shard, dtype_name, layout_for

from . import _table_rows, _transfer
from ._convert import check_shape, to_host, to_numpy, writable_view
from ._dense import DenseCache, chunks, create_keys_request, key_batches, split_blocks
from ._hyper import set_hyperparams
from ._lossy import LossyEncoder
from ._rows import RowCache
from ._routing import ClusterMap
from ._shm import SharedPulls
from ._sender import ClientStats, RetryPolicy, Sender, error_from_response
from ._transport import HttpTransport, Transport
from ._wire import WireTransport

__all__ = ["Client", "ClientStats", "RetryPolicy"]

DEFAULT_ENDPOINT = "http://127.0.0.1:7100"
CONSISTENCIES = ("leader", "linearizable", "follower")


def _min_version(min_version: int | Mapping[str, int] | None, key: str) -> int:
    return int(min_version.get(key, 0) if isinstance(min_version, Mapping) else (min_version or 0))


class Client:
    def __init__(self, endpoints: Iterable[str] | str | None = None, token: str | None = None, *,
                 timeout: float = 30.0, request_timeout: float = 10.0,
                 consistency: str = "leader", codec: str = "none",
                 client_id: str | None = None, transport: Transport | None = None,
                 retry: RetryPolicy = RetryPolicy(), seed: int | None = None,
                 ssl: ssl_.SSLContext | str | None = None, deltas: bool | str = "auto",
                 push_codec: str = "raw", row_cache: bool = True, wire: bool | None = None,
                 shm: bool = True, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        if endpoints is None:
            endpoints = os.environ.get("KVPS_ENDPOINT", DEFAULT_ENDPOINT)
        self.endpoints = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        self.token = token if token is not None else os.environ.get("KVPS_TOKEN", "")
        if consistency not in CONSISTENCIES:
            raise InvalidRequest(f"consistency must be one of {CONSISTENCIES}")
        self.timeout = timeout
        self.request_timeout = request_timeout
        self.consistency = consistency
        self.codec = codec              # request bodies, and full blocks in pull replies
        if deltas not in (True, False, "auto"):
            raise InvalidRequest("deltas must be True, False or 'auto'")
        # Ask for exact XOR deltas of blocks this client holds. "auto": not from replicas on this
        # host, where sending a block costs less CPU than XOR + shuffle + lz4 on both ends.
        self.deltas = deltas
        self._lossy = LossyEncoder(push_codec) if push_codec != "raw" else None
        self._row_cache = row_cache     # hold pulled rows, pull only rows whose version changed
        self.client_id = client_id or uuid.uuid4().hex
        self.stats = ClientStats()
        if isinstance(ssl, str):  # a CA file that signed the cluster's certificate
            ssl = ssl_.create_default_context(cafile=ssl)
        self._state = "unopened"
        self._map: ClusterMap | None = None
        self.sender = Sender(transport=transport or HttpTransport(ssl=ssl), client_id=self.client_id,
                             token=self.token, timeout=timeout, request_timeout=request_timeout,
                             retry=retry, rng=random.Random(seed), sleep=sleep, stats=self.stats,
                             cluster_map=lambda: self.cluster_map, refresh_map=self.refresh_map,
                             # the nodes' binary data plane where they serve one. wire=False: every
                             # call through ``transport`` (HTTP); the default when one is given
                             # (shm: bodies to nodes on this host through a push ring)
                             wire=WireTransport(self.token, ssl=ssl, ring=shm)
                             if (transport is None if wire is None else wire) else None)
        self._infos: dict[str, dict] = {}
        self._layouts: dict[str, tuple[dict, DenseLayout]] = {}  # key -> (the info it came from, layout)
        self._cache: dict[str, DenseCache] = {}
        self._rows: dict[str, RowCache] = {}
        self._seq = 0
        self._waiting: set[int] = set()  # seqs that may still be retried (sets the floor)
        # pulls from same-host leaders' shared-memory mirrors (shm=False: TCP only)
        self.shared = SharedPulls(shm)

    # ---- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> "Client":
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def open(self) -> None:
        if self._state != "unopened":
            raise InvalidRequest(f"client is {self._state}; create a new one")
        self._state = "opened"
        await self.sender.transport.open()
        try:
            await self.refresh_map()
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        if self._state == "closed":
            return
        self._state = "closed"
        self.shared.close()
        if self.sender.wire is not None:
            await self.sender.wire.close()
        await self.sender.transport.close()

    @property
    def cluster_map(self) -> ClusterMap:
        if self._map is None:
            raise InvalidRequest("client is not open")
        return self._map

    async def refresh_map(self) -> ClusterMap:
        """Fetch ``/v1/cluster`` from the first endpoint that answers; a refusal (a bad token:
        ``Unauthorized``, ``Forbidden``) is raised as itself."""
        last: KvpsError | None = None
        known = [u for u in (self._map.admin_urls if self._map is not None else [])
                 if u not in self.endpoints]
        for endpoint in [*self.endpoints, *known]:  # nodes that joined later answer too
            try:
                status, body = await self.sender.transport.request(
                    "GET", endpoint.rstrip("/") + "/v1/cluster", None,
                    headers=self.sender.headers(), timeout=self.request_timeout)
                if status == 200:
                    self._map = ClusterMap.from_json(json.loads(body))
                    return self._map
                last = error_from_response(status, body)
            except (KvpsError, ValueError) as exc:
                last = exc if isinstance(exc, KvpsError) else Unavailable(str(exc))
        if isinstance(last, RejectedError):
            raise last
        raise Unavailable(f"no endpoint answered with a cluster map: {last}")

    def _deltas_for(self, shard: int) -> bool:
        if self.deltas == "auto":
            return not self.cluster_map.on_loopback(shard)
        return bool(self.deltas)

    @property
    def _transport(self) -> Transport:
        return self.sender.transport

    # ---- the one request path (see _sender) --------------------------------------------------

    def call(self, shard: int, op: str, meta: dict, arrays=(), *, consistency: str = "leader",
             codec: str | list[str] | None = None) -> Awaitable[frame.Frame]:
        """``op`` on ``shard``'s leader (any replica for follower reads), retried until the call's
        deadline; the building block of every method here, and of kvps's own tools."""
        return self.sender.call(shard, op, meta, arrays, consistency=consistency, accept_codec=self.codec,
                                codec=self.codec if codec is None else codec)

    def _consistency(self, consistency: str | None) -> str:
        c = consistency or self.consistency
        if c not in CONSISTENCIES:
            raise InvalidRequest(f"consistency must be one of {CONSISTENCIES}")
        return c

    # ---- keys --------------------------------------------------------------------------------

    async def create(self, key: str, value: Any, *, optimizer: Any = None, merge: str = "sum",
                     block_bytes: int | None = None, clip_norm: float | None = None) -> None:
        """Create dense ``key`` with an initial value. Creating it again with the same definition
        is a no-op (the value is kept); else ``KeyExists``. ``clip_norm``: a per-block bound."""
        arr = np.ascontiguousarray(to_numpy(await to_host(value, name=key), name=key))
        layout = layout_for(arr.shape, arr.dtype.name, block_bytes or self.cluster_map.block_bytes)
        definition = {"key": key, "shape": list(arr.shape), "dtype": arr.dtype.name,
                      "block_rows": layout.block_rows, "merge": merge,
                      "optimizer": optimizer_to_dict(clipped(optimizer or Add(), clip_norm))}
        per_shard = self._split_blocks(key, layout, arr)
        calls = []
        for shard, blocks in per_shard.items():
            for chunk in chunks(blocks, self.cluster_map.max_push_bytes, lambda b: b[1].nbytes):
                meta = {**definition, "blocks": [{"block": b, "array": i} for i, (b, _) in enumerate(chunk)]}
                calls.append(self.call(shard, "create_key", meta, [v for _, v in chunk]))
        await self.sender.fan_out(calls)
        self._infos.pop(key, None)
        self._cache.pop(key, None)

    async def create_many(self, values: Mapping[str, Any], *, optimizer: Any = None, merge: str = "sum",
                          block_bytes: int | None = None, clip_norm: float | None = None) -> None:
        """``create`` for many dense keys at once, each with the same options: per shard, the keys'
        blocks go into as few Raft entries as the request-size cap allows (up to 4,096 keys
        each) instead of one entry per key, so 10,000 small keys take one round trip per shard.
        Each key follows ``create``'s rules; a refused key (``KeyExists``) does not stop the
        others, and the first refusal is raised once all are done."""
        opt = optimizer_to_dict(clipped(optimizer or Add(), clip_norm))
        per_shard: dict[int, list[tuple[dict, list]]] = {}
        for key, value in (await to_host(dict(values))).items():
            arr = np.ascontiguousarray(to_numpy(value, name=key))
            dtype = dtype_name(arr.dtype)
            layout = layout_for(arr.shape, dtype, block_bytes or self.cluster_map.block_bytes)
            definition = {"key": key, "shape": list(arr.shape), "dtype": dtype,
                          "block_rows": layout.block_rows, "merge": merge, "optimizer": opt}
            for shard, blocks in self._split_blocks(key, layout, arr).items():
                for part in chunks(blocks, self.cluster_map.max_push_bytes, lambda b: b[1].nbytes):
                    per_shard.setdefault(shard, []).append((definition, part))
        calls = [self.call(shard, "create_keys", *create_keys_request(batch))
                 for shard, items in per_shard.items()
                 for batch in key_batches(items, self.cluster_map.max_push_bytes)]
        resps = await self.sender.fan_out(calls)
        for key in values:
            self._infos.pop(key, None)
            self._cache.pop(key, None)
        refused = [r for resp in resps for r in resp.meta["results"] if "error" in r]
        if refused:
            raise error_from_dict(refused[0])

    async def create_table(self, key: str, dim: int, *, dtype: str = "float32", optimizer: Any = None,
                           init: Any = None, merge: str = "sum", clip_norm: float | None = None,
                           max_rows: int | None = None, evict: str = "lru", ttl_s: float | None = None,
                           admit: Any = None) -> None:
        """Create an embedding table; rows are created on first push (untouched rows read as ``init``'s
        value, a pure function of (seed, row id)). ``clip_norm``: per-row bound; the lifecycle
        options: README, "Row lifecycle"."""
        meta = {"key": key, "dim": int(dim), "dtype": np.dtype(dtype).name, "merge": merge,
                "optimizer": optimizer_to_dict(clipped(optimizer or Add(), clip_norm)),
                "init": initializer_to_dict(init or Zeros()),
                **_table_rows.table_lifecycle(max_rows, evict, ttl_s, admit, self.cluster_map.shards)}
        await self.sender.fan_out([self.call(s, "create_table", meta) for s in range(self.cluster_map.shards)])
        self._infos.pop(key, None)

    async def delete(self, key: str) -> None:
        await self.sender.fan_out([self.call(s, "delete_key", {"key": key})
                             for s in range(self.cluster_map.shards)])
        self._infos.pop(key, None)
        self._cache.pop(key, None)
        self._rows.pop(key, None)
        self._layouts.pop(key, None)
        if self._lossy is not None:
            self._lossy.forget(key)

    async def _describe_many(self, keys: Iterable[str]) -> None:
        """Fetch the infos of ``keys`` not yet known: one request per shard, not one per key."""
        missing = [k for k in dict.fromkeys(keys) if k not in self._infos]
        if len(missing) <= 1:
            for key in missing:
                await self.describe(key)
            return
        per_shard: dict[int, list[str]] = {}
        for key in missing:
            per_shard.setdefault(block_shard(key, 0, self.cluster_map.shards), []).append(key)
        batches = [(shard, ks[i:i + MAX_BATCH_KEYS]) for shard, ks in per_shard.items()
                   for i in range(0, len(ks), MAX_BATCH_KEYS)]
        resps = await self.sender.fan_out([self.call(shard, "describe", {"keys": batch})
                                           for shard, batch in batches])
        for (_, batch), resp in zip(batches, resps):
            self._infos.update(zip(batch, resp.meta["infos"]))

    async def describe(self, key: str, *, refresh: bool = False) -> dict:
        if refresh or key not in self._infos:
            resp = await self.call(block_shard(key, 0, self.cluster_map.shards), "describe", {"key": key})
            self._infos[key] = resp.meta["info"]
        return self._infos[key]

    async def keys(self) -> list[dict]:
        """Every key's info, the shards' answers merged (``_transfer.merge_key_infos``)."""
        shards = range(self.cluster_map.shards)
        return _transfer.merge_key_infos(await self.sender.fan_out([self.call(s, "keys", {}) for s in shards]))

    async def _layout(self, key: str) -> tuple[dict, DenseLayout]:
        info = await self.describe(key)
        known = self._layouts.get(key)
        if known is not None and known[0] is info:  # built from this very info
            return known
        if info["kind"] != "dense":
            raise InvalidRequest(f"{key!r} is an embedding table: use pull_rows / push_rows", key=key)
        self._layouts[key] = known = (info, DenseLayout(tuple(info["shape"]), info["dtype"], info["block_rows"]))
        return known

    def _split_blocks(self, key: str, layout: DenseLayout, arr: np.ndarray) -> dict[int, list]:
        return split_blocks(key, layout, arr, self.cluster_map.shards)

    # ---- dense push / pull -------------------------------------------------------------------

    async def push(self, grads: Mapping[str, Any]) -> dict[str, int]:
        """Push gradients; returns {key: version after this push}. Exactly-once across retries."""
        grads = await to_host(grads)  # CUDA tensors: copied without blocking the event loop
        await self._describe_many(grads)
        per_shard: dict[int, list] = {}
        for key, value in grads.items():
            arr = to_numpy(value, name=key)
            info, layout = await self._layout(key)
            check_shape(key, arr, tuple(info["shape"]), info["dtype"])
            for shard, blocks in self._split_blocks(key, layout, arr).items():
                per_shard.setdefault(shard, []).extend((key, b, part) for b, part in blocks)
        requests, pending = [], []
        for shard, items in per_shard.items():
            for chunk in chunks(items, self.cluster_map.max_push_bytes, lambda it: it[2].nbytes):
                entries, arrays = [], []
                small, small_values = [], []  # raw gradients small enough to pack (kvps.delta.pack)
                for key, block, part in chunk:
                    if self._lossy is None and part.nbytes <= PACK_MAX_BYTES:
                        entries.append({"key": key, "block": block})
                        small.append(entries[-1])
                        small_values.append(part)
                        continue
                    fields, parts = {}, [part]
                    if self._lossy is not None:
                        fields, parts, residual = self._lossy.encode(key, block, part)
                        pending.append(residual)
                    entries.append({"key": key, "block": block, **fields, "array": len(arrays)})
                    if len(parts) == 2:  # top-k: values, then their flat indices
                        entries[-1]["idx"] = len(arrays) + 1
                    arrays += parts
                pack_into(small, small_values, arrays)
                requests.append((shard, {"dense": entries}, arrays))
        if self._lossy is None:
            return await self._push_requests(requests)
        try:  # error feedback: a residual counts once its push is acknowledged
            versions = await self._push_requests(requests)
        except BaseException:
            self._lossy.abandon(pending)
            raise
        self._lossy.commit(pending)
        return versions

    async def _push_requests(self, requests: list[tuple[int, dict, list]]) -> dict[str, int]:
        seqs = [self._next_seq() for _ in requests]
        self._waiting.update(seqs)
        floor = min(self._waiting)
        try:
            resps = await self.sender.fan_out([
                self.call(shard, "push", {**meta, "client": self.client_id, "seq": seq, "floor": floor},
                           arrays)
                for (shard, meta, arrays), seq in zip(requests, seqs)])
        finally:
            self._waiting.difference_update(seqs)
        versions: dict[str, int] = {}
        for resp in resps:
            for key, v in resp.meta["versions"].items():
                versions[key] = max(v, versions.get(key, v))
        return versions

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    async def pull(self, keys: Iterable[str] | str, *, consistency: str | None = None,
                   min_version: int | Mapping[str, int] | None = None,
                   out: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Current values of ``keys``. Only blocks whose version changed since this client last
        pulled them cross the wire. ``consistency="follower"`` with ``min_version`` (a version
        ``push`` or ``set`` returned) reads from any replica that has applied it: on each shard,
        the shard's own version of the key as a push there returned it, or all the shard's leader
        has where that is lower (the version came from another shard). ``VersionNotIssued`` at
        once if no shard has issued it.

        ``out``: ``{key: array}`` (numpy arrays or CPU tensors of the key's shape and dtype) to
        write those keys' values into, straight from the received blocks, instead of into new
        arrays; the result then holds the given objects for them. Checked before anything is
        sent: nothing is written unless every target fits."""
        keys = [keys] if isinstance(keys, str) else list(keys)
        targets = await self._pull_targets(keys, out) if out else {}
        caches = await self._pull_caches(keys, consistency, min_version)
        result: dict[str, Any] = {}
        for key in keys:
            if key in targets:
                caches[key].assemble(out=targets[key])
                result[key] = out[key]  # type: ignore[index]
            else:
                result[key] = caches[key].assemble()
        return result

    async def _pull_targets(self, keys: list[str], out: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """``out``'s values as writable numpy views, each checked against its key."""
        if stray := sorted(set(out) - set(keys)):
            raise InvalidRequest(f"out names keys not pulled: {stray[:5]}", field="out")
        await self._describe_many(list(out))
        targets = {}
        for key, target in out.items():
            info, _ = await self._layout(key)
            arr = writable_view(target, name=key)
            check_shape(key, arr, tuple(info["shape"]), info["dtype"])
            targets[key] = arr
        return targets

    async def pull_blocks(self, keys: Iterable[str], *, consistency: str | None = None,
                          min_version: int | Mapping[str, int] | None = None,
                          ) -> dict[str, tuple[DenseLayout, list[np.ndarray]]]:
        """``pull`` without assembling: ``{key: (layout, blocks)}``, the blocks read-only arrays
        this client keeps (a caller copying them straight into its own buffers saves a copy)."""
        caches = await self._pull_caches(list(keys), consistency, min_version)
        return {key: (cache.layout, list(cache.blocks)) for key, cache in caches.items()}

    async def _pull_caches(self, keys: list[str], consistency: str | None,
                           min_version: int | Mapping[str, int] | None) -> dict[str, DenseCache]:
        """Bring the caches of ``keys`` up to date. The caches are held here for the whole call:
        a concurrent ``create`` of a key drops it from ``self._cache`` meanwhile."""
        consistency = self._consistency(consistency)
        await self._describe_many(keys)
        per_shard: dict[int, list] = {}
        caches: dict[str, DenseCache] = {}
        for key in keys:
            info, layout = await self._layout(key)
            cache = caches[key] = self._cache.setdefault(key, DenseCache(layout))
            mv = _min_version(min_version, key)
            by_shard: dict[int, list[int]] = {}
            for b in range(layout.n_blocks):
                by_shard.setdefault(block_shard(key, b, self.cluster_map.shards), []).append(b)
            for shard, blocks in by_shard.items():
                per_shard.setdefault(shard, []).append(
                    {"key": key, "blocks": blocks, "have": [cache.versions[b] for b in blocks],
                     "min_version": int(mv)})
        mirrored = {shard: self.shared.wanted(shard, self.cluster_map.on_loopback(shard), consistency)
                    for shard in per_shard}
        if not min_version:  # a min_version pull asks every shard whether it issued the version
            for shard in [s for s, m in mirrored.items() if m]:
                if self.shared.read(shard, per_shard[shard], caches):
                    del per_shard[shard]
        resps = await self.sender.fan_out([
            self.call(shard, "pull", {"dense": items, "consistency": consistency, "packed": True,
                                       "delta": self._deltas_for(shard),
                                       **({"mirror": True} if mirrored[shard] else {})},
                      consistency=consistency)
            for shard, items in per_shard.items()])
        for shard, resp in zip(per_shard, resps):
            if mirrored[shard]:
                self.shared.learn(shard, resp.meta)
        if min_version:  # every shard holding blocks of the key was asked
            asked: dict[str, list[int | None]] = {}
            for resp, items in zip(resps, per_shard.values()):
                short = resp.meta.get("short", {})
                for it in items:
                    asked.setdefault(it["key"], []).append(short.get(it["key"]))
            for key in keys:
                await self._check_issued(key, _min_version(min_version, key), asked.get(key, []))
        for resp in resps:
            for entry in resp.meta["blocks"]:
                cache, b = caches[entry["key"]], entry["block"]
                if "packed" in entry:
                    cache.blocks[b] = unpack(resp.arrays, entry)
                elif entry["array"] is not None:
                    value = resp.arrays[entry["array"]]
                    if entry.get("base") is not None:  # exact delta onto the version we hold
                        if cache.versions[b] != entry["base"] or cache.blocks[b] is None:
                            raise CodecError(f"delta for {entry['key']!r} block {b} is against "
                                             f"version {entry['base']}, held {cache.versions[b]}")
                        value = apply_xor(cache.blocks[b], value)
                    cache.blocks[b] = value
                cache.versions[b] = entry["version"]
        return caches

    async def _check_issued(self, key: str, min_version: int, short: list[int | None],
                            others: Iterable[int] = ()) -> None:
        """``VersionNotIssued`` if no shard of ``key`` has issued ``min_version``. ``short``: per
        shard asked, its leader's version if below ``min_version``, else None; ``others``: shards
        of the key not asked (a row pull's), asked now only if every shard asked fell short."""
        if not min_version or not short or any(v is None for v in short):
            return
        latest = max(short)
        for resp in await self.sender.fan_out([self.call(s, "describe", {"key": key}) for s in others]):
            latest = max(latest, resp.meta["info"]["version"])
        if latest < min_version:
            raise VersionNotIssued(key, min_version, latest)

    async def get(self, key: str, *, consistency: str | None = None) -> tuple[np.ndarray, int]:
        """(value, version): the version is the highest block version of ``key``."""
        cache = (await self._pull_caches([key], consistency, None))[key]
        return cache.assemble(), max(cache.versions)

    async def set(self, key: str, value: Any, *, expected_version: int | None = None) -> int:
        """Overwrite ``key``. With ``expected_version``, each block is only written if it is at that
        version (compare-and-set; atomic per block, so use single-block keys for registers)."""
        arr = np.ascontiguousarray(to_numpy(await to_host(value, name=key), name=key))
        info, layout = await self._layout(key)
        check_shape(key, arr, tuple(info["shape"]), info["dtype"])
        requests = []
        for shard, blocks in self._split_blocks(key, layout, arr).items():
            for chunk in chunks(blocks, self.cluster_map.max_push_bytes, lambda b: b[1].nbytes):
                requests.append((shard, chunk))
        seqs = [self._next_seq() for _ in requests]
        self._waiting.update(seqs)
        floor = min(self._waiting)
        try:
            resps = await self.sender.fan_out([
                self.call(shard, "set", {"key": key, "client": self.client_id, "seq": seq,
                                          "floor": floor, "expected_version": expected_version,
                                          "blocks": [{"block": b, "array": i}
                                                     for i, (b, _) in enumerate(chunk)]},
                           [v for _, v in chunk])
                for (shard, chunk), seq in zip(requests, seqs)])
        finally:
            self._waiting.difference_update(seqs)
        return max(resp.meta["versions"].get(key, 0) for resp in resps)

    # ---- embedding rows (see _table_rows) ----------------------------------------------------

    async def pull_rows(self, key: str, ids: Any, *, consistency: str | None = None,
                        min_version: int | None = None) -> np.ndarray:
        """Rows ``ids`` of table ``key`` as an array (len(ids), dim); duplicate ids fetched once,
        and with the row cache only rows whose version changed cross the wire. ``min_version``
        (from ``push_rows``) with ``consistency="follower"``: as in ``pull``."""
        return await _table_rows.pull_rows(self, key, ids, self._consistency(consistency), int(min_version or 0))

    async def push_rows(self, key: str, ids: Any, grads: Any) -> int:
        """Push row gradients; duplicate ids are summed first. Returns the highest row version."""
        return await _table_rows.push_rows(self, key, ids, grads)

    async def set_rows(self, key: str, ids: Any, values: Any) -> None:
        """Overwrite rows of table ``key`` exactly (created if missing; optimizer state kept)."""
        await _table_rows.set_rows(self, key, ids, values)

    async def set_hyperparams(self, key: str, values: Mapping[str, Any], *, step: int) -> dict:
        """Change ``key``'s schedulable optimizer fields (``lr``, ``momentum``, ``betas``, ...) as
        of worker ``step``; an older step than the key's last one is ignored (see ``_hyper``)."""
        return await set_hyperparams(self, key, values, step=step)

    # ---- worker clocks (bounded-staleness and synchronous training; see StepClock) -----------

    def _clock_shard(self, job: str) -> int:
        return block_shard("__clock/" + job, 0, self.cluster_map.shards)

    async def clock_tick(self, job: str, worker: str, step: int, *, lease_s: float) -> dict[str, int]:
        """Record that ``worker`` of ``job`` has completed ``step`` steps; the clock lives
        ``lease_s`` seconds unless renewed (0 removes the worker). Returns the job's live clocks
        ``{worker: step}``. Safe to retry: steps never go back while the lease lives."""
        resp = await self.call(self._clock_shard(job), "clock_tick",
                                {"job": job, "worker": worker, "step": int(step), "lease_s": float(lease_s)})
        return resp.meta["clocks"]

    async def clocks(self, job: str) -> dict[str, int]:
        """The live clocks of ``job``: ``{worker: completed steps}``, expired workers left out."""
        resp = await self.call(self._clock_shard(job), "clocks", {"job": job})
        return resp.meta["clocks"]

    # ---- whole-model transfer (export / import; see _transfer) -------------------------------

    async def stored_rows(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids sorted, rows) of every row of table ``key`` that has been written."""
        return await _transfer.stored_rows(self, key)

    async def state_dict(self, keys: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        """Every key as arrays (a table as ``name`` and ``name + ".ids"``); see ``_transfer``."""
        return await _transfer.state_dict(self, keys)

    async def load_state_dict(self, state: Mapping[str, Any], *, optimizer: Any = None) -> list[str]:
        """Write ``state`` as from :meth:`state_dict`, creating missing keys with ``optimizer``;
        returns the keys written (see ``_transfer``)."""
        return await _transfer.load_state_dict(self, state, optimizer=optimizer)
