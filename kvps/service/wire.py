"""A node's wire port: the binary data plane (format: ``kvps.delta.wire``).

One connection per client carries requests for every replica the node hosts, pipelined. Each
request body is received straight into a buffer of its declared size (``BufferedProtocol``: the
kernel copies into it, nothing copies it again before the frame decoder reads it), each request
runs as its own task, and each answer is written as soon as it is ready, as its parts (head, then
the response frame's header and arrays) with no joining. On a plain TCP connection the answers go
out through ``sendmsg`` on a duplicate of the connection's socket, straight from those parts:
asyncio's transport (3.11) copies whatever the socket does not take at once into a buffer of its
own, which for a pull of megabytes is most of it (a copy into growing, fresh memory on the loop's
thread). Answers leave in the order they are ready, one at a time; TLS connections write
through the transport.

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
import os
import socket
import ssl as ssl_
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from kvps.delta import ring, wire
from kvps.errors import KvpsError, Overloaded, RingUnavailable, Timeout, Unauthorized
from kvps.buffers import RecycledBuffers
from kvps.service.auth import TokenStore
from kvps.service.ring import Rings

__all__ = ["Dispatch", "WireServer"]

log = logging.getLogger("kvps.wire")

# (shard, op, authorization, body, the request's tag for logs) -> the response frame's parts; a refusal
# is raised as its KvpsError.
Dispatch = Callable[[int, str, str, memoryview, str], Awaitable[list]]


class WireServer:
    def __init__(self, dispatch: Dispatch, *, tokens: TokenStore, max_body: int, body_timeout: float,
                 idle_timeout: float, per_peer: int, max_inflight: int = 64, name: str = "wire",
                 series: tuple[Any, Any, Any] | None = None,
                 rings: tuple[Any, Any, Any] | None = None) -> None:
        self.dispatch = dispatch
        self.tokens = tokens
        self.max_body = max_body
        self.body_timeout = body_timeout
        self.idle_timeout = idle_timeout
        self.per_peer = per_peer
        self.max_inflight = max_inflight
        self.name = name
        self.open, self.refused, self.idle_closed = series or (_NoSeries(),) * 3
        # bodies and bytes copied out of push rings, descriptors refused (``ring_series``)
        self.ring_bodies, self.ring_bytes, self.ring_refused = rings or (_NoSeries(),) * 3
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
_MAX_IOV = 512  # buffers per sendmsg (the kernel takes at most IOV_MAX, 1024 on Linux)
_QUEUED_HIGH = 8 << 20  # answer bytes waiting to be sent past which finished requests wait to answer


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
        self._sock: socket.socket | None = None  # a duplicate to send answers on (plain TCP)
        self._outq: deque[list] = deque()  # answers waiting to be sent, each as its buffers
        self._queued = 0  # their bytes
        self._sender: asyncio.Task | None = None
        self._eof_after_send = False
        self.rings = Rings()  # the client's push rings, mapped on first use

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
        raw = transport.get_extra_info("socket")
        if raw is not None and transport.get_extra_info("sslcontext") is None:
            self._sock = socket.socket(fileno=os.dup(raw.fileno()))
            self._sock.setblocking(False)
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
        if self._sender is not None:
            self._sender.cancel()
        self._outq.clear()
        self.rings.close()
        if self._sock is not None:  # the transport closed its descriptor: this one ends the socket
            asyncio.get_running_loop().remove_writer(self._sock.fileno())  # a send waiting on it
            self._sock.close()
            self._sock = None

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
            if self._sender is not None:
                self._eof_after_send = True  # once the answer is out
            elif self.transport.can_write_eof():
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
            if ring.is_descriptor(body):  # the body is in the client's push ring
                body = self._from_ring(body)
                if body is None:  # refused (and answered)
                    self._next_request()
                    return
            self._run(body)

    def _from_ring(self, descriptor: np.ndarray) -> np.ndarray | None:
        """The body a descriptor stands for, copied out of the client's ring before anything
        reads it (the client cannot change what is then checked and applied); None when it is
        refused, after answering the refusal."""
        try:
            body = self.rings.body(descriptor, peer=self.peer, max_body=self.server.max_body,
                                   take=self.server.buffers.take)
        except KvpsError as exc:
            if isinstance(exc, RingUnavailable):
                self.server.ring_refused.inc()
            log.info("%s: request %s from %s refused: %s: %s", self.server.name, self._tag or self._head[1],
                     self.peer, type(exc).__name__, exc.message)
            self._reply(self._head[1], exc.http_status, [_error_json(exc)])
            return None
        self.server.ring_bodies.inc()
        self.server.ring_bytes.inc(len(body))
        return body

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
        head = wire.response_head(sum(len(p) for p in parts), rid, status)
        if self._sock is None:  # TLS: through the transport (which copies what it cannot send)
            self.transport.write(head)
            for part in parts:  # one sequence with no await: answers never interleave
                self.transport.write(part)
            return
        bufs = [memoryview(head), *(memoryview(p).cast("B") for p in parts)]
        if not self._outq:
            try:
                bufs = _sent(bufs, self._sock.sendmsg(bufs[:_MAX_IOV]))  # most answers: all of it
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as exc:
                self._lost(exc)
                return
            if not bufs:
                return
        self._outq.append(bufs)
        self._queued += sum(len(b) for b in bufs)
        if self._queued > _QUEUED_HIGH:
            self.pause_writing()
        if self._sender is None:
            self._sender = asyncio.get_running_loop().create_task(self._send_queued())

    async def _send_queued(self) -> None:
        """Send the queued answers in order, waiting for the socket to take more."""
        loop = asyncio.get_running_loop()
        sock = self._sock
        assert sock is not None
        try:
            while self._outq:
                bufs = self._outq[0]
                while bufs:
                    try:
                        n = sock.sendmsg(bufs[:_MAX_IOV])
                    except (BlockingIOError, InterruptedError):
                        writable = loop.create_future()
                        loop.add_writer(sock.fileno(), _settle, writable)
                        try:
                            await writable
                        finally:
                            if sock.fileno() >= 0:  # (closed: connection_lost removed it)
                                loop.remove_writer(sock.fileno())
                        continue
                    self._queued -= n
                    bufs = _sent(bufs, n)
                self._outq.popleft()
                if self._queued <= _QUEUED_HIGH // 2:
                    self.resume_writing()
        except OSError as exc:
            self._lost(exc)
        finally:
            self._sender = None
            if self._eof_after_send and self.transport is not None and not self.transport.is_closing():
                self.transport.write_eof()

    def _lost(self, exc: OSError) -> None:
        """Sending failed (the client went away): drop what waits and close."""
        log.debug("%s: sending to %s failed: %s", self.server.name, self.peer, exc)
        self._outq.clear()
        self._queued = 0
        self._closing = True
        self.resume_writing()
        if self.transport is not None:
            self.transport.abort()

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


def _settle(fut: asyncio.Future) -> None:
    if not fut.done():  # the writer may fire again before the waiting task removes it
        fut.set_result(None)


def _sent(bufs: list, n: int) -> list:
    """``bufs`` after their first ``n`` bytes went out."""
    k = 0
    while k < len(bufs) and n >= len(bufs[k]):
        n -= len(bufs[k])
        k += 1
    rest = bufs[k:]
    if n and rest:
        rest[0] = rest[0][n:]
    return rest


def _error_json(exc: KvpsError) -> bytes:
    return json.dumps(exc.to_dict()).encode()
