"""The client's request path, as a chain of small steps (the way httpx's client sends):

    call          one deadline for the whole call; the frame is encoded once (its parts, not
                  joined: ``Body``), retries reuse it
    _retrying     on a RetryableError: jittered exponential back-off, refetch the map now and then
    _hinted       on NotLeader with a fresh hint: re-route at once (twice at most: stale hints loop)
    send_once     one exchange with one replica, on its node's wire connection when the map names
                  one (``WireTransport``), else over HTTP; a kvps error in the reply is raised
                  as itself

Where each attempt goes is ``Route``'s business (the believed leader, else the replicas in turn,
passing over one that gave no answer at all). ``fan_out`` runs one call per shard concurrently.
"""
from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kvps.delta import frame
from kvps.errors import ConnectError, KvpsError, NotLeader, RetryableError, Timeout, Unavailable, error_from_dict

from ._routing import ClusterMap
from ._transport import Body, Transport
from ._wire import WireTransport

__all__ = ["ClientStats", "RetryPolicy", "Route", "Sender", "error_from_response"]


@dataclass
class ClientStats:
    bytes_sent: int = 0       # request bodies (after compression), also those a push ring carried
    bytes_received: int = 0   # response bodies on the wire
    requests: int = 0
    wire_requests: int = 0    # of those, sent on a node's wire connection (the rest: HTTP)
    retries: int = 0
    redirects: int = 0        # NotLeader hints followed


@dataclass(frozen=True)
class RetryPolicy:
    base: float = 0.02        # first back-off (s)
    cap: float = 0.25         # longest back-off (s): an election takes ~0.5 s, do not sleep through it
    refresh_every: int = 4    # refetch the cluster map after this many failed attempts on a shard


class Route:
    """Where one call's attempts go. Each call walks a shard's replicas from its own place; the
    believed leader first. After a replica gave no answer at all (a killed leader), it and the
    replica just asked are passed over for a round, also when a follower that has not noticed yet
    hints at it: another replica knows the new leader or holds the request until one is elected."""

    def __init__(self, cluster_map: ClusterMap, shard: int, *, follower: bool, rng: random.Random) -> None:
        self.map, self.shard, self.follower, self._rng = cluster_map, shard, follower, rng
        self.start = rng.randrange(1 << 16)
        self.attempt = 0
        self.url: str | None = None
        self.last: KvpsError | None = None  # the latest error, for the Timeout's message
        self._unreachable: str | None = None
        self._skips = 0

    def next_url(self) -> str:
        avoid = (self._unreachable, self.url) if self._skips > 0 else ()
        self._skips -= 1
        url = self._target()
        replicas = len(self.map.replicas[self.shard])
        if avoid and url == avoid[0] and replicas >= 2:
            self.map.set_leader(self.shard, None)
            for _ in range(replicas):
                self.attempt += 1
                url = self._target()
                if url not in avoid:
                    break
        self.url = url
        return url

    def _target(self) -> str:
        return self.map.target(self.shard, any_replica=self.follower, attempt=self.start + self.attempt,
                               rng=self._rng)

    def follow(self, hint: str | None) -> None:
        self.map.set_leader(self.shard, hint)

    def lost_leader(self, *, unreachable: bool) -> None:
        self.map.set_leader(self.shard, None)
        if unreachable:
            self._unreachable, self._skips = self.url, len(self.map.replicas[self.shard])


class Sender:
    """Sends frames to replicas for one client: holds its transport, map, retry policy and stats.
    ``cluster_map`` and ``refresh_map`` are the client's (the map is refetched through it)."""

    def __init__(self, *, transport: Transport, client_id: str, token: str, timeout: float,
                 request_timeout: float, retry: RetryPolicy, rng: random.Random,
                 sleep: Callable[[float], Awaitable[None]], stats: ClientStats,
                 cluster_map: Callable[[], ClusterMap], refresh_map: Callable[[], Awaitable[Any]],
                 wire: WireTransport | None = None) -> None:
        self.transport = transport
        self.wire = wire
        self.client_id = client_id
        self.token = token
        self.timeout = timeout
        self.request_timeout = request_timeout
        self.stats = stats
        self._retry = retry
        self._rng = rng
        self._sleep = sleep
        self._map = cluster_map
        self._refresh_map = refresh_map

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    async def call(self, shard: int, op: str, meta: dict, arrays=(), *, accept_codec: str,
                   codec: str | list[str], consistency: str = "leader") -> frame.Frame:
        """``op`` on ``shard`` until it succeeds, a replica rejects it, or the deadline passes."""
        body = Body(frame.encode_parts(frame.KIND_REQUEST, {**meta, "accept_codec": accept_codec}, arrays,
                                       codec=codec))
        route = Route(self._map(), shard, follower=consistency == "follower", rng=self._rng)
        try:
            async with asyncio.timeout(self.timeout):
                return await self._retrying(route, op, body)
        except TimeoutError:
            raise Timeout(f"{op} on shard {shard} did not succeed within {self.timeout}s; "
                          f"last error: {route.last}", shard=shard, op=op) from None

    async def _retrying(self, route: Route, op: str, body: Body) -> frame.Frame:
        while True:
            try:
                return await self._hinted(route, op, body)
            except RetryableError as exc:
                route.last = exc
                if not isinstance(exc, NotLeader):  # the hint, if any, is already followed
                    route.lost_leader(unreachable=isinstance(exc, ConnectError))
            route.attempt += 1
            self.stats.retries += 1
            if route.attempt % self._retry.refresh_every == 0:
                try:
                    await self._refresh_map()
                except KvpsError:
                    pass  # keep routing with the map we have
            await self._sleep(self._backoff(route.attempt))

    async def _hinted(self, route: Route, op: str, body: Body) -> frame.Frame:
        """Late in a call too: after a failover the first fresh hint is the news the client was
        backing off for."""
        hops = 0
        while True:
            url = route.next_url()
            try:
                return await self.send_once(url, op, body)
            except NotLeader as exc:
                self.stats.redirects += 1
                hint = exc.fields.get("leader_hint")
                route.follow(hint)
                if not hint or hint == url or hops >= 2:
                    raise
                hops += 1
                route.attempt += 1

    async def send_once(self, url: str, op: str, body: Body) -> frame.Frame:
        """One request to the replica at ``url``, no retry."""
        self.stats.requests += 1
        self.stats.bytes_sent += len(body)
        # Every attempt has its own id; the server logs it and echoes it, and errors carry it.
        request_id = f"{self.client_id[:12]}-{self.stats.requests}"
        address = self._map().wire.get(url) if self.wire is not None else None
        if address is not None:
            self.stats.wire_requests += 1
            status, data = await self.wire.request(address[:2] + address[3:], address[2], op, body,
                                                   timeout=self.request_timeout, tag=request_id)
        else:
            status, data = await self.transport.request(
                "POST", url + "/v1/rpc/" + op, body,
                headers={**self.headers(), "Content-Type": "application/x-kvps-frame",
                         "X-Request-Id": request_id},
                timeout=self.request_timeout)
        self.stats.bytes_received += len(data)
        if status != 200:
            err = error_from_response(status, data)
            err.fields.setdefault("request_id", request_id)
            raise err
        return frame.decode(data, max_raw_bytes=1 << 62, kinds=(frame.KIND_RESPONSE,))

    def _backoff(self, attempt: int) -> float:
        ceiling = min(self._retry.cap, self._retry.base * (2 ** min(attempt, 10)))
        return self._rng.uniform(ceiling / 2, ceiling)  # jitter: retries from many workers spread out

    @staticmethod
    async def fan_out(calls: list[Awaitable[Any]]) -> list[Any]:
        """Run the calls concurrently; the first definitive answer of a shard is the caller's."""
        if len(calls) == 1:
            return [await calls[0]]
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(c) for c in calls]
        except* KvpsError as group:
            # Raise one shard's error as itself, preferring a rejection (nothing to retry) over a
            # retryable error.
            errors = _leaves(group)
            raise next((e for e in errors if not isinstance(e, RetryableError)), errors[0]) from None
        return [t.result() for t in tasks]


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


def error_from_response(status: int, body: bytes) -> KvpsError:
    """The kvps error a non-200 reply carries (a proxy's bare 502/503 is ``Unavailable``)."""
    try:
        return error_from_dict(json.loads(body))
    except ValueError:
        if status in (502, 503, 504):
            return Unavailable(f"HTTP {status}")
        return Unavailable(f"HTTP {status}: {body[:200]!r}")
