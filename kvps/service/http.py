"""HTTP between kvps processes, and from the command line to a node: the one place where
aiohttp's and urllib's errors become kvps errors.

- No answer at all (refused, reset, timed out, DNS) is ``ConnectError`` (an ``Unavailable``).
- A non-2xx reply with a kvps error body (``{"error", "message", "fields"}``) is that error,
  rebuilt; any other non-2xx reply is ``Unavailable`` naming the status.

``PeerClient`` (asyncio, aiohttp) is what server processes use: JSON calls, data-plane RPCs in
binary frames, file downloads. ``request_json`` (blocking, urllib) is what the command line and
test harnesses use. Neither ever unpickles anything.
"""
from __future__ import annotations

import asyncio
import json
import os
import ssl as ssl_
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from kvps.delta import frame
from kvps.errors import ConnectError, KvpsError, Unavailable, error_from_dict

__all__ = ["PeerClient", "request", "request_json", "rpc"]

Token = str | Callable[[], str]


class PeerClient:
    """Calls from one kvps process to another. ``token``: the bearer token, or a function giving
    the current one (token files rotate). Use ``async with`` or ``open()`` / ``close()``."""

    def __init__(self, *, token: Token = "", ssl: ssl_.SSLContext | None = None,
                 timeout: float = 5.0) -> None:
        self._token = token
        self._ssl = ssl
        self._timeout = timeout
        self._session: aiohttp.ClientSession | None = None

    async def open(self) -> "PeerClient":
        await self._opened()
        return self

    async def _opened(self) -> aiohttp.ClientSession:
        """The session, made on first use (inside the running loop, as aiohttp wants)."""
        if self._session is None:
            connector = aiohttp.TCPConnector(ssl=self._ssl) if self._ssl is not None else None
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> "PeerClient":
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        token = self._token() if callable(self._token) else self._token
        return {**({"Authorization": f"Bearer {token}"} if token else {}), **(extra or {})}

    async def _send(self, method: str, url: str, *, timeout: float | None, **kwargs: Any) -> bytes:
        session = await self._opened()
        try:
            async with session.request(
                    method, url, headers=self._headers(kwargs.pop("headers", None)),
                    timeout=aiohttp.ClientTimeout(total=timeout or self._timeout), **kwargs) as resp:
                data = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise ConnectError(url, f"{method}: {type(exc).__name__}: {exc}") from exc
        if not 200 <= status < 300:
            raise _error_of(status, data, url)
        return data

    async def json(self, method: str, url: str, body: Any = None, *,
                   timeout: float | None = None) -> Any:
        """A JSON call; the decoded reply."""
        data = await self._send(method, url, timeout=timeout, json=body)
        try:
            return json.loads(data) if data else None
        except ValueError as exc:
            raise Unavailable(f"{url}: the reply is not JSON", url=url) from exc

    async def text(self, url: str, *, timeout: float | None = None) -> str:
        """A GET whose reply is text (a Prometheus exposition)."""
        return (await self._send("GET", url, timeout=timeout)).decode("utf-8", "replace")

    async def rpc(self, data_url: str, op: str, meta: dict, *, timeout: float | None = None) -> dict:
        """A data-plane call (``POST /v1/rpc/{op}`` in frames) carrying no arrays; the reply's meta."""
        url = f"{data_url}/v1/rpc/{op}"
        data = await self._send("POST", url, timeout=timeout,
                                data=frame.encode(frame.KIND_REQUEST, meta))
        return frame.decode(data, kinds=(frame.KIND_RESPONSE,)).meta

    async def download(self, url: str, path: Path, *, timeout: float = 600.0) -> None:
        """Stream ``url`` into ``path`` (fsynced); ``path`` is left only if everything arrived."""
        session = await self._opened()
        try:
            async with session.get(url, headers=self._headers(),
                                         timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                if resp.status != 200:
                    raise _error_of(resp.status, await resp.read(), url)
                with open(path, "wb") as f:
                    async for chunk in resp.content.iter_chunked(4 << 20):
                        f.write(chunk)
                    f.flush()
                    os.fsync(f.fileno())
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            path.unlink(missing_ok=True)
            raise ConnectError(url, f"GET: {type(exc).__name__}: {exc}") from exc
        except KvpsError:
            path.unlink(missing_ok=True)
            raise


def request(method: str, url: str, body: Any = None, *, token: str | None = None,
            timeout: float = 10.0, cafile: str | None = None, ssl: ssl_.SSLContext | None = None,
            data: bytes | None = None) -> bytes:
    """A blocking call (urllib) with a JSON ``body`` or raw ``data`` (if any): the reply's bytes,
    or the kvps error it stands for."""
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    if body is not None:
        data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    context = ssl if ssl is not None else (ssl_.create_default_context(cafile=cafile) if cafile else None)
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=context) as resp:
            return resp.read()
    except urllib.error.HTTPError as exc:
        raise _error_of(exc.code, exc.read(), url) from None
    except (urllib.error.URLError, OSError) as exc:
        raise ConnectError(url, str(getattr(exc, "reason", exc))) from exc


def request_json(method: str, url: str, body: Any = None, *, token: str | None = None,
                 timeout: float = 10.0, cafile: str | None = None,
                 ssl: ssl_.SSLContext | None = None) -> Any:
    """A blocking JSON call (urllib): the decoded reply, or the kvps error it stands for."""
    reply = request(method, url, body, token=token, timeout=timeout, cafile=cafile, ssl=ssl)
    try:
        return json.loads(reply) if reply else None
    except ValueError as exc:
        raise Unavailable(f"{url}: the reply is not JSON", url=url) from exc


def rpc(data_url: str, op: str, meta: dict, *, token: str | None = None, timeout: float = 10.0,
        ssl: ssl_.SSLContext | None = None) -> dict:
    """A blocking data-plane call carrying no arrays; the reply's meta."""
    reply = request("POST", f"{data_url}/v1/rpc/{op}", token=token, timeout=timeout, ssl=ssl,
                    data=frame.encode(frame.KIND_REQUEST, meta))
    return frame.decode(reply, kinds=(frame.KIND_RESPONSE,)).meta


def _error_of(status: int, data: bytes, url: str) -> KvpsError:
    try:
        body = json.loads(data)
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return error_from_dict(body)
    return Unavailable(f"{url}: HTTP {status}", url=url, status=status)
