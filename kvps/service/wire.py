"""A node's wire port: the binary data plane (format: ``kvps.delta.wire``).

One connection per client carries requests for every replica the node hosts, pipelined. Each
request body is received straight into a buffer of its declared size (``BufferedProtocol``: the
kernel copies into it, nothing copies it again before the frame decoder reads it), each request
runs as its own task, and each answer is written as soon as it is ready, as its parts (head, then
the response frame's header and arrays) with no joining.

What the HTTP data port gives, this gives too: the token is checked at the hello and again, for its
role, on every request (a token removed from the token file stops working on open connections
within its recheck interval); a body past ``max_body`` is refused before it is read; a body must
arrive within ``body_timeout`` of its header; a connection with nothing in flight closes after
``idle_timeout``; one remote address may hold ``per_peer`` connections; a connection stops reading
while ``max_inflight`` of its requests are running (back-pressure instead of an unbounded queue).
With ``series`` (``kvps.service.connections.connection_series``) the open, refused and idle-closed
connections are counted in the same ``kvps_connections_*`` series as the HTTP servers'.
"""
from __future__ import annotations

import asyncio
import json
import logging
import ssl as ssl_
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from kvps.delta import wire
from kvps.errors import KvpsError, Overloaded, Timeout, Unauthorized
from kvps.buffers import RecycledBuffers
from kvps.service.auth import TokenStore

__all__ = ["Dispatch", "WireServer"]

log = logging.getLogger("kvps.wire")

# (shard, op, authorization, body, the request's tag for logs) -> the response frame's parts; a refusal
# is raised as its KvpsError.
Dispatch = Callable[[int, str, str, memoryview, str], Awaitable[list]]


class WireServer:
    def __init__(self, dispatch: Dispatch, *, tokens: TokenStore, max_body: int, body_timeout: float,
                 idle_timeout: float, per_peer: int, max_inflight: int = 64, name: str = "wire",
                 series: tuple[Any, Any, Any] | None = None) -> None:
        self.dispatch = dispatch
        self.tokens = tokens
        self.max_body = max_body
        self.body_timeout = body_timeout
        self.idle_timeout = idle_timeout
        self.per_peer = per_peer
        self.max_inflight = max_inflight
        self.name = name
        self.open, self.refused, self.idle_closed = series or (_NoSeries(),) * 3
        self.peers: Counter[str] = Counter()
        self.connections: set[_Connection] = set()
        self.requests = 0
        # request bodies are received into buffers reused once nothing refers to them (the loop's
        # thread only: kvps.buffers)
        self.buffers = RecycledBuffers()
        self._server: asyncio.AbstractServer | None = None

    async def start(self, host: str, port: int, ssl: ssl_.SSLContext | None = None) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port, ssl=ssl,
                                                reuse_address=True)

    async def close(self) -> None:
        """Stop accepting, drop every connection, cancel what still runs."""
        if self._server is not None:
            self._server.close()
        tasks = []
        for conn in list(self.connections):
            tasks.extend(conn.abort())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None


class _NoSeries:
    def inc(self, amount: float = 1) -> None:
        pass

    def dec(self, amount: float = 1) -> None:
        pass


_HELLO, _TOKEN, _HEAD, _OP, _BODY, _DISCARD = range(6)
_LINGER = 2.0  # seconds a refused connection's input is read and dropped before it is closed


class _Connection(asyncio.BufferedProtocol):
    """One client connection: a small state machine over what arrives, reading exactly what the
    current part needs (so a body lands in its own buffer and nothing is read past it)."""

    def __init__(self, server: WireServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.peer = ""
        self.authorization = ""
        self.tasks: set[asyncio.Task] = set()
        self._state = _HELLO
        self._want = memoryview(bytearray(wire.HELLO.size))
        self._got = 0
        self._head: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0)
        self._op = self._tag = ""
        self._body: np.ndarray | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._paused_reading = False
        self._write_ready: asyncio.Future | None = None
        self._closing = False
        self._admitted = False  # counted as open (not refused by the per-peer cap)

    # -- connection events ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.peer = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        self.server.connections.add(self)
        self.server.peers[self.peer] += 1
        if self.server.peers[self.peer] > self.server.per_peer:
            self.server.refused.inc()
            self._fail(0, Overloaded(f"too many connections from {self.peer}",
                                     limit=self.server.per_peer))
            return
        self._admitted = True
        self.server.open.inc()
        self._arm(self.server.body_timeout, "hello")

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self.server.connections.discard(self)
        self.server.peers[self.peer] -= 1
        if self.server.peers[self.peer] <= 0:
            del self.server.peers[self.peer]
        if self._admitted:
            self._admitted = False
            self.server.open.dec()
        self._disarm()
        if self._write_ready is not None and not self._write_ready.done():
            self._write_ready.set_result(None)

    def pause_writing(self) -> None:
        if self._write_ready is None or self._write_ready.done():
            self._write_ready = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._write_ready is not None and not self._write_ready.done():
            self._write_ready.set_result(None)

    def abort(self) -> list[asyncio.Task]:
        self._closing = True
        if self.transport is not None:
            self.transport.abort()
        return list(self.tasks)

    # -- reading --------------------------------------------------------------------------------

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._want[self._got:]

    def buffer_updated(self, nbytes: int) -> None:
        if self._state == _DISCARD:
            return
        self._got += nbytes
        if self._got < len(self._want) or self._closing:
            return
        try:
            self._complete()
        except KvpsError as exc:  # a header it cannot read past: answer and close
            self._fail(self._head[1], exc)

    def eof_received(self) -> bool | None:
        return None  # close (answers still being computed are dropped with the connection)

    def _linger(self) -> None:
        """Stop reading requests but keep draining what arrives, so that closing with unread input
        does not reset the connection before the client has read our answer (TCP sends RST
        then); closed when the client closes its side, or after ``_LINGER`` seconds."""
        self._state, self._got = _DISCARD, 0
        self._want = memoryview(bytearray(16384))
        if self.transport is not None:
            if self.transport.can_write_eof():
                self.transport.write_eof()
            asyncio.get_running_loop().call_later(_LINGER, self.transport.close)

    def _expect(self, state: int, size: int, buf: memoryview | None = None) -> None:
        self._state, self._got = state, 0
        self._want = buf if buf is not None else memoryview(bytearray(size))

    def _complete(self) -> None:
        """The current part is complete: act on it and say what to read next."""
        state, got = self._state, self._want
        if state == _HELLO:
            token_len = wire.parse_hello(got)
            if token_len == 0:
                raise Unauthorized("missing bearer token")
            self._expect(_TOKEN, token_len)
        elif state == _TOKEN:
            self.authorization = "Bearer " + bytes(got).decode("utf-8", "replace")
            self.server.tokens.check(self.authorization, "read", "connect")
            self._disarm()
            self._reply(0, 200, [b"{}"])
            self._next_request()
        elif state == _HEAD:
            self._head = wire.REQUEST.unpack(got)  # its id first, to answer a refusal with
            wire.parse_request(got, self.server.max_body)
            self._disarm()
            self._expect(_OP, self._head[3] + self._head[4])
        elif state == _OP:
            self._op, self._tag = wire.split_names(got, self._head[3])
            body_len = self._head[0]
            if body_len == 0:
                self._run(np.empty(0, np.uint8))
            else:
                # not zero-filled: every byte is written by the kernel; a buffer whose pages are
                # already faulted in once nothing refers to it (an earlier body, applied)
                self._body = self.server.buffers.take(body_len)
                self._arm(self.server.body_timeout, "body")
                self._expect(_BODY, body_len, memoryview(self._body))
        elif state == _BODY:
            self._disarm()
            body, self._body = self._body, None
            self._run(body)

    def _next_request(self) -> None:
        self._expect(_HEAD, wire.REQUEST.size)
        if not self.tasks:
            self._arm(self.server.idle_timeout, "idle")

    # -- running and answering ------------------------------------------------------------------

    def _run(self, body: np.ndarray) -> None:
        rid, shard = self._head[1], self._head[2]
        tag = self._tag or f"{self.peer}#{rid}"
        task = asyncio.get_running_loop().create_task(self._serve(rid, shard, self._op, tag, body))
        self.tasks.add(task)
        self.server.requests += 1
        if len(self.tasks) >= self.server.max_inflight and self.transport is not None:
            self.transport.pause_reading()
            self._paused_reading = True
        self._next_request()

    async def _serve(self, rid: int, shard: int, op: str, tag: str, body: np.ndarray) -> None:
        try:
            try:
                parts = await self.server.dispatch(shard, op, self.authorization, memoryview(body), tag)
                status = 200
            except KvpsError as exc:
                status, parts = exc.http_status, [_error_json(exc)]
            except Exception:
                log.exception("%s: %s on shard %d failed", self.server.name, op, shard)
                status, parts = 500, [_error_json(KvpsError("internal error"))]
            del body
            if self._write_ready is not None:
                await self._write_ready
            self._reply(rid, status, parts)
        finally:
            self.tasks.discard(asyncio.current_task())
            if self._paused_reading and len(self.tasks) < self.server.max_inflight \
                    and not self._closing and self.transport is not None:
                self._paused_reading = False
                self.transport.resume_reading()
            if not self.tasks and self._state == _HEAD and self._got == 0:
                self._arm(self.server.idle_timeout, "idle")

    def _reply(self, rid: int, status: int, parts: list) -> None:
        if self._closing or self.transport is None or self.transport.is_closing():
            return
        self.transport.write(wire.response_head(sum(len(p) for p in parts), rid, status))
        for part in parts:  # one sequence with no await: answers never interleave
            self.transport.write(part)

    def _fail(self, rid: int, exc: KvpsError) -> None:
        """Answer ``exc`` and close: the connection cannot go on (bad hello or header)."""
        if not isinstance(exc, (Overloaded, Unauthorized)):
            log.info("%s: connection from %s closed: %s: %s", self.server.name, self.peer,
                     type(exc).__name__, exc.message)
        self._reply(rid, exc.http_status, [_error_json(exc)])
        self._closing = True
        self._disarm()
        self._linger()

    # -- timers ---------------------------------------------------------------------------------

    def _arm(self, seconds: float, what: str) -> None:
        self._disarm()
        self._timer = asyncio.get_running_loop().call_later(seconds, self._expired, what)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self, what: str) -> None:
        self._timer = None
        if what == "idle":
            if not self.tasks and self.transport is not None:
                self._closing = True
                self.server.idle_closed.inc()
                self.transport.close()
            return
        exc = Timeout(f"request {what} not received within {self.server.body_timeout}s")
        self._fail(self._head[1] if what == "body" else 0, exc)


def _error_json(exc: KvpsError) -> bytes:
    return json.dumps(exc.to_dict()).encode()
