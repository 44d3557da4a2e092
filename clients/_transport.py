"""Client transports. Foreign exceptions become kvps errors here, at one boundary.

``HttpTransport`` talks aiohttp to real replicas; ``MockTransport`` hands every request to a Python
function, so the client's routing, retry and chunking logic can be tested with no network (the
cluster tests use the real thing).
"""
from __future__ import annotations

import asyncio
import ssl as ssl_
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import aiohttp
from aiohttp.abc import AbstractStreamWriter
from aiohttp.payload import Payload

from kvps.errors import ConnectError, Unavailable

__all__ = ["Body", "HttpTransport", "MockTransport", "Transport"]


class Body:
    """A request body as the buffers that make it up (a frame's header, then its arrays), sent one
    after the other instead of joined. Joining put every pushed byte into fresh memory in the
    client (a 1 MiB push: 1 MiB allocated, faulted in and freed per request, about one page fault
    per 4 KiB sent on a machine that returns freed memory to its host). The parts are views of the
    caller's arrays: a call's retries resend them, and its arrays must not change until the call
    returns (the frame's checksums, computed when it was encoded, refuse a body that changed)."""

    __slots__ = ("parts", "nbytes")

    def __init__(self, parts: Sequence[bytes | memoryview]) -> None:
        self.parts = tuple(p if isinstance(p, bytes) else memoryview(p).cast("B") for p in parts)
        self.nbytes = sum(len(p) for p in self.parts)

    def __len__(self) -> int:
        return self.nbytes

    def __bytes__(self) -> bytes:
        return b"".join(self.parts)


class _PartsPayload(Payload):
    """aiohttp's view of a ``Body``: its length up front (a Content-Length, no chunking), its
    parts written in turn."""

    def __init__(self, body: Body) -> None:
        super().__init__(body, content_type="application/x-kvps-frame")
        self._size = body.nbytes

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return bytes(self._value).decode(encoding, errors)

    async def write(self, writer: AbstractStreamWriter) -> None:
        for part in self._value.parts:
            await writer.write(part)

    async def write_with_length(self, writer: AbstractStreamWriter, content_length: int | None) -> None:
        if content_length is None or content_length >= self._size:
            await self.write(writer)
            return
        left = content_length  # aiohttp asks for less only for a declared shorter length
        for part in self._value.parts:
            if left <= 0:
                break
            await writer.write(part[:left])
            left -= len(part)


class Transport(Protocol):
    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def request(self, method: str, url: str, body: bytes | Body | None, *, headers: dict[str, str],
                      timeout: float) -> tuple[int, bytes]: ...


class HttpTransport:
    """aiohttp with keep-alive connections; every failure to get an answer is ``ConnectError``."""

    def __init__(self, *, limit_per_host: int = 16, ssl: ssl_.SSLContext | None = None) -> None:
        self._limit_per_host = limit_per_host
        self._ssl = ssl
        self._session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=self._limit_per_host,
                                         ssl=self._ssl if self._ssl is not None else True)
        self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(self, method: str, url: str, body: bytes | Body | None, *, headers: dict[str, str],
                      timeout: float) -> tuple[int, bytes]:
        if self._session is None:
            raise Unavailable("transport is not open")
        try:
            async with self._session.request(
                    method, url, data=_PartsPayload(body) if isinstance(body, Body) else body,
                    headers=headers,
                    timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                return resp.status, await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise ConnectError(url, f"{method}: {type(exc).__name__}: {exc}") from exc


Handler = Callable[[str, str, bytes | None, dict[str, str]], Awaitable[tuple[int, bytes]]]


class MockTransport:
    """Calls ``handler(method, url, body, headers) -> (status, body)`` for every request (a
    ``Body`` is handed over joined, as bytes)."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.requests: list[tuple[str, str]] = []

    async def open(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def request(self, method: str, url: str, body: bytes | Body | None, *, headers: dict[str, str],
                      timeout: float) -> tuple[int, bytes]:
        self.requests.append((method, url))
        return await self.handler(method, url, bytes(body) if isinstance(body, Body) else body, headers)
