"""The client's side of a node's wire port (format: ``kvps.delta.wire``; server:
``kvps.service.wire``).

One connection per node, opened on first use with the token in its hello, shared by every call
of the client: requests are written as they come, each with an id, and answered in any order, so
the calls of a multi-shard push to one node travel together on one connection instead of one
HTTP exchange each. A request's frame goes out as its parts (``Body``), never joined; an answer
is received straight into a buffer of its size and handed over as a read-only view of it (a
pulled block is a view of that buffer: no copy between the socket and the caller's arrays but the
kernel's). A failure to get an answer is ``ConnectError``, as with ``HttpTransport``, and the
connection is opened again by the next request.

With ``ring`` (the client's ``shm``), a body of ``kvps.delta.ring.MIN_BODY`` or more to a node on
this host is written into the client's push ring (``clients._ring``) and a 48-byte descriptor
goes on the connection in its place; the node copies the body out before it reads it. A node that
cannot read the ring answers ``RingUnavailable`` and gets that request, and every later one, inline.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import os
import ssl as ssl_

import numpy as np

from kvps.delta import ring as ring_layout
from kvps.delta import wire
from kvps.errors import ConnectError

from ._ring import Place, PushRing, supported
from ._routing import is_loopback_host
from ._transport import Body

__all__ = ["WireTransport"]


class WireTransport:
    def __init__(self, token: str, *, ssl: ssl_.SSLContext | None = None,
                 connect_timeout: float = 5.0, ring: bool = False, ring_bytes: int | None = None) -> None:
        self._token = token
        self._ssl = ssl
        self._connect_timeout = connect_timeout
        self._conns: dict[tuple[str, int, bool], _Connection] = {}
        self._opening: dict[tuple[str, int, bool], asyncio.Task] = {}
        self._use_ring = ring and supported()
        self._ring_bytes = ring_bytes
        self._ring: PushRing | None = None
        self._no_ring: set[tuple[str, int, bool]] = set()  # nodes that cannot read it
        self.ring_requests = 0  # bodies sent through the ring
        self.ring_bytes_sent = 0
        self.ring_inline = 0  # bodies for a ring-reading node sent inline: no room in the ring then
        self.rings_abandoned = 0  # rings given up after a request through them got no answer

    async def open(self) -> None:
        pass

    async def close(self) -> None:
        for task in self._opening.values():
            task.cancel()
        conns, self._conns = list(self._conns.values()), {}
        await asyncio.gather(*(c.close() for c in conns), return_exceptions=True)
        if self._ring is not None:
            self._ring.close()
            self._ring = None

    async def request(self, address: tuple[str, int, bool], shard: int, op: str, body: Body | bytes, *,
                      timeout: float, tag: str = "") -> tuple[int, bytes | memoryview]:
        """``op`` on ``shard`` of the node at ``address`` (host, port, tls): (status, body), the
        body a read-only ``memoryview`` when the status is 200, else the error's JSON as ``bytes``.
        ``tag``: the request's name in the node's log (``kvps.delta.wire``)."""
        where = f"kvps://{address[0]}:{address[1]}"
        try:
            async with asyncio.timeout(timeout):
                conn = await self._connection(address)
                placed = self._place(address, body)
                if placed is None:
                    return await conn.request(shard, op, body, tag)
                status, answer = await self._through_ring(conn, shard, op, tag, *placed)
                if status == 400 and _error_name(answer) == "RingUnavailable":
                    if not placed[2].closed:  # (a ring given up meanwhile: try a fresh one next time)
                        self._no_ring.add(address)
                    return await conn.request(shard, op, body, tag)
                return status, answer
        except TimeoutError:
            raise ConnectError(where, f"{op}: no answer within {timeout}s") from None
        except (OSError, EOFError, asyncio.IncompleteReadError, ssl_.SSLError) as exc:
            raise ConnectError(where, f"{op}: {type(exc).__name__}: {exc}") from exc

    def _place(self, address: tuple[str, int, bool], body: Body | bytes) -> tuple[bytes, Place, PushRing] | None:
        """``body`` written into the push ring, if it goes that way: (descriptor, place, ring)."""
        if not self._use_ring or len(body) < ring_layout.MIN_BODY or address in self._no_ring \
                or not is_loopback_host(address[0]):
            return None
        if self._ring is not None and self._ring.pid != os.getpid():
            self._ring = None  # a forked child: its parent's ring (and descriptor number) are not its own
        if self._ring is None:
            try:
                self._ring = PushRing(self._ring_bytes) if self._ring_bytes else PushRing()
            except OSError:  # no memfd here (or no memory for one): inline from now on
                self._use_ring = False
                return None
        placed = self._ring.place(body.parts if isinstance(body, Body) else (body,))
        if placed is None:
            self.ring_inline += 1
            return None
        self.ring_requests += 1
        self.ring_bytes_sent += len(body)
        return placed[0], placed[1], self._ring

    async def _through_ring(self, conn: "_Connection", shard: int, op: str, tag: str,
                            descriptor: bytes, place: Place, ring: PushRing) -> tuple[int, bytes | memoryview]:
        """Send the descriptor; an answer frees its place (the node copied the body out before
        answering), no answer gives the ring up: the node may still read that place."""
        answered = False
        try:
            answer = await conn.request(shard, op, descriptor, tag)
            answered = True
            return answer
        finally:
            if answered:
                ring.release(place)
            elif not ring.closed:
                self.rings_abandoned += 1
                if ring is self._ring:
                    self._ring = None
                ring.close()

    async def _connection(self, address: tuple[str, int, bool]) -> "_Connection":
        conn = self._conns.get(address)
        if conn is not None and conn.usable:
            return conn
        task = self._opening.get(address)
        if task is None:  # one connect per node, however many calls are waiting for it
            task = asyncio.get_running_loop().create_task(self._connect(address))
            self._opening[address] = task
            task.add_done_callback(lambda _: self._opening.pop(address, None))
        return await asyncio.shield(task)

    async def _connect(self, address: tuple[str, int, bool]) -> "_Connection":
        host, port, tls = address
        context = (self._ssl or ssl_.create_default_context()) if tls else None
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self._connect_timeout):
            _, conn = await loop.create_connection(_Connection, host, port, ssl=context)
            try:
                status, answer = await conn.hello(self._token)
            except BaseException:
                conn.abort()
                raise
        if status != 200:
            conn.abort()
            from ._sender import error_from_response
            raise error_from_response(status, bytes(answer))
        self._conns[address] = conn
        return conn


def _error_name(answer: bytes | memoryview) -> str:
    try:
        return str(json.loads(bytes(answer)).get("error"))
    except (ValueError, AttributeError):
        return ""


_HEAD, _BODY = 0, 1


class _Connection(asyncio.BufferedProtocol):
    """One connection to a node's wire port. Answers are received straight into buffers of their
    declared size (``BufferedProtocol``: the kernel copies into them, nothing copies them again
    before the frame decoder reads them); a 200 answer is a read-only ``memoryview`` of its
    buffer (the pulled arrays are views of it), an error's JSON is ``bytes``. Requests are
    written as they come (pipelined, with ids); answers come back in any order."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._failed: BaseException | None = None
        self._state = _HEAD
        self._head = memoryview(bytearray(wire.RESPONSE.size))
        self._want = self._head
        self._got = 0
        self._answer: tuple[int, int] = (0, 0)  # (rid, status) of the answer being received
        self._body: np.ndarray | None = None
        self._can_write: asyncio.Future | None = None

    # -- asyncio's side -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost(exc or ConnectionResetError("closed by the node"))

    def pause_writing(self) -> None:
        if self._can_write is None or self._can_write.done():
            self._can_write = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._can_write is not None and not self._can_write.done():
            self._can_write.set_result(None)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._want[self._got:]

    def buffer_updated(self, nbytes: int) -> None:
        self._got += nbytes
        if self._got < len(self._want):
            return
        if self._state == _HEAD:
            length, rid, status = wire.RESPONSE.unpack(self._head)
            self._answer = (rid, status)
            if length:
                self._body = np.empty(length, np.uint8)
                self._expect(_BODY, memoryview(self._body))
                return
            self._deliver(b"")
        else:
            body, self._body = self._body, None
            assert body is not None
            if self._answer[1] == 200:
                body.flags.writeable = False
                self._deliver(memoryview(body))
            else:
                self._deliver(body.tobytes())
        self._expect(_HEAD, self._head)

    def eof_received(self) -> bool | None:
        return None  # close: a node only ends a connection it will not answer on any more

    # -- ours -----------------------------------------------------------------------------------

    @property
    def usable(self) -> bool:
        return self._failed is None and self._transport is not None and not self._transport.is_closing()

    async def hello(self, token: str) -> tuple[int, bytes | memoryview]:
        """The hello and the node's answer to it (id 0)."""
        answer = asyncio.get_running_loop().create_future()
        self._pending[0] = answer
        self._write([wire.encode_hello(token)])
        return await answer

    async def request(self, shard: int, op: str, body: Body | bytes, tag: str) -> tuple[int, bytes | memoryview]:
        if self._failed is not None:
            raise ConnectionResetError(f"connection lost: {self._failed}")
        parts = body.parts if isinstance(body, Body) else (bytes(body),)
        rid = next(self._ids)
        head = wire.request_head(sum(len(p) for p in parts), rid, shard, op, tag)
        answer = asyncio.get_running_loop().create_future()
        self._pending[rid] = answer
        try:
            self._write([head, *parts])  # at once, no await in between: requests never interleave
            if self._can_write is not None and not self._can_write.done():
                await asyncio.shield(self._can_write)  # the node reads slower than we write
            return await answer
        finally:
            self._pending.pop(rid, None)  # a late answer (after a timeout) is dropped
            if answer.done() and not answer.cancelled():
                answer.exception()  # a loss seen while still writing: the write's error is raised

    def _write(self, parts: list) -> None:
        if self._transport is None or self._transport.is_closing():
            raise ConnectionResetError(f"connection lost: {self._failed or 'closed'}")
        for part in parts:  # not writelines: on Python 3.11 it joins the parts, a copy of the request
            self._transport.write(part)

    def _expect(self, state: int, buf: memoryview) -> None:
        self._state, self._want, self._got = state, buf, 0

    def _deliver(self, data: bytes | memoryview) -> None:
        rid, status = self._answer
        answer = self._pending.get(rid)
        if answer is not None and not answer.done():
            answer.set_result((status, data))

    def _lost(self, exc: BaseException) -> None:
        if self._failed is None:
            self._failed = exc
        for answer in self._pending.values():
            if not answer.done():
                answer.set_exception(ConnectionResetError(f"connection lost: {exc}"))
        self._pending.clear()
        if self._can_write is not None and not self._can_write.done():
            self._can_write.set_result(None)
        if self._transport is not None:
            self._transport.close()

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    async def close(self) -> None:
        self._lost(ConnectionResetError("closed"))
