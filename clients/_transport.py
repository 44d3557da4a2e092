"""Client transports. Foreign exceptions become kvps errors here, at one boundary.

``HttpTransport`` talks aiohttp to real replicas; ``MockTransport`` hands every request to a Python
function, so the client's routing, retry and chunking logic can be tested with no network (the
cluster tests use the real thing).
"""
from __future__ import annotations

import asyncio
import ssl as ssl_
from collections.abc import Awaitable, Callable
from typing import Protocol

import aiohttp

from kvps.errors import ConnectError, Unavailable

__all__ = ["HttpTransport", "MockTransport", "Transport"]


class Transport(Protocol):
    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def request(self, method: str, url: str, body: bytes | None, *, headers: dict[str, str],
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

    async def request(self, method: str, url: str, body: bytes | None, *, headers: dict[str, str],
                      timeout: float) -> tuple[int, bytes]:
        if self._session is None:
            raise Unavailable("transport is not open")
        try:
            async with self._session.request(
                    method, url, data=body, headers=headers,
                    timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                return resp.status, await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise ConnectError(url, f"{method}: {type(exc).__name__}: {exc}") from exc


Handler = Callable[[str, str, bytes | None, dict[str, str]], Awaitable[tuple[int, bytes]]]


class MockTransport:
    """Calls ``handler(method, url, body, headers) -> (status, body)`` for every request."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.requests: list[tuple[str, str]] = []

    async def open(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def request(self, method: str, url: str, body: bytes | None, *, headers: dict[str, str],
                      timeout: float) -> tuple[int, bytes]:
        self.requests.append((method, url))
        return await self.handler(method, url, body, headers)
