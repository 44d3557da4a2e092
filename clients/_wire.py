"""The client's side of a node's wire port (format: ``kvps.delta.wire``; server:
``kvps.service.wire``).

One connection per node, opened on first use with the token in its hello, shared by every call
of the client: requests are written as they come, each with an id, and answered in any order, so
the calls of a multi-shard push to one node travel together on one connection instead of one
HTTP exchange each. A request's frame goes out as its parts (``Body``), never joined. A failure to
get an answer is ``ConnectError``, as with ``HttpTransport``, and the connection is opened again
by the next request.
"""
from __future__ import annotations

import asyncio
import itertools
import ssl as ssl_

from kvps.delta import wire
from kvps.errors import ConnectError, KvpsError

from ._transport import Body

__all__ = ["WireTransport"]


class WireTransport:
    def __init__(self, token: str, *, ssl: ssl_.SSLContext | None = None,
                 connect_timeout: float = 5.0) -> None:
        self._token = token
        self._ssl = ssl
        self._connect_timeout = connect_timeout
        self._conns: dict[tuple[str, int, bool], _Connection] = {}
        self._opening: dict[tuple[str, int, bool], asyncio.Task] = {}

    async def open(self) -> None:
        pass

    async def close(self) -> None:
        for task in self._opening.values():
            task.cancel()
        conns, self._conns = list(self._conns.values()), {}
        await asyncio.gather(*(c.close() for c in conns), return_exceptions=True)

    async def request(self, address: tuple[str, int, bool], shard: int, op: str, body: Body | bytes, *,
                      timeout: float, tag: str = "") -> tuple[int, bytes]:
        """``op`` on ``shard`` of the node at ``address`` (host, port, tls): (status, body).
        ``tag``: the request's name in the node's log (``kvps.delta.wire``)."""
        where = f"kvps://{address[0]}:{address[1]}"
        try:
            async with asyncio.timeout(timeout):
                conn = await self._connection(address)
                return await conn.request(shard, op, body, tag)
        except TimeoutError:
            raise ConnectError(where, f"{op}: no answer within {timeout}s") from None
        except (OSError, EOFError, asyncio.IncompleteReadError, ssl_.SSLError) as exc:
            raise ConnectError(where, f"{op}: {type(exc).__name__}: {exc}") from exc

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
        async with asyncio.timeout(self._connect_timeout):
            reader, writer = await asyncio.open_connection(host, port, ssl=context)
            try:
                writer.write(wire.encode_hello(self._token))
                length, _, status = wire.RESPONSE.unpack(await reader.readexactly(wire.RESPONSE.size))
                answer = await reader.readexactly(length)
            except BaseException:
                writer.close()
                raise
        if status != 200:
            writer.close()
            from ._sender import error_from_response
            raise error_from_response(status, answer)
        conn = _Connection(reader, writer)
        self._conns[address] = conn
        return conn


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._failed: BaseException | None = None
        self._task = asyncio.get_running_loop().create_task(self._read_answers())

    @property
    def usable(self) -> bool:
        return self._failed is None and not self._writer.is_closing()

    async def request(self, shard: int, op: str, body: Body | bytes, tag: str) -> tuple[int, bytes]:
        if self._failed is not None:
            raise ConnectionResetError(f"connection lost: {self._failed}")
        parts = body.parts if isinstance(body, Body) else (bytes(body),)
        rid = next(self._ids)
        head = wire.request_head(sum(len(p) for p in parts), rid, shard, op, tag)
        answer = asyncio.get_running_loop().create_future()
        self._pending[rid] = answer
        try:
            self._writer.write(head)
            for part in parts:  # no await in between: requests never interleave
                self._writer.write(part)
            await self._writer.drain()
            return await answer
        finally:
            self._pending.pop(rid, None)  # a late answer (after a timeout) is dropped
            if answer.done() and not answer.cancelled():
                answer.exception()  # a loss seen while still writing: the write's error is raised

    async def _read_answers(self) -> None:
        try:
            while True:
                length, rid, status = wire.RESPONSE.unpack(await self._reader.readexactly(wire.RESPONSE.size))
                data = await self._reader.readexactly(length) if length else b""
                answer = self._pending.get(rid)
                if answer is not None and not answer.done():
                    answer.set_result((status, data))
        except (OSError, EOFError, asyncio.IncompleteReadError, ssl_.SSLError, KvpsError) as exc:
            self._lost(exc)
        except asyncio.CancelledError:
            self._lost(ConnectionResetError("closed"))
            raise

    def _lost(self, exc: BaseException) -> None:
        self._failed = exc
        for answer in self._pending.values():
            if not answer.done():
                answer.set_exception(ConnectionResetError(f"connection lost: {exc}"))
        self._pending.clear()
        self._writer.close()

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except (OSError, ssl_.SSLError):
            pass
