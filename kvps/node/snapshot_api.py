"""The node's snapshot endpoints and the snapshot schedule (wiring for ``kvps.snapshots``).

``GET /v1/snapshots`` (``?all=1`` also lists unfinished ones), ``POST /v1/snapshots``
(``{"label": ...}``), ``DELETE /v1/snapshots/{id}``, ``POST /v1/snapshots/{id}/restore``,
``POST /v1/snapshots/restore`` (``{"at": time}``: the newest at or before it). The list needs a
``read`` token, the others ``admin`` (checked by the admin app, ``kvps.node.access``). The schedule (``server.snapshot_every`` / ``snapshot_keep``) runs on the node that hosts
shard 0's serving leader, so exactly one node takes the scheduled snapshots at a time.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from aiohttp import web

from kvps.errors import InvalidRequest, KvpsError
from kvps.node.snapshots import SnapshotCoordinator, parse_time

__all__ = ["SnapshotService"]

log = logging.getLogger("kvps.snapshots")


class SnapshotService:
    def __init__(self, node: Any) -> None:
        self.node = node
        self._client: Any = None
        self._coordinator: SnapshotCoordinator | None = None
        self.last_error: str | None = None

    async def coordinator(self) -> SnapshotCoordinator:
        if self._coordinator is None:
            from kvps_client import Client  # the node talks to the shards like any client

            client = Client([self.node.cfg.node(self.node.node_id).admin_url], token=self.node.token,
                            ssl=self.node._client_ssl, timeout=60.0, request_timeout=30.0)
            await client.open()
            self._client = client
            self._coordinator = SnapshotCoordinator(client, hold=self.node.cfg.server.snapshot_hold)
        return self._coordinator

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    # ---- HTTP --------------------------------------------------------------------------------

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/v1/snapshots", self._guard(self._list))
        app.router.add_post("/v1/snapshots", self._guard(self._create))
        app.router.add_post("/v1/snapshots/restore", self._guard(self._restore_at))
        app.router.add_delete("/v1/snapshots/{id}", self._guard(self._drop))
        app.router.add_post("/v1/snapshots/{id}/restore", self._guard(self._restore))

    def _guard(self, handler):
        async def wrapped(request: web.Request) -> web.Response:
            try:
                return await handler(request)
            except KvpsError as exc:
                return web.json_response(exc.to_dict(), status=exc.http_status)
        return wrapped

    async def _body(self, request: web.Request) -> dict:
        if not request.can_read_body:
            return {}
        try:
            body = json.loads(await request.read() or b"{}")
        except ValueError:
            raise InvalidRequest("body must be JSON") from None
        if not isinstance(body, dict):
            raise InvalidRequest("body must be a JSON object")
        return body

    async def _list(self, request: web.Request) -> web.Response:
        c = await self.coordinator()
        snaps = await c.list(include_incomplete=request.query.get("all") in ("1", "true"))
        return web.json_response({"snapshots": snaps})

    async def _create(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        label = body.get("label", "")
        if not isinstance(label, str):
            raise InvalidRequest("label must be a string", field="label")
        c = await self.coordinator()
        snap = await c.create(label)
        keep = self.node.cfg.server.snapshot_keep
        if keep:
            await c.enforce_retention(keep)
        return web.json_response(snap, status=201)

    async def _drop(self, request: web.Request) -> web.Response:
        c = await self.coordinator()
        return web.json_response({"dropped": await c.drop(request.match_info["id"])})

    async def _restore(self, request: web.Request) -> web.Response:
        c = await self.coordinator()
        return web.json_response(await c.restore(snap_id=request.match_info["id"]))

    async def _restore_at(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        at = body.get("at")
        if isinstance(at, bool) or not isinstance(at, (int, float, str)):
            raise InvalidRequest("'at' must be a Unix time or an ISO 8601 time", field="at")
        c = await self.coordinator()
        return web.json_response(await c.restore(at=parse_time(str(at))))

    # ---- schedule ----------------------------------------------------------------------------

    def _leads_shard0(self) -> bool:
        rp = self.node.replicas.get(0)
        return bool(rp is not None and rp.status and rp.status.get("serving"))

    async def run_schedule(self) -> None:
        every = self.node.cfg.server.snapshot_every
        keep = self.node.cfg.server.snapshot_keep
        if every <= 0:
            return
        last: float | None = None
        while True:
            await asyncio.sleep(min(1.0, every / 4))
            if not self._leads_shard0():
                last = None  # another node schedules; re-read the catalog if we take over
                continue
            try:
                c = await self.coordinator()
                if last is None:
                    done = await c.list()
                    last = done[-1]["time"] if done else 0.0
                if time.time() - last < every:
                    continue
                snap = await c.create("scheduled")
                last = snap["time"]
                log.info("scheduled snapshot %s taken (%d bytes)", snap["id"], snap["size"])
                if keep:
                    dropped = await c.enforce_retention(keep)
                    if dropped:
                        log.info("retention (keep %d) dropped %s", keep, dropped)
                self.last_error = None
            except KvpsError as exc:
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.warning("scheduled snapshot failed: %s", self.last_error)
                last = time.time() - every + min(every, 10.0)  # retry in a while, not at once
