"""The node's snapshot endpoints and the snapshot schedule (wiring for ``kvps.snapshots``).

``GET /v1/snapshots`` (``?all=1`` also lists unfinished ones), ``POST /v1/snapshots``
(``{"label": ...}``), ``DELETE /v1/snapshots/{id}``, ``POST /v1/snapshots/{id}/restore``,
``POST /v1/snapshots/restore`` (``{"at": time}``: the newest at or before it). The list needs a
``read`` token, the others ``admin`` (checked by the admin app, ``kvps.node.access``). The schedule (``server.snapshot_every`` / ``snapshot_keep``) runs on the node that hosts
shard 0's serving leader, so exactly one node takes the scheduled snapshots at a time.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiohttp import web

from kvps.command import SNAPSHOT_ID
from kvps.errors import InvalidRequest, KvpsError
from kvps.node.admin import json_body
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
        """Token first; kvps errors are answered (and logged) by the admin app's middleware."""
        async def wrapped(request: web.Request) -> web.Response:
            return await handler(request)
        return wrapped

    @staticmethod
    def _snap_id(request: web.Request) -> str:
        snap_id = request.match_info["id"]
        if not SNAPSHOT_ID.match(snap_id):
            raise InvalidRequest(f"bad snapshot id {snap_id[:64]!r}", field="id")
        return snap_id

    async def _list(self, request: web.Request) -> web.Response:
        flag = request.query.get("all", "0")
        if flag not in ("0", "1", "false", "true"):
            raise InvalidRequest(f"all must be 1, true, 0 or false, not {flag[:32]!r}", field="all")
        c = await self.coordinator()
        snaps = await c.list(include_incomplete=flag in ("1", "true"))
        return web.json_response({"snapshots": snaps})

    async def _create(self, request: web.Request) -> web.Response:
        body = await json_body(request)
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
        snap_id = self._snap_id(request)  # a well-formed id that is not there: {"dropped": false}
        c = await self.coordinator()
        return web.json_response({"dropped": await c.drop(snap_id)})

    async def _restore(self, request: web.Request) -> web.Response:
        snap_id = self._snap_id(request)
        c = await self.coordinator()
        return web.json_response(await c.restore(snap_id=snap_id))

    async def _restore_at(self, request: web.Request) -> web.Response:
        body = await json_body(request)
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
