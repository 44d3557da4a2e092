"""Which nodes are gone for good: the metadata leader's watch that declares a node ``dead``.

Every ``period`` seconds the metadata leader asks each active or draining node's admin port for
``/healthz``. A node that has not answered for ``server.node_dead_after`` seconds (default 10
minutes) is declared ``dead`` in the metadata state; the rebalancer then re-creates its replicas on
live nodes, one move at a time, in failure domains the shard does not use yet
(``kvps.meta.plan_move``), and marks it ``removed`` once it hosts nothing.

Time here is the leader's monotonic clock, counted from when this replica became leader: a new
leader gives every node the full ``node_dead_after`` again, and no wall-clock jump can make a node
look dead. A node is declared dead only when it hosts nothing or at least one of its replicas has
somewhere to go: in a three-node cluster an unreachable node stays what it is (there is nowhere to
re-create its replicas, and declaring it dead would only make it leave when it comes back); once a
node joins, the watch declares it and the rebalancer re-creates its replicas there.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from kvps.errors import KvpsError
from kvps.meta import MetaState, plan_move

__all__ = ["NodeWatch"]

log = logging.getLogger("kvps.liveness")


class NodeWatch:
    def __init__(self, meta: Any, http: Any, node: Callable[[int], Any], self_id: int, *,
                 dead_after: float, replicas: int, period: float = 5.0) -> None:
        self.meta = meta
        self.http = http
        self.node = node  # node id -> NodeConfig
        self.self_id = self_id
        self.dead_after = dead_after
        self.replicas = replicas
        # a tenth of the verdict's time at most (a node is declared dead between dead_after and a
        # period less after its last answer); 5 s for the default 10 minutes (each probe is an
        # HTTP request per node: every second they were a tenth of an idle cluster's CPU here)
        self.period = min(period, dead_after / 10)
        self.last_answer: dict[int, float] = {}  # node id -> monotonic time of its last answer
        self._said: set[int] = set()  # nodes whose "nowhere to go" was logged

    async def run(self) -> None:
        while True:
            try:
                if self.meta.is_leader():
                    await self.check()
                else:  # a later term's leader starts counting afresh
                    self.last_answer.clear()
            except KvpsError as exc:  # no quorum for the proposal, say: try again next period
                log.warning("node watch: %s", exc)
            except Exception:  # a bug must not silently end the watch: log it, go on
                log.exception("node watch: check failed")
            await asyncio.sleep(self.period)

    def unreachable(self) -> dict[int, float]:
        """Seconds since each node that did not answer its last probe last answered."""
        now = time.monotonic()
        return {n: round(now - t, 1) for n, t in self.last_answer.items() if now - t > self.period * 2}

    async def check(self) -> list[int]:
        """One round of probes; the nodes declared dead in it."""
        state: MetaState = self.meta.state()
        watched = [n["id"] for n in state.nodes
                   if n["state"] in ("active", "draining") and n["id"] != self.self_id]
        answers = await asyncio.gather(*(self._answers(n) for n in watched))
        now = time.monotonic()
        declared = []
        for node_id, answered in zip(watched, answers):
            if answered:
                self.last_answer[node_id] = now
                self._said.discard(node_id)
                continue
            silent = now - self.last_answer.setdefault(node_id, now)
            if silent < self.dead_after:
                continue
            if not _has_somewhere_to_go(state, node_id, self.replicas):
                if node_id not in self._said:
                    self._said.add(node_id)
                    log.warning("node %d has not answered for %.0f s, but no live node can take its "
                                "replicas (in a failure domain its shards do not use): it is not "
                                "declared dead until one can", node_id, silent)
                continue
            await self.meta.propose({"op": "set_node_state", "id": node_id, "state": "dead"})
            log.warning("node %d has not answered for %.0f s (node_dead_after %.0f s): declared dead; "
                        "its replicas are re-created on live nodes", node_id, silent, self.dead_after)
            declared.append(node_id)
            state = self.meta.state()
        return declared

    async def _answers(self, node_id: int) -> bool:
        try:
            await self.http.text(self.node(node_id).admin_url + "/healthz", timeout=min(2.0, self.period * 2))
            return True
        except KvpsError:
            return False


def _has_somewhere_to_go(state: MetaState, node_id: int, replicas: int) -> bool:
    """Whether declaring ``node_id`` dead would move anything (or it hosts nothing)."""
    if not state.assignment.shards_of(node_id):
        return True
    trial = MetaState.from_json(state.to_json())
    trial.nodes[node_id]["state"] = "dead"
    move = plan_move(trial, replicas)
    return move is not None and move[1] == node_id
