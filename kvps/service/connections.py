"""Connection limits for the aiohttp servers (a replica's data port, a node's admin port).

Without them every idle connection is held for aiohttp's keep-alive timeout (an hour) and one
address can hold thousands of descriptors. Two limits, both in ``[server]`` of ``cluster.toml``:

- ``idle_timeout``: aiohttp's ``keepalive_timeout``: a connection with no request in progress is
  closed after this long, counted from its last response (or from its opening, if it never sent a
  request). It must exceed the clients' own keep-alive (aiohttp's connector keeps an idle
  connection 15 s) so that the client, not the server, closes an idle pooled connection.
- ``max_connections_per_peer``: connections open at once from one remote IP; one more is answered
  ``429 Overloaded`` (retryable) and closed as soon as it is accepted.

Counted in three series labelled ``node`` and ``server`` (``admin``, ``shard-<s>``, or ``wire``
for a node's wire port, ``kvps.service.wire``, which applies the same two limits itself):
``kvps_connections_open``, ``kvps_connections_refused_total``, ``kvps_connections_idle_closed_total``.
Only public aiohttp hooks are used: the ``Server``'s ``connection_made`` / ``connection_lost``
(each ``RequestHandler`` reports to them) and a middleware marking requests in progress.
"""
from __future__ import annotations

import json
import logging
import time
import weakref
from collections import Counter as Tally
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge

from kvps.errors import Overloaded

__all__ = ["ConnectionLimits", "connection_series"]

log = logging.getLogger("kvps.connections")

_REFUSAL_LOG_PERIOD = 10.0  # seconds between log lines about refused connections


@dataclass
class _Conn:
    peer: str
    last_active: float
    in_flight: int = 0


_SERIES: "weakref.WeakKeyDictionary[CollectorRegistry, tuple]" = weakref.WeakKeyDictionary()


def connection_series(registry: CollectorRegistry, node: int, server: str) -> tuple[Any, Any, Any]:
    """The ``open`` gauge and the ``refused`` and ``idle_closed`` counters of one server, labelled
    ``node`` and ``server``; the families are made once per registry, so every server of a
    process (the admin port, the wire port) shows in the same three series."""
    families = _SERIES.get(registry)
    if families is None:
        families = _SERIES[registry] = (
            Gauge("kvps_connections_open", "Connections open on this server", ("node", "server"),
                  registry=registry),
            Counter("kvps_connections_refused", "Connections refused by the per-peer cap",
                    ("node", "server"), registry=registry),
            Counter("kvps_connections_idle_closed", "Connections closed after idle_timeout with no "
                    "request", ("node", "server"), registry=registry))
    return tuple(f.labels(node=str(node), server=server) for f in families)  # type: ignore[return-value]


class ConnectionLimits:
    """Per-peer cap and idle accounting for one aiohttp server. ``middleware`` goes on the app
    before its runner is set up; ``install(runner)`` after; the runner is made with
    ``keepalive_timeout=idle_timeout`` (``runner_kwargs()``)."""

    def __init__(self, *, idle_timeout: float, per_peer: int, registry: CollectorRegistry,
                 node: int, server: str, clock=time.monotonic) -> None:
        self.idle_timeout = idle_timeout
        self.per_peer = per_peer
        self._clock = clock
        self._peers: Tally[str] = Tally()
        self._conns: dict[Any, _Conn] = {}  # the aiohttp RequestHandler of each admitted connection
        self._refused_logged = float("-inf")
        self.open, self.refused, self.idle_closed = connection_series(registry, node, server)
        @web.middleware
        async def track(request: web.Request, handler: Any) -> web.StreamResponse:
            return await self._track(request, handler)
        self.middleware = track

    def runner_kwargs(self) -> dict[str, Any]:
        return {"keepalive_timeout": self.idle_timeout}

    def install(self, runner: web.BaseRunner) -> None:
        """Hook the runner's server (after ``runner.setup()``): admit or refuse each connection."""
        server = runner.server
        if server is None:
            raise RuntimeError("install() needs a runner that has been set up")
        made, lost = server.connection_made, server.connection_lost

        def connection_made(handler: Any, transport: Any) -> None:
            peer = _peer_ip(transport)
            if self._peers[peer] >= self.per_peer:
                self._refuse(peer, transport)
                return
            self._peers[peer] += 1
            self._conns[handler] = _Conn(peer, self._clock())
            self.open.inc()
            made(handler, transport)

        def connection_lost(handler: Any, exc: BaseException | None = None) -> None:
            conn = self._conns.pop(handler, None)
            if conn is not None:
                self._peers[conn.peer] -= 1
                if self._peers[conn.peer] <= 0:
                    del self._peers[conn.peer]
                self.open.dec()
                if exc is None and conn.in_flight == 0 and \
                        self._clock() - conn.last_active >= self.idle_timeout:
                    self.idle_closed.inc()
            lost(handler, exc)

        server.connection_made = connection_made  # type: ignore[method-assign]
        server.connection_lost = connection_lost  # type: ignore[method-assign]

    def _refuse(self, peer: str, transport: Any) -> None:
        self.refused.inc()
        err = Overloaded(f"more than {self.per_peer} connections from {peer}", peer=peer,
                         limit=self.per_peer)
        body = json.dumps(err.to_dict()).encode()
        transport.write(b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\n"
                        b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        transport.close()
        now = self._clock()
        if now - self._refused_logged >= _REFUSAL_LOG_PERIOD:
            self._refused_logged = now
            log.warning("refusing connections from %s: %d open, the cap is %d (logged at most every "
                        "%.0f s; kvps_connections_refused_total counts them)", peer,
                        self._peers[peer], self.per_peer, _REFUSAL_LOG_PERIOD)

    async def _track(self, request: web.Request, handler: Any) -> web.StreamResponse:
        conn = self._conns.get(request.protocol)
        if conn is None:
            return await handler(request)
        conn.in_flight += 1
        try:
            return await handler(request)
        finally:
            conn.in_flight -= 1
            conn.last_active = self._clock()

    def peers(self) -> dict[str, int]:
        """Open connections per remote IP (for tests and status)."""
        return dict(self._peers)


def _peer_ip(transport: Any) -> str:
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, (tuple, list)) and peer else "local"
