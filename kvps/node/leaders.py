"""Leaders spread over the nodes: every active node leads ``shards / nodes`` shards, ±1.

Whoever wins an election leads, so right after ``kvps up --nodes 3 --shards 8`` six of the eight
leaders sat on one node here, and that node did nearly all the leader work (merging pushes,
applying the optimizer, replicating) while the others idled. The rebalancer on the metadata
leader, when no replica move is pending, runs one ``LeaderBalancer.step`` per period:

1. read every node's view of its replicas (``GET /v1/node``, one request per node: a node reads
   its replicas' status in its own process, or polls its replica processes, anyway); do nothing
   while the cluster is unsettled: a shard without a serving leader, or any leader change in the
   last ``settle`` seconds (a failover settling, a move's own transfer). (One status request per
   replica, 24 every 2 s for 3 nodes x 8 shards, was a sixth of an idle cluster's CPU here.)
2. ``plan_transfer`` finds one move of leadership from a node that leads at least two more shards
   than another (a path of transfers through shards' members when the two share no shard),
   preferring the placement's preferred replica;
   ``plan_spread`` repeats it to the end and asks for all those transfers at once (one per
   shard), so a skewed cluster is even after one round of elections;
3. each leader is asked to transfer (Raft's TimeoutNow through pysyncobj's ``transferLeadership``,
   the same ``membership`` RPC moves use), which pysyncobj grants only when the target has
   acknowledged the whole log, so no write is lost and the pause is one election.

Then the settle time again; a shard's writes pause at most once per round.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from kvps.errors import InvalidRequest, KvpsError, RetryableError

__all__ = ["LeaderBalancer", "plan_spread", "plan_transfer"]

log = logging.getLogger("kvps.rebalance")


def plan_transfer(leaders: dict[int, int], members: dict[int, list[int]],
                  active: list[int]) -> list[tuple[int, int, int]]:
    """Transfers ``[(shard, from node, to node), ...]`` that move one unit of leadership from a
    node leading ``c`` shards to one leading at most ``c - 2``, or ``[]`` when no such move
    exists. The two may share no shard, so the move is a path: each hop hands a shard to a member
    node that then hands another one on, and the nodes in between keep their counts. Each move
    lowers the sum of squared leader counts, so repeating it ends, with the counts as even as the
    placement allows (``shards / nodes`` ±1 for an even placement). A leader on a node that is
    not active (draining) is handed over first. ``members``: shard -> its nodes, preferred first
    (ties go to the preferred replica). Hops are listed last first: executed in order, no node
    on the path ever leads more than it does now."""
    count = {n: 0 for n in active}
    for node in leaders.values():
        if node in count:
            count[node] += 1
    led: dict[int, list[int]] = {}
    for shard in sorted(leaders):
        led.setdefault(leaders[shard], []).append(shard)
    for shard in sorted(leaders):  # inactive leaders first: to the least loaded member
        if leaders[shard] not in count:
            targets = [(count[t], rank, t) for rank, t in enumerate(members.get(shard, [])) if t in count]
            if targets:
                return [(shard, leaders[shard], min(targets)[2])]
    for source in sorted(count, key=lambda n: (-count[n], n)):
        # breadth first over "a shard led by u has v as a member": the shortest path to a node
        # with at most count[source] - 2
        via: dict[int, tuple[int, int]] = {source: (-1, -1)}
        frontier = [source]
        while frontier:
            nxt = []
            for u in frontier:
                for shard in led.get(u, []):
                    for v in members.get(shard, []):
                        if v in via or v not in count:
                            continue
                        via[v] = (u, shard)
                        if count[v] <= count[source] - 2:
                            path, node = [], v
                            while node != source:
                                u_, shard_ = via[node]
                                path.append((shard_, u_, node))
                                node = u_
                            return path  # last hop first
                        nxt.append(v)
            frontier = nxt
    return []


def plan_spread(leaders: dict[int, int], members: dict[int, list[int]],
                active: list[int]) -> list[tuple[int, int, int]]:
    """Every transfer to the end of ``plan_transfer``'s moves, at most one per shard (its first
    leader to its last): issued together, the cluster is even after one round of elections."""
    now, first = dict(leaders), {}
    for _ in range(4 * len(leaders) + 4):  # each move lowers a bounded sum: this always suffices
        path = plan_transfer(now, members, active)
        if not path:
            break
        for shard, _source, target in path:
            first.setdefault(shard, leaders[shard])
            now[shard] = target
    return [(s, first[s], now[s]) for s in sorted(first) if now[s] != first[s]]


class LeaderBalancer:
    """``step()`` once per rebalancer period on the metadata leader (see the module docstring).
    ``mover`` gives ``node(id)`` and ``http`` (``kvps.node.rebalance``)."""

    def __init__(self, mover: Any, *, settle: float = 5.0, every: float = 2.0,
                 clock: Any = time.monotonic) -> None:
        self.mover = mover
        self.settle = settle
        self.every = every  # between looks at the leaders (one status request per replica)
        self.clock = clock
        self._looked_at = float("-inf")
        self.transfers = 0
        self._seen: dict[int, tuple[int, int]] = {}  # shard -> (leader node, term) last seen
        self._changed_at = clock()

    async def step(self, state: Any) -> bool:
        """True when a transfer was asked for."""
        if self.clock() - self._looked_at < self.every:
            return False
        self._looked_at = self.clock()
        assignment = state.assignment
        active = [n["id"] for n in state.nodes if n["state"] == "active"]
        shards = range(len(assignment.shards))
        members = {s: list(assignment.nodes_of(s)) for s in shards}
        hosts = sorted({n for s in shards for n in members[s]})
        views = await asyncio.gather(*(self._replicas_of(n) for n in hosts))
        seen = {(n, r.get("shard")): r for n, view in zip(hosts, views) for r in view}
        leaders: dict[int, int] = {}
        for s in shards:
            serving = [(st["term"], n) for n in members[s]
                       if (st := seen.get((n, s))) and st.get("serving") and isinstance(st.get("term"), int)]
            if not serving:
                return False  # an election in progress: not settled
            term, leaders[s] = max(serving)
            if self._seen.get(s) != (leaders[s], term):
                self._seen[s] = (leaders[s], term)
                self._changed_at = self.clock()
        if self.clock() - self._changed_at < self.settle:
            return False
        path = plan_spread(leaders, members, active)
        for shard, source, target in path:
            try:
                await self.mover.http.rpc(self.mover.node(source).data_url(shard), "membership",
                                          {"op": "transfer", "address": self.mover.node(target).raft_address(shard)})
            except (RetryableError, InvalidRequest) as exc:  # not caught up yet, or leadership moved
                log.info("leaders: shard %d's transfer from node %d to node %d refused (%s)", shard,
                         source, target, exc)
                break
            except KvpsError as exc:
                log.warning("leaders: shard %d's transfer failed: %s", shard, exc)
                break
            self.transfers += 1
            log.info("leaders: shard %d's leadership from node %d to node %d (spreading leaders)",
                     shard, source, target)
        self._changed_at = self.clock()
        return bool(path)

    async def _replicas_of(self, node_id: int) -> list[dict[str, Any]]:
        """The replicas ``GET /v1/node`` of that node lists ([] when it does not answer)."""
        try:
            view = await self.mover.http.json("GET", self.mover.node(node_id).admin_url + "/v1/node",
                                              timeout=1.0)
        except KvpsError:
            return []
        replicas = view.get("replicas") if isinstance(view, dict) else None
        return [r for r in replicas if isinstance(r, dict)] if isinstance(replicas, list) else []
