"""``ResidentReplica``: a shard replica that lives in its node's process (``server.procs = 1``).

The first design ran every replica as an OS process of its own (``kvps.replica.main``). Here the
node's process hosts them all: one event loop serves every replica's data port (and the node's
admin API), and one ``kvps.raft.ticker.Ticker`` ticks every Raft group on one thread and one
poller, so an idle node wakes twenty times a second in total instead of twenty times per replica.

A replica that cannot follow its log (a snapshot it must restore is missing here) no longer exits
its process, which would take its siblings with it: it raises ``GroupHalted`` from apply, the
ticker stops that group before it applies anything more, and the node restarts this replica alone
from its journal and snapshot (``alive`` turns False; ``Node._supervise_once`` restarts it with
the same back-off as a crashed process). A crash of the process itself (a signal, the OOM killer,
a failed journal write) takes every replica of the node down at once, as a node crash always did.
"""
from __future__ import annotations

import asyncio
import logging
import os
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from kvps.config import ClusterConfig
from kvps.raft.ticker import GroupHalted, Ticker
from kvps.replica.dataplane import make_app
from kvps.replica.replica import Replica
from kvps.service.auth import TokenStore
from kvps.service.connections import ConnectionLimits

__all__ = ["ResidentReplica"]

log = logging.getLogger("kvps.replica")


def _halt(reason: str) -> None:
    """``Replica``'s ``fatal`` for a resident replica: stop its group where it is."""
    raise GroupHalted(reason)


class ResidentReplica:
    """One shard's replica in the node's process: the ``Replica``, its data site, its restarts.

    The same fields the node reads from a ``ReplicaProcess`` (``shard``, ``restarts``, ``status``,
    ``alive``, ``pid``, ``last_exit``), so the supervisor and the admin views treat both alike."""

    def __init__(self, cfg: ClusterConfig, node_id: int, shard: int, *, data_dir: Path, secret: bytes,
                 tokens: TokenStore, ticker: Ticker, server_ssl: ssl.SSLContext | None = None,
                 client_ssl: ssl.SSLContext | None = None) -> None:
        self.cfg = cfg
        self.node_id = node_id
        self.shard = shard
        self._data_dir = data_dir
        self._secret = secret
        self._tokens = tokens
        self._ticker = ticker
        self._server_ssl = server_ssl
        self._client_ssl = client_ssl
        self.replica: Replica | None = None
        self._runner: web.AppRunner | None = None
        self._starting: asyncio.Task | None = None
        self._closing: asyncio.Task | None = None
        self._on_down: Callable[["ResidentReplica", str], None] | None = None
        self._halted: str | None = None  # why it went down (until it is started again)
        self.restarts = 0
        self.backoff = 0.0
        self.next_start = 0.0
        self.started_at = time.monotonic()
        self.status: dict[str, Any] | None = None
        self.status_at = 0.0
        self.last_exit: str | None = None

    # -- what the node reads --------------------------------------------------------------------

    @property
    def ticker(self) -> Ticker:
        """The Raft ticker this replica's group runs on."""
        return self._ticker

    @property
    def alive(self) -> bool:
        return self.replica is not None and self._halted is None

    @property
    def busy(self) -> bool:
        """Starting or closing: the supervisor leaves it alone until that is done."""
        return any(t is not None and not t.done() for t in (self._starting, self._closing))

    @property
    def pid(self) -> int | None:
        return os.getpid() if self.alive else None

    def read_status(self) -> dict[str, Any] | None:
        """The replica's status, read in-process (no request): None while it is not serving."""
        if not self.alive or self._runner is None:
            return None
        return self.replica.status()

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self, *, peers: list[str], joining: bool, on_down: Callable[["ResidentReplica", str], None]) -> None:
        """Open the replica and its data site in the background. ``on_down(self, reason)`` (loop
        thread) once if it fails to open or its group halts later; the replica is closed then."""
        self._on_down = on_down
        self._halted = None
        self._starting = asyncio.create_task(self._open(peers, joining))
        self._starting.add_done_callback(self._opened)

    def _opened(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            self._down(f"failed to start: {type(exc).__name__}: {exc}")

    async def _open(self, peers: list[str], joining: bool) -> None:
        if self._closing is not None:  # the previous incarnation's ports and journal first
            await asyncio.gather(self._closing, return_exceptions=True)
        self.started_at = time.monotonic()
        loop = asyncio.get_running_loop()
        replica = await Replica.open(
            self.cfg, self.node_id, self.shard, secret=self._secret, data_dir=self._data_dir,
            token=self._tokens.admin_token, client_ssl=self._client_ssl, peers=peers, joining=joining,
            fatal=_halt, ticker=self._ticker,
            on_halted=lambda reason: loop.call_soon_threadsafe(self._down, f"halted: {reason}"))
        try:
            runner = await self._serve(replica)
        except BaseException:
            await replica.stop()
            raise
        if self._halted is not None:  # halted while its site was being set up: close both here
            await runner.cleanup()
            await replica.stop()
            return
        self._runner, self.replica = runner, replica
        log.info("node %d: replica of shard %d serving %s (in the node's process)", self.node_id,
                 self.shard, self.cfg.node(self.node_id).data_url(self.shard))

    async def _serve(self, replica: Replica) -> web.AppRunner:
        server = self.cfg.server
        limits = ConnectionLimits(idle_timeout=server.idle_timeout, per_peer=server.max_connections_per_peer,
                                  registry=replica.stats.metrics.registry, node=self.node_id,
                                  server=f"shard-{self.shard}")
        app = make_app(replica, self._tokens)
        app.middlewares.insert(0, limits.middleware)
        runner = web.AppRunner(app, access_log=None, **limits.runner_kwargs())
        await runner.setup()
        limits.install(runner)
        node = self.cfg.node(self.node_id)
        try:
            await web.TCPSite(runner, node.listen_host, node.data_port(self.shard), reuse_address=True,
                              ssl_context=self._server_ssl).start()
        except BaseException:
            await runner.cleanup()
            raise
        return runner

    def _down(self, reason: str) -> None:
        """It failed to start or its group halted (loop thread): close it, tell the node once."""
        if self._halted is not None:
            return
        self._halted = reason
        self.last_exit = reason
        self.status = None
        log.critical("node %d: replica of shard %d is down: %s", self.node_id, self.shard, reason)
        self._close()
        if self._on_down is not None:
            self._on_down(self, reason)

    def _close(self) -> asyncio.Task:
        """Detach the replica and its site now; close them in a task (awaited by ``stop``)."""
        runner, self._runner = self._runner, None
        replica, self.replica = self.replica, None
        previous = self._closing

        async def close() -> None:
            if previous is not None:
                await asyncio.gather(previous, return_exceptions=True)
            if runner is not None:
                await runner.cleanup()
            if replica is not None:
                await replica.stop()

        self._closing = asyncio.get_running_loop().create_task(close())
        return self._closing

    async def stop(self) -> None:
        """Stop serving and close the group (its journal is flushed). Idempotent."""
        if self._starting is not None:  # let it finish (a group being built cannot be cancelled)
            await asyncio.gather(self._starting, return_exceptions=True)
        self._on_down = None
        await self._close()
        self.status = None
