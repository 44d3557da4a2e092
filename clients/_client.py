"""The asyncio client.

Lifecycle: the constructor does no I/O; ``async with`` (or ``open()``) fetches the cluster map;
``aclose()`` closes; a closed client cannot be reopened. Requests are routed by shard to the
leader (or any replica for follower reads), fanned out with ``asyncio.TaskGroup``, and retried on
``RetryableError`` with jittered exponential back-off until the call's deadline. ``NotLeader``
re-routes at once to the hinted leader.

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
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvps.delta import frame
from kvps.delta.xor import apply_xor
from kvps.errors import (
    CodecError, InvalidRequest, KeyNotFound, KvpsError, NotLeader, RetryableError, ShapeMismatch, Timeout,
    Unavailable, error_from_dict,
)
from kvps.initializer import Zeros, initializer_to_dict
from kvps.optimizer import Add, optimizer_to_dict
from kvps.placement import DenseLayout, block_shard, layout_for, row_shards

from ._convert import to_host, to_numpy
from ._hyper import set_hyperparams
from ._lossy import LossyEncoder
from ._rows import RowCache
from ._routing import ClusterMap
from ._transport import HttpTransport, Transport

__all__ = ["Client", "ClientStats", "RetryPolicy"]

DEFAULT_ENDPOINT = "http://127.0.0.1:7100"
CONSISTENCIES = ("leader", "linearizable", "follower")


@dataclass
class ClientStats:
    bytes_sent: int = 0       # request bodies on the wire (after compression)
    bytes_received: int = 0   # response bodies on the wire
    requests: int = 0
    retries: int = 0
    redirects: int = 0        # NotLeader hints followed


@dataclass(frozen=True)
class RetryPolicy:
    base: float = 0.02        # first back-off (s)
    cap: float = 0.25         # longest back-off (s): an election takes ~0.5 s, do not sleep through it
    refresh_every: int = 4    # refetch the cluster map after this many failed attempts on a shard


class Client:
    def __init__(self, endpoints: Iterable[str] | str | None = None, token: str | None = None, *,
                 timeout: float = 30.0, request_timeout: float = 10.0,
                 consistency: str = "leader", codec: str = "none",
                 client_id: str | None = None, transport: Transport | None = None,
                 retry: RetryPolicy = RetryPolicy(), seed: int | None = None,
                 ssl: ssl_.SSLContext | str | None = None, deltas: bool | str = "auto",
                 push_codec: str = "raw", row_cache: bool = True,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
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
        self._transport = transport or HttpTransport(ssl=ssl)
        self._retry = retry
        self._rng = random.Random(seed)
        self._sleep = sleep
        self._state = "unopened"
        self._map: ClusterMap | None = None
        self._infos: dict[str, dict] = {}
        self._cache: dict[str, _DenseCache] = {}
        self._rows: dict[str, RowCache] = {}
        self._seq = 0
        self._waiting: set[int] = set()  # seqs that may still be retried (sets the floor)

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
        await self._transport.open()
        try:
            await self.refresh_map()
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        if self._state == "closed":
            return
        self._state = "closed"
        await self._transport.close()

    @property
    def cluster_map(self) -> ClusterMap:
        if self._map is None:
            raise InvalidRequest("client is not open")
        return self._map

    async def refresh_map(self) -> ClusterMap:
        """Fetch ``/v1/cluster`` from the first endpoint that answers."""
        last: KvpsError | None = None
        known = [u for u in (self._map.admin_urls if self._map is not None else [])
                 if u not in self.endpoints]
        for endpoint in [*self.endpoints, *known]:  # nodes that joined later answer too
            try:
                status, body = await self._transport.request(
                    "GET", endpoint.rstrip("/") + "/v1/cluster", None,
                    headers=self._headers(), timeout=self.request_timeout)
                if status == 200:
                    self._map = ClusterMap.from_json(json.loads(body))
                    return self._map
                last = _error_from_response(status, body)
            except (KvpsError, ValueError) as exc:
                last = exc if isinstance(exc, KvpsError) else Unavailable(str(exc))
        raise Unavailable(f"no endpoint answered with a cluster map: {last}")

    def _deltas_for(self, shard: int) -> bool:
        if self.deltas == "auto":
            return not self.cluster_map.on_loopback(shard)
        return bool(self.deltas)

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    # ---- the one request path ----------------------------------------------------------------

    async def _call(self, shard: int, op: str, meta: dict, arrays=(), *,
                    consistency: str = "leader", codec: str | list[str] | None = None) -> frame.Frame:
        body = frame.encode(frame.KIND_REQUEST, {**meta, "accept_codec": self.codec}, arrays,
                            codec=self.codec if codec is None else codec)
        last: KvpsError | None = None
        attempt = 0
        hops = 0  # hints followed at once since the last back-off (stale hints may point in a loop)
        unreachable, skips, url = None, 0, None  # see _pick
        start = self._rng.randrange(1 << 16)  # each call walks the replicas from its own place
        try:
            async with asyncio.timeout(self.timeout):
                while True:
                    avoid = (unreachable, url) if skips > 0 else ()
                    url, attempt = self._pick(shard, consistency == "follower", start, attempt, avoid)
                    skips -= 1
                    try:
                        return await self._post(url + "/v1/rpc/" + op, body)
                    except NotLeader as exc:
                        last = exc
                        self.stats.redirects += 1
                        hint = exc.fields.get("leader_hint")
                        self.cluster_map.set_leader(shard, hint)
                        # Late in a call too: after a failover the first fresh hint is the news
                        # the client was backing off for.
                        if hint and hint != url and hops < 2:
                            hops += 1
                            attempt += 1
                            continue  # re-route at once
                    except RetryableError as exc:
                        last = exc
                        self.cluster_map.set_leader(shard, None)
                        if exc.fields.get("url"):  # the transport got no answer (see HttpTransport)
                            unreachable, skips = url, len(self.cluster_map.replicas[shard])
                    attempt += 1
                    hops = 0
                    self.stats.retries += 1
                    if attempt % self._retry.refresh_every == 0:
                        await self._try_refresh()
                    await self._sleep(self._backoff(attempt))
        except TimeoutError:
            raise Timeout(f"{op} on shard {shard} did not succeed within {self.timeout}s; "
                          f"last error: {last}", shard=shard, op=op) from None

    def _pick(self, shard: int, follower: bool, start: int, attempt: int,
              avoid: tuple[str | None, ...]) -> tuple[str, int]:
        """The replica to ask next, and the attempt it was picked at: the believed leader, else the
        replicas in turn. ``avoid`` is (a replica that gave no answer at all, the one just asked),
        for a few attempts after the former refused or dropped the connection (a killed leader):
        it is passed over, also when a follower that has not noticed yet hints at it; another
        replica knows the new leader or holds the request until one is elected."""
        url = self.cluster_map.target(shard, any_replica=follower, attempt=start + attempt, rng=self._rng)
        replicas = len(self.cluster_map.replicas[shard])
        if not avoid or url != avoid[0] or replicas < 2:
            return url, attempt
        self.cluster_map.set_leader(shard, None)
        for _ in range(replicas):
            attempt += 1
            url = self.cluster_map.target(shard, any_replica=follower, attempt=start + attempt,
                                          rng=self._rng)
            if url not in avoid:
                break
        return url, attempt

    async def _post(self, url: str, body: bytes) -> frame.Frame:
        self.stats.requests += 1
        self.stats.bytes_sent += len(body)
        # Every attempt has its own id; the server logs it and echoes it, and errors carry it.
        request_id = f"{self.client_id[:12]}-{self.stats.requests}"
        status, data = await self._transport.request(
            "POST", url, body, headers={**self._headers(), "Content-Type": "application/x-kvps-frame",
                                        "X-Request-Id": request_id},
            timeout=self.request_timeout)
        self.stats.bytes_received += len(data)
        if status != 200:
            err = _error_from_response(status, data)
            err.fields.setdefault("request_id", request_id)
            raise err
        return frame.decode(data, max_raw_bytes=1 << 62, kinds=(frame.KIND_RESPONSE,))

    def _backoff(self, attempt: int) -> float:
        ceiling = min(self._retry.cap, self._retry.base * (2 ** min(attempt, 10)))
        return self._rng.uniform(ceiling / 2, ceiling)  # jitter: retries from many workers spread out

    async def _try_refresh(self) -> None:
        try:
            await self.refresh_map()
        except KvpsError:
            pass  # keep routing with the map we have

    async def _fan_out(self, calls: list[Awaitable[Any]]) -> list[Any]:
        if len(calls) == 1:
            return [await calls[0]]
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(c) for c in calls]
        except* KvpsError as group:
            # One shard's definitive answer is the caller's answer: raise it as itself, preferring
            # a rejection (nothing to retry) over a retryable error.
            errors = _leaves(group)
            raise next((e for e in errors if not isinstance(e, RetryableError)), errors[0]) from None
        return [t.result() for t in tasks]

    def _consistency(self, consistency: str | None) -> str:
        c = consistency or self.consistency
        if c not in CONSISTENCIES:
            raise InvalidRequest(f"consistency must be one of {CONSISTENCIES}")
        return c

    # ---- keys --------------------------------------------------------------------------------

    async def create(self, key: str, value: Any, *, optimizer: Any = None, merge: str = "sum",
                     block_bytes: int | None = None) -> None:
        """Create dense ``key`` with an initial value. Creating it again with the same definition
        is a no-op (the stored value is kept); a different definition raises ``KeyExists``."""
        arr = np.ascontiguousarray(to_numpy(await to_host(value, name=key), name=key))
        layout = layout_for(arr.shape, arr.dtype.name, block_bytes or self.cluster_map.block_bytes)
        definition = {"key": key, "shape": list(arr.shape), "dtype": arr.dtype.name,
                      "block_rows": layout.block_rows, "merge": merge,
                      "optimizer": optimizer_to_dict(optimizer or Add())}
        per_shard = self._split_blocks(key, layout, arr)
        calls = []
        for shard, blocks in per_shard.items():
            for chunk in _chunks(blocks, self.cluster_map.max_push_bytes, lambda b: b[1].nbytes):
                meta = {**definition, "blocks": [{"block": b, "array": i} for i, (b, _) in enumerate(chunk)]}
                calls.append(self._call(shard, "create_key", meta, [v for _, v in chunk]))
        await self._fan_out(calls)
        self._infos.pop(key, None)
        self._cache.pop(key, None)

    async def create_table(self, key: str, dim: int, *, dtype: str = "float32", optimizer: Any = None,
                           init: Any = None, merge: str = "sum") -> None:
        """Create an embedding table; rows are created on first push (untouched rows read as
        ``init``'s value, a pure function of (seed, row id))."""
        meta = {"key": key, "dim": int(dim), "dtype": np.dtype(dtype).name, "merge": merge,
                "optimizer": optimizer_to_dict(optimizer or Add()),
                "init": initializer_to_dict(init or Zeros())}
        await self._fan_out([self._call(s, "create_table", meta) for s in range(self.cluster_map.shards)])
        self._infos.pop(key, None)

    async def delete(self, key: str) -> None:
        await self._fan_out([self._call(s, "delete_key", {"key": key})
                             for s in range(self.cluster_map.shards)])
        self._infos.pop(key, None)
        self._cache.pop(key, None)
        self._rows.pop(key, None)
        if self._lossy is not None:
            self._lossy.forget(key)

    async def describe(self, key: str, *, refresh: bool = False) -> dict:
        if refresh or key not in self._infos:
            resp = await self._call(block_shard(key, 0, self.cluster_map.shards), "describe", {"key": key})
            self._infos[key] = resp.meta["info"]
        return self._infos[key]

    async def keys(self) -> list[dict]:
        resps = await self._fan_out([self._call(s, "keys", {}) for s in range(self.cluster_map.shards)])
        merged: dict[str, dict] = {}
        for resp in resps:
            for info in resp.meta["keys"]:
                have = merged.setdefault(info["key"], dict(info))
                if info.get("kind") == "dense" and have is not info:
                    have["blocks"] = sorted(set(have.get("blocks", [])) | set(info.get("blocks", [])))
                elif info.get("kind") == "table":
                    have["rows"] = have.get("rows", 0) + (info.get("rows", 0) if have is not info else 0)
        return [merged[k] for k in sorted(merged)]

    async def _layout(self, key: str) -> tuple[dict, DenseLayout]:
        info = await self.describe(key)
        if info["kind"] != "dense":
            raise InvalidRequest(f"{key!r} is an embedding table: use pull_rows / push_rows", key=key)
        return info, DenseLayout(tuple(info["shape"]), info["dtype"], info["block_rows"])

    def _split_blocks(self, key: str, layout: DenseLayout, arr: np.ndarray) -> dict[int, list]:
        per_shard: dict[int, list] = {}
        for b in range(layout.n_blocks):
            part = arr if arr.ndim == 0 else arr[layout.block_slice(b)]
            per_shard.setdefault(block_shard(key, b, self.cluster_map.shards), []).append((b, part))
        return per_shard

    # ---- dense push / pull -------------------------------------------------------------------

    async def push(self, grads: Mapping[str, Any]) -> dict[str, int]:
        """Push gradients; returns {key: version after this push}. Exactly-once across retries."""
        grads = await to_host(grads)  # CUDA tensors: copied without blocking the event loop
        per_shard: dict[int, list] = {}
        for key, value in grads.items():
            arr = to_numpy(value, name=key)
            info, layout = await self._layout(key)
            _check_shape(key, arr, tuple(info["shape"]), info["dtype"])
            for shard, blocks in self._split_blocks(key, layout, arr).items():
                per_shard.setdefault(shard, []).extend((key, b, part) for b, part in blocks)
        requests, pending = [], []
        for shard, items in per_shard.items():
            for chunk in _chunks(items, self.cluster_map.max_push_bytes, lambda it: it[2].nbytes):
                entries, arrays = [], []
                for key, block, part in chunk:
                    fields, parts = {}, [part]
                    if self._lossy is not None:
                        fields, parts, residual = self._lossy.encode(key, block, part)
                        pending.append(residual)
                    entries.append({"key": key, "block": block, **fields, "array": len(arrays)})
                    if len(parts) == 2:  # top-k: values, then their flat indices
                        entries[-1]["idx"] = len(arrays) + 1
                    arrays += parts
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
            resps = await self._fan_out([
                self._call(shard, "push", {**meta, "client": self.client_id, "seq": seq, "floor": floor},
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
                   min_version: int | Mapping[str, int] | None = None) -> dict[str, np.ndarray]:
        """Current values of ``keys``. Only blocks whose version changed since this client last
        pulled them cross the wire. ``consistency="follower"`` with ``min_version`` reads from any
        replica that has applied at least that version."""
        keys = [keys] if isinstance(keys, str) else list(keys)
        caches = await self._pull_caches(keys, consistency, min_version)
        return {key: caches[key].assemble() for key in keys}

    async def pull_blocks(self, keys: Iterable[str], *, consistency: str | None = None,
                          min_version: int | Mapping[str, int] | None = None,
                          ) -> dict[str, tuple[DenseLayout, list[np.ndarray]]]:
        """``pull`` without assembling: ``{key: (layout, blocks)}``, the blocks read-only arrays
        this client keeps (a caller copying them straight into its own buffers saves a copy)."""
        caches = await self._pull_caches(list(keys), consistency, min_version)
        return {key: (cache.layout, list(cache.blocks)) for key, cache in caches.items()}

    async def _pull_caches(self, keys: list[str], consistency: str | None,
                           min_version: int | Mapping[str, int] | None) -> dict[str, "_DenseCache"]:
        """Bring the caches of ``keys`` up to date. The caches are held here for the whole call:
        a concurrent ``create`` of a key drops it from ``self._cache`` meanwhile."""
        consistency = self._consistency(consistency)
        per_shard: dict[int, list] = {}
        caches: dict[str, _DenseCache] = {}
        for key in keys:
            info, layout = await self._layout(key)
            cache = caches[key] = self._cache.setdefault(key, _DenseCache(layout))
            mv = min_version.get(key, 0) if isinstance(min_version, Mapping) else (min_version or 0)
            by_shard: dict[int, list[int]] = {}
            for b in range(layout.n_blocks):
                by_shard.setdefault(block_shard(key, b, self.cluster_map.shards), []).append(b)
            for shard, blocks in by_shard.items():
                per_shard.setdefault(shard, []).append(
                    {"key": key, "blocks": blocks, "have": [cache.versions[b] for b in blocks],
                     "min_version": int(mv)})
        resps = await self._fan_out([
            self._call(shard, "pull", {"dense": items, "consistency": consistency,
                                       "delta": self._deltas_for(shard)}, consistency=consistency)
            for shard, items in per_shard.items()])
        for resp in resps:
            for entry in resp.meta["blocks"]:
                cache, b = caches[entry["key"]], entry["block"]
                if entry["array"] is not None:
                    value = resp.arrays[entry["array"]]
                    if entry.get("base") is not None:  # exact delta onto the version we hold
                        if cache.versions[b] != entry["base"] or cache.blocks[b] is None:
                            raise CodecError(f"delta for {entry['key']!r} block {b} is against "
                                             f"version {entry['base']}, held {cache.versions[b]}")
                        value = apply_xor(cache.blocks[b], value)
                    cache.blocks[b] = value
                cache.versions[b] = entry["version"]
        return caches

    async def get(self, key: str, *, consistency: str | None = None) -> tuple[np.ndarray, int]:
        """(value, version): the version is the highest block version of ``key``."""
        cache = (await self._pull_caches([key], consistency, None))[key]
        return cache.assemble(), max(cache.versions)

    async def set(self, key: str, value: Any, *, expected_version: int | None = None) -> int:
        """Overwrite ``key``. With ``expected_version``, each block is only written if it is at that
        version (compare-and-set; atomic per block, so use single-block keys for registers)."""
        arr = np.ascontiguousarray(to_numpy(await to_host(value, name=key), name=key))
        info, layout = await self._layout(key)
        _check_shape(key, arr, tuple(info["shape"]), info["dtype"])
        requests = []
        for shard, blocks in self._split_blocks(key, layout, arr).items():
            for chunk in _chunks(blocks, self.cluster_map.max_push_bytes, lambda b: b[1].nbytes):
                requests.append((shard, chunk))
        seqs = [self._next_seq() for _ in requests]
        self._waiting.update(seqs)
        floor = min(self._waiting)
        try:
            resps = await self._fan_out([
                self._call(shard, "set", {"key": key, "client": self.client_id, "seq": seq,
                                          "floor": floor, "expected_version": expected_version,
                                          "blocks": [{"block": b, "array": i}
                                                     for i, (b, _) in enumerate(chunk)]},
                           [v for _, v in chunk])
                for (shard, chunk), seq in zip(requests, seqs)])
        finally:
            self._waiting.difference_update(seqs)
        return max(resp.meta["versions"].get(key, 0) for resp in resps)

    # ---- embedding rows ----------------------------------------------------------------------

    async def pull_rows(self, key: str, ids: Any, *, consistency: str | None = None) -> np.ndarray:
        """Rows ``ids`` of table ``key`` as an array (len(ids), dim); duplicate ids fetched once."""
        info = await self.describe(key)
        if info["kind"] != "table":
            raise InvalidRequest(f"{key!r} is a dense key: use pull", key=key)
        ids = np.asarray(to_numpy(await to_host(ids, name="ids"), name="ids"), dtype=np.int64).ravel()
        unique, inverse = np.unique(ids, return_inverse=True)
        shards = row_shards(key, unique, self.cluster_map.shards)
        consistency = self._consistency(consistency)
        groups = [(int(s), np.flatnonzero(shards == s)) for s in np.unique(shards)]
        if self._row_cache:
            return (await self._pull_rows_incremental(key, info, unique, groups, consistency))[inverse]
        resps = await self._fan_out([
            self._call(s, "pull_rows", {"key": key, "ids": 0, "consistency": consistency},
                       [unique[idx]], consistency=consistency)
            for s, idx in groups])
        out = np.empty((len(unique), info["dim"]), dtype=np.dtype(info["dtype"]))  # (unique, dim)
        for (_, idx), resp in zip(groups, resps):
            out[idx] = resp.arrays[resp.meta["rows"]]
        return out[inverse]

    async def _pull_rows_incremental(self, key: str, info: dict, unique: np.ndarray,
                                     groups: list, consistency: str) -> np.ndarray:
        """Send the versions held; only changed rows come back (ids and versions compressed)."""
        cache = self._rows.setdefault(key, RowCache(info["dim"], np.dtype(info["dtype"])))
        have = cache.have(unique)  # (unique,) -1 where not held
        resps = await self._fan_out([
            self._call(s, "pull_rows", {"key": key, "ids": 0, "have": 1, "consistency": consistency},
                       [unique[idx], have[idx]], consistency=consistency, codec="shuffle-lz4")
            for s, idx in groups])
        for (_, idx), resp in zip(groups, resps):
            changed = resp.arrays[resp.meta["changed"]]  # positions within this group's ids
            cache.update(unique[idx][changed], resp.arrays[resp.meta["versions"]],
                         resp.arrays[resp.meta["rows"]])
        return cache.rows(unique)

    async def push_rows(self, key: str, ids: Any, grads: Any) -> int:
        """Push row gradients; duplicate ids are summed first. Returns the highest row version."""
        info = await self.describe(key)
        if info["kind"] != "table":
            raise InvalidRequest(f"{key!r} is a dense key: use push", key=key)
        host = await to_host({"ids": ids, "grads": grads})
        ids, grads = host["ids"], host["grads"]
        ids = np.asarray(to_numpy(ids, name="ids"), dtype=np.int64).ravel()
        grads = to_numpy(grads, name=key)
        _check_shape(key, grads, (len(ids), info["dim"]), info["dtype"])
        unique, inverse = np.unique(ids, return_inverse=True)
        summed = np.zeros((len(unique), info["dim"]), dtype=grads.dtype)  # (unique, dim)
        np.add.at(summed, inverse, grads)
        shards = row_shards(key, unique, self.cluster_map.shards)
        row_bytes = max(1, summed.itemsize * info["dim"] + 8)
        per_request = max(1, self.cluster_map.max_push_bytes // row_bytes)
        requests = []
        for s in np.unique(shards):
            idx = np.flatnonzero(shards == s)
            for start in range(0, len(idx), per_request):
                part = idx[start:start + per_request]
                fields, parts = ({}, [summed[part]]) if self._lossy is None else \
                    self._lossy.encode(key, -1, summed[part], rows=True)[:2]  # rows keep no residual
                requests.append((int(s), {"rows": [{"key": key, "ids": 0, "grads": 1, **fields}]},
                                 [unique[part], *parts]))
        if not requests:
            return 0
        return (await self._push_requests(requests)).get(key, 0)

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
        resp = await self._call(self._clock_shard(job), "clock_tick",
                                {"job": job, "worker": worker, "step": int(step), "lease_s": float(lease_s)})
        return resp.meta["clocks"]

    async def clocks(self, job: str) -> dict[str, int]:
        """The live clocks of ``job``: ``{worker: completed steps}``, expired workers left out."""
        resp = await self._call(self._clock_shard(job), "clocks", {"job": job})
        return resp.meta["clocks"]


    # ---- whole-model transfer (export / import) -----------------------------------------------

    async def stored_rows(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids sorted, rows) of every row of table ``key`` that has been written."""
        resps = await self._fan_out([self._call(s, "stored_rows", {"key": key})
                                     for s in range(self.cluster_map.shards)])
        info = await self.describe(key)
        ids = np.concatenate([r.arrays[r.meta["ids"]] for r in resps] or [np.empty(0, np.int64)])
        rows = np.concatenate([r.arrays[r.meta["rows"]] for r in resps]
                              or [np.empty((0, info["dim"]), np.dtype(info["dtype"]))])
        order = np.argsort(ids, kind="stable")
        return ids[order], rows[order]

    async def state_dict(self, keys: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        """Every key as arrays: a dense key under its name; a table as ``name`` (its written rows)
        and ``name + ".ids"`` (their ids, int64). Each key is read consistently on its own; keys
        are not read at one instant across shards."""
        infos = {i["key"]: i for i in await self.keys()}
        wanted = sorted(infos) if keys is None else list(keys)
        dense = [k for k in wanted if infos.get(k, {}).get("kind") == "dense"]
        out: dict[str, np.ndarray] = dict(await self.pull(dense)) if dense else {}
        for key in wanted:
            if key not in infos:
                raise KeyNotFound(f"no key {key!r}", key=key)
            if infos[key]["kind"] == "table":
                ids, rows = await self.stored_rows(key)
                out[key], out[key + ".ids"] = rows, ids
        return out

    async def load_state_dict(self, state: Mapping[str, Any], *, optimizer: Any = None,
                              tables: Mapping[str, int] | None = None) -> list[str]:
        """Write ``state`` (as from :meth:`state_dict`): existing dense keys are overwritten with
        ``set``; missing ones are created with ``optimizer`` (default ``Add``). A pair ``name`` /
        ``name.ids`` is a table: missing tables are created (Zeros initializer), and the rows are
        written exactly with ``set_rows``; rows not in the file keep the table's initializer.
        Returns the keys written."""
        infos = {i["key"]: i for i in await self.keys()}
        state = await to_host(dict(state))
        written = []
        for key, value in state.items():
            if key.endswith(".ids") and key[:-4] in state:
                continue
            arr = np.ascontiguousarray(to_numpy(value, name=key))
            if key + ".ids" in state:
                await self._load_table(key, arr, to_numpy(state[key + ".ids"], name=key), infos, optimizer)
            elif key in infos:
                await self.set(key, arr)
            else:
                await self.create(key, arr, optimizer=optimizer)
            written.append(key)
        return written

    async def _load_table(self, key: str, rows: np.ndarray, ids: np.ndarray, infos: dict,
                          optimizer: Any) -> None:
        if key not in infos:
            await self.create_table(key, rows.shape[1], dtype=rows.dtype.name, optimizer=optimizer)
        await self.set_rows(key, ids, rows)

    async def set_rows(self, key: str, ids: Any, values: Any) -> None:
        """Overwrite rows of table ``key`` exactly (created if missing; optimizer state kept)."""
        info = await self.describe(key)
        host = await to_host({"ids": ids, "values": values})
        ids = np.asarray(to_numpy(host["ids"], name="ids"), dtype=np.int64).ravel()
        values = np.ascontiguousarray(to_numpy(host["values"], name=key))
        _check_shape(key, values, (len(ids), info["dim"]), info["dtype"])
        unique, first = np.unique(ids[::-1], return_index=True)    # the last write of an id wins
        values = values[::-1][first]
        shards = row_shards(key, unique, self.cluster_map.shards)
        per_request = max(1, self.cluster_map.max_push_bytes // max(1, values.itemsize * info["dim"] + 8))
        calls = []
        for s in np.unique(shards):
            idx = np.flatnonzero(shards == s)
            for start in range(0, len(idx), per_request):
                part = idx[start:start + per_request]
                calls.append(self._call(int(s), "set_rows", {"key": key, "ids": 0, "rows": 1},
                                        [unique[part], values[part]]))
        await self._fan_out(calls)
        self._rows.pop(key, None)


class _DenseCache:
    """The blocks of one dense key this client holds, with their versions (for incremental pulls)."""

    def __init__(self, layout: DenseLayout) -> None:
        self.layout = layout
        self.blocks: list[np.ndarray | None] = [None] * layout.n_blocks
        self.versions: list[int | None] = [None] * layout.n_blocks

    def assemble(self) -> np.ndarray:
        out = np.empty(self.layout.shape, dtype=np.dtype(self.layout.dtype))
        if out.ndim == 0:
            out[()] = self.blocks[0]
            return out
        for b, block in enumerate(self.blocks):
            out[self.layout.block_slice(b)] = block
        return out


def _check_shape(key: str, arr: np.ndarray, shape: tuple, dtype: str) -> None:
    if tuple(arr.shape) != tuple(shape) or arr.dtype != np.dtype(dtype):
        raise ShapeMismatch(key, {"shape": list(shape), "dtype": str(dtype)},
                            {"shape": list(arr.shape), "dtype": arr.dtype.name})


def _chunks(items: list, limit: int, size: Callable[[Any], int]) -> list[list]:
    """Split ``items`` into consecutive chunks of at most ``limit`` bytes (at least one item each)."""
    chunks: list[list] = [[]]
    total = 0
    for item in items:
        n = size(item)
        if chunks[-1] and total + n > limit:
            chunks.append([])
            total = 0
        chunks[-1].append(item)
        total += n
    return [c for c in chunks if c]


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


def _error_from_response(status: int, body: bytes) -> KvpsError:
    try:
        return error_from_dict(json.loads(body))
    except ValueError:
        if status in (502, 503, 504):
            return Unavailable(f"HTTP {status}")
        return Unavailable(f"HTTP {status}: {body[:200]!r}")
