"""When a replica may serve writes and leader reads: the new-leader barrier and write holds.

A replica that becomes leader first commits a ``Barrier`` of its own term and serves only once it
has applied it. By then every entry that can ever commit from earlier terms is applied here, so the
duplicate check before merging sees all of them (DESIGN §3). A replica that steps down answers its
pending proposals as unknown outcome (clients retry them with the same push id). While leadership
is handed to another member (``kvps.replica.membership``), writes are held: the target must have
every entry for pysyncobj to grant the transfer and for it to win. A leader that reaches fewer
than a majority of its members (cut off, until it steps down a leader-fallback timeout later)
answers ``NoQuorum`` at once: the client tries another replica instead of waiting for a commit
that cannot come.

Everything here runs on the replica's event loop.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from kvps.command import Barrier
from kvps.config import ClusterConfig
from kvps.errors import KvpsError, NoQuorum, NotLeader, Unavailable
from kvps.raft.group import ShardGroup

__all__ = ["Leadership"]

log = logging.getLogger("kvps.replica")


class Leadership:
    def __init__(self, cfg: ClusterConfig, shard: int, address: str, group: ShardGroup, *,
                 propose: Callable[[bytes], Awaitable[Any]],
                 wait_applied: Callable[[float], Awaitable[None]],
                 not_leader: Callable[[], NotLeader],
                 on_hold: Callable[[], None] | None = None) -> None:
        self._cfg = cfg
        self._shard = shard
        self._address = address
        self._group = group
        self._propose = propose
        self._wait_applied = wait_applied
        self._not_leader = not_leader
        self._serving_term = -1  # term whose barrier this replica has applied as leader
        self._writes_held_until = 0.0
        self._on_hold = on_hold  # told when writes are held (the mirror's lease ends then)
        self._barrier_task: asyncio.Task | None = None
        self.changes = 0  # role changes seen

    def serving(self, term: int) -> bool:
        """Whether this replica leads ``term`` and has applied its barrier."""
        return self._serving_term == term

    def role_changed(self, role: str) -> None:
        self.changes += 1
        log.info("shard %d replica %s is now %s (term %d)", self._shard, self._address, role,
                 self._group.term())
        if role == "leader":
            self._start_barrier()
            return
        abandoned = self._group.abandon_pending()
        if abandoned:
            log.info("shard %d: stepped down with %d proposals pending; answered as unknown "
                     "outcome (clients retry, deduplicated)", self._shard, abandoned)

    def hold_writes(self, seconds: float) -> None:
        """Answer writes and leader reads with ``Unavailable`` (clients retry) for ``seconds``."""
        self._writes_held_until = time.monotonic() + seconds
        if seconds > 0 and self._on_hold is not None:
            self._on_hold()

    def may_serve_reads(self) -> bool:
        """What ``ensure_serving`` checks, without waiting: leads, has applied its barrier, and
        holds no writes (any thread: the shared-memory mirror's lease is renewed on the tick)."""
        if time.monotonic() < self._writes_held_until or not self._group.is_leader():
            return False
        return self.serving(self._group.term())

    async def ensure_serving(self) -> None:
        """Return once this replica is the leader and has applied its barrier."""
        if time.monotonic() < self._writes_held_until:
            raise Unavailable("leadership is being handed to another replica", shard=self._shard)
        server, raft = self._cfg.server, self._cfg.raft
        deadline = time.monotonic() + server.barrier_wait
        # Hold a request about one election long when no leader is known: a replica cut off from
        # its peers never learns one, and the client should move on to another replica.
        hold_until = time.monotonic() + min(server.barrier_wait, 1.5 * raft.election_timeout_max)
        while True:
            if not self._group.is_leader():
                if not self._group.leader_reachable() and time.monotonic() < hold_until:
                    # An election is under way, or our leader's connection just dropped (it may be
                    # dead: a new one is then elected within ~0.1 s): hold the request until it is
                    # decided, so the client learns the new leader from our hint instead of
                    # chasing a dead one and backing off blindly.
                    await asyncio.sleep(0.01)
                    continue
                raise self._not_leader()
            connected, members = self._group.quorum()
            if connected < members // 2 + 1:  # a partitioned leader: nothing it proposes commits
                raise NoQuorum(self._shard, connected, members)
            if self.serving(self._group.term()):
                return
            self._start_barrier()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise Unavailable("new leader has not applied its barrier yet", shard=self._shard)
            await self._wait_applied(remaining)

    def stop(self) -> None:
        if self._barrier_task is not None:
            self._barrier_task.cancel()

    def _start_barrier(self) -> None:
        if self._barrier_task is None or self._barrier_task.done():
            self._barrier_task = asyncio.get_running_loop().create_task(self._commit_barrier())

    async def _commit_barrier(self) -> None:
        """Commit a Barrier of our term; once applied, serve writes and leader reads."""
        while self._group.is_leader():
            term = self._group.term()
            if self._serving_term == term:
                return
            try:
                await self._propose(Barrier(term=term, replica=self._address).to_bytes())
            except KvpsError as exc:
                log.info("shard %d: barrier for term %d failed (%s); retrying", self._shard, term, exc)
                await asyncio.sleep(self._cfg.raft.heartbeat_period)
                continue
            if self._group.term() == term and self._group.is_leader():
                self._serving_term = term
                log.info("shard %d: leader of term %d is serving", self._shard, term)
