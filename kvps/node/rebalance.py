"""Moving shard replicas between nodes while the shard serves: one replica, one change at a time.

A move of shard ``s``'s replica from node ``source`` to node ``target``:

1. **place** the target: a new assignment lists ``target`` next to the current members; the
   target's node starts a replica that joins the group (``--join``, peers = the members);
2. **add** it to the Raft group through the leader (``membership`` RPC); the group now has
   4 members and commits with 3, so it keeps a majority while the newcomer is empty;
3. **catch up**: wait until the target has applied the leader's commit index as of the add
   (through log replay, or a snapshot install when the leader has compacted its log);
4. **lead elsewhere**: if the source leads, transfer leadership to another caught-up member
   (pysyncobj will not let a leader remove itself);
5. **remove** the source from the Raft group through the (new) leader;
6. **retire**: a new assignment without ``source``; its node stops the replica and deletes its
   data (it must never rejoin with a stale journal).

Every step is idempotent (re-adding a member or re-removing a non-member is a no-op), so a move
interrupted anywhere is finished by running it again with the same arguments. Pushes keep
flowing: a leader change answers pending pushes as unknown outcome, and clients retry them with
the same push id, which the replicated applied table deduplicates.

A replica of a node declared dead (``kvps/node/liveness.py``) is re-created the other way round:
the dead member is removed from the group (and the assignment) first, then the target is placed,
added and caught up (``Mover._replace`` says why).

Where assignments live is an ``AssignmentStore``: ``MetaStore``, the metadata Raft group
(kvps/meta.py), which every node follows. Moves run only in the ``Rebalancer`` on the metadata
leader, one at a time (``POST /v1/moves`` queues one; ``plan_move`` chooses the rest).

A draining node that runs a metadata replica hands it over last (``MetaMover``), with the same
steps on the metadata group itself: the target joins the member list (its node starts a replica
that joins the group), the leader adds it, waits until it has caught up, hands leadership away
if it is the source itself (the new leader's rebalancer finishes the move), removes the source,
and drops it from the member list (its node stops that replica).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol


from kvps.assignment import Assignment
from kvps.config import NodeConfig
from kvps.service.http import PeerClient
from kvps.errors import (
    InvalidRequest, KvpsError, RetryableError, Timeout,
)

__all__ = ["AssignmentStore", "MetaMover", "MetaStore", "MoveReport", "Mover", "Rebalancer"]

log = logging.getLogger("kvps.rebalance")

_POLL = 0.05


class AssignmentStore(Protocol):
    async def get(self) -> Assignment: ...

    async def put(self, new: Assignment) -> Assignment: ...


@dataclass
class MoveReport:
    shard: int
    source: int
    target: int
    seconds: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)  # phase -> seconds
    caught_up_index: int = 0
    leader_moved: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"shard": self.shard, "source": self.source, "target": self.target,
                "seconds": round(self.seconds, 3),
                "phases": {k: round(v, 3) for k, v in self.phases.items()},
                "caught_up_index": self.caught_up_index, "leader_moved": self.leader_moved}


class Mover:
    """Runs moves (see the module doc). ``nodes(id)`` gives a node's addresses."""

    def __init__(self, http: PeerClient, store: AssignmentStore, node: Callable[[int], NodeConfig], *,
                 timeout: float = 300.0) -> None:
        self.http = http
        self.store = store
        self.node = node
        self.timeout = timeout

    # ---- observation ----------------------------------------------------------------------

    async def status(self, node_id: int, shard: int) -> dict | None:
        try:
            return await self.http.json("GET", self.node(node_id).data_url(shard) + "/v1/status")
        except KvpsError:
            return None

    async def leader(self, shard: int, members: list[int], deadline: float) -> int:
        """The node whose replica of ``shard`` is the serving leader (waits for one)."""
        while True:
            statuses = await asyncio.gather(*(self.status(n, shard) for n in members))
            serving = [(st["term"], n) for n, st in zip(members, statuses) if st and st.get("serving")]
            if serving:
                return max(serving)[1]
            _check(deadline, f"a serving leader of shard {shard}")
            await asyncio.sleep(_POLL)

    async def _membership(self, shard: int, members: list[int], op: str, address: str,
                          deadline: float) -> dict:
        while True:
            leader = await self.leader(shard, members, deadline)
            try:
                return await self.http.rpc(self.node(leader).data_url(shard), "membership",
                                           {"op": op, "address": address})
            except RetryableError as exc:  # not the leader any more, or a change still pending
                log.info("shard %d: membership %s %s: %s; retrying", shard, op, address, exc)
            _check(deadline, f"shard {shard} membership {op} {address}")
            await asyncio.sleep(_POLL)

    # ---- the move ----------------------------------------------------------------------------

    async def move(self, shard: int, source: int, target: int, *, source_dead: bool = False) -> MoveReport:
        """Move ``shard``'s replica from ``source`` to ``target``. ``source_dead``: the source's
        node is declared dead, so it leaves the group first (``_replace``)."""
        report = MoveReport(shard, source, target)
        _last_said.clear()  # "still waiting" counts from this move's own waits
        started = time.monotonic()
        deadline = started + self.timeout
        mark = started

        def phase(name: str) -> None:
            nonlocal mark
            now = time.monotonic()
            report.phases[name] = now - mark
            mark = now

        if source_dead:
            await self._replace(shard, source, target, deadline, report, phase)
        else:
            await self._move(shard, source, target, deadline, report, phase)
        report.seconds = time.monotonic() - started
        log.info("shard %d: replica moved from node %d to node %d in %.2f s %s", shard, source,
                 target, report.seconds, report.to_json()["phases"])
        return report

    async def _move(self, shard: int, source: int, target: int, deadline: float, report: MoveReport,
                    phase: Callable[[str], None]) -> None:
        assignment = await self.store.get()
        nodes = list(assignment.nodes_of(shard))
        if source not in nodes and target in nodes:
            return  # done already
        if source not in nodes:
            raise InvalidRequest(f"shard {shard} has no replica on node {source}", field="source")
        members = await self._place(shard, target, deadline)  # 1. place the target
        phase("place")
        await self._add(shard, [n for n in members if n != target], target, deadline, report, phase)
        # 4. leadership away from the source
        rest = [n for n in members if n != source]
        while await self.leader(shard, members, deadline) == source:
            report.leader_moved = True
            for candidate in rest:
                try:
                    await self.http.rpc(self.node(source).data_url(shard), "membership",
                                        {"op": "transfer", "address": self.node(candidate).raft_address(shard)})
                except (RetryableError, InvalidRequest) as exc:
                    log.info("shard %d: transfer to node %d refused (%s)", shard, candidate, exc)
                    continue
                await self._wait_leader_not(shard, members, source, min(deadline, time.monotonic() + 3.0))
                break
            _check(deadline, f"leadership of shard {shard} to leave node {source}")
            await asyncio.sleep(_POLL / 5)
        phase("transfer")
        # 5. remove the source from the group
        await self._membership(shard, rest, "remove", self.node(source).raft_address(shard), deadline)
        phase("remove")
        await self._retire(shard, source)  # 6. retire it
        phase("retire")

    async def _replace(self, shard: int, dead: int, target: int, deadline: float, report: MoveReport,
                       phase: Callable[[str], None]) -> None:
        """Re-create a dead node's replica: remove it from the group first, then add the target.
        Adding first would make the newcomer part of every commit quorum (3 of 4 members with
        one dead) until it has caught up, stalling writes for as long as its copy takes; removed
        first, the two live replicas commit alone meanwhile, as they did since the node died."""
        nodes = list((await self.store.get()).nodes_of(shard))
        if dead in nodes:
            live = [n for n in nodes if n != dead]
            await self._membership(shard, live, "remove", self.node(dead).raft_address(shard), deadline)
            phase("remove")
            await self._retire(shard, dead)
            phase("retire")
        members = await self._place(shard, target, deadline)
        phase("place")
        await self._add(shard, [n for n in members if n != target], target, deadline, report, phase)

    async def _place(self, shard: int, target: int, deadline: float) -> list[int]:
        """A new assignment listing ``target`` for ``shard``; returns once its node runs the
        replica (which waits to be added). The shard's members, target included."""
        assignment = await self.store.get()
        nodes = list(assignment.nodes_of(shard))
        if target not in nodes:
            assignment = await self.store.put(assignment.with_shard(shard, nodes + [target]))
        while await self.status(target, shard) is None:
            _check(deadline, f"node {target} to start its replica of shard {shard}")
            await asyncio.sleep(_POLL)
        return list(assignment.nodes_of(shard))

    async def _add(self, shard: int, old: list[int], target: int, deadline: float, report: MoveReport,
                   phase: Callable[[str], None]) -> None:
        """Add ``target`` to the group through its leader (one of ``old``), then wait until it
        has applied everything committed as of the add."""
        added = await self._membership(shard, old, "add", self.node(target).raft_address(shard), deadline)
        commit = int(added["commit_index"])
        phase("add")
        while True:
            st = await self.status(target, shard)
            if st is not None and (st.get("applied_index") or 0) >= commit:
                report.caught_up_index = int(st["applied_index"])
                break
            _check(deadline, f"node {target}'s replica of shard {shard} to reach index {commit}")
            await asyncio.sleep(_POLL)
        phase("catch_up")

    async def _retire(self, shard: int, source: int) -> None:
        """A new assignment without ``source``: its node stops the replica and deletes its data."""
        assignment = await self.store.get()
        await self.store.put(assignment.with_shard(shard, [n for n in assignment.nodes_of(shard) if n != source]))

    async def _wait_leader_not(self, shard: int, members: list[int], source: int, until: float) -> None:
        while time.monotonic() < until:
            statuses = await asyncio.gather(*(self.status(n, shard) for n in members))
            if any(st and st.get("serving") and n != source for n, st in zip(members, statuses)):
                return
            await asyncio.sleep(_POLL / 2)


_last_said: dict[str, float] = {}


def _check(deadline: float, what: str) -> None:
    now = time.monotonic()
    if now > deadline:
        raise Timeout(f"timed out waiting for {what}")
    if now - _last_said.setdefault(what, now) > 10.0:  # say what a long wait is waiting for
        _last_said[what] = now
        log.info("still waiting for %s", what)


class MetaMover:
    """Moves a metadata replica (see the module doc); runs on the metadata leader."""

    def __init__(self, http: PeerClient, meta: Any, node: Callable[[int], NodeConfig], shards: int, *,
                 timeout: float = 300.0) -> None:
        self.http = http
        self.meta = meta
        self.node = node
        self.shards = shards
        self.timeout = timeout

    def _address(self, node_id: int) -> str:
        from kvps.meta import meta_address
        return meta_address(self.node(node_id), self.shards)

    async def _applied(self, node_id: int) -> int | None:
        """The applied index of ``node_id``'s own metadata replica, once it hears a leader."""
        try:
            view = await self.http.json("GET", self.node(node_id).admin_url + "/v1/meta")
        except KvpsError:
            return None
        raft = view.get("raft") or {}
        if raft.get("address") != self._address(node_id) or raft.get("leader") is None:
            return None
        return int(raft.get("applied_index") or 0)

    async def move(self, source: int, target: int) -> MoveReport | None:
        """The move's report, or None when this replica handed leadership away meanwhile (the
        new leader's rebalancer resumes the move: every step is idempotent)."""
        from kvps.raft.membership import change
        report = MoveReport(-1, source, target)
        _last_said.clear()
        started = mark = time.monotonic()
        deadline = started + self.timeout

        def phase(name: str) -> None:
            nonlocal mark
            now = time.monotonic()
            report.phases[name] = now - mark
            mark = now

        members = self.meta.state().meta_members
        if source not in members and target in members:
            return report  # done already
        if target not in members:  # 1. place: the target's node starts a joining replica
            members = sorted({*members, target})
            await self.meta.propose({"op": "set_meta_members", "members": members})
        phase("place")
        await _retry(lambda: change(self.meta.group, "add", self._address(target)), deadline,
                     f"metadata group add of node {target}")  # 2. add
        commit = int(self.meta.group.status()["commit_index"])
        phase("add")
        while ((await self._applied(target)) or 0) < commit:  # 3. catch up
            _check(deadline, f"node {target}'s metadata replica to reach index {commit}")
            await asyncio.sleep(_POLL)
        report.caught_up_index = commit
        phase("catch_up")
        if self.meta.address == self._address(source):  # 4. a leader cannot remove itself
            report.leader_moved = True
            await _retry(lambda: change(self.meta.group, "transfer", self._address(target)), deadline,
                         f"metadata leadership to node {target}")
            log.info("metadata: leadership handed to node %d; its rebalancer finishes the move", target)
            return None
        await _retry(lambda: change(self.meta.group, "remove", self._address(source)), deadline,
                     f"metadata group removal of node {source}")  # 5. remove
        phase("remove")
        await self.meta.propose({"op": "set_meta_members",  # 6. retire
                                 "members": [n for n in self.meta.state().meta_members if n != source]})
        phase("retire")
        report.seconds = time.monotonic() - started
        log.info("metadata replica moved from node %d to node %d in %.2f s %s", source, target,
                 report.seconds, report.to_json()["phases"])
        return report


async def _retry(call: Callable[[], Any], deadline: float, what: str) -> None:
    while True:
        try:
            return await call()
        except RetryableError as exc:  # REQUEST_DENIED while a change is pending, ...
            log.info("%s: %s; retrying", what, exc)
        _check(deadline, what)
        await asyncio.sleep(_POLL * 4)


class MetaStore:
    """Assignments in the metadata Raft group (``kvps.meta_service.MetaService``); used on its
    leader, whose applied state is current once a proposal returns."""

    def __init__(self, meta: Any) -> None:
        self.meta = meta

    async def get(self) -> Assignment:
        return self.meta.state().assignment

    async def put(self, new: Assignment) -> Assignment:
        await self.meta.propose({"op": "set_assignment", "assignment": new.to_json()})
        return new


class Rebalancer:
    """On the metadata leader: moves replicas one at a time until draining nodes host nothing and
    active nodes differ by at most one replica; marks drained nodes ``removed``. Progress is
    replicated (``rebalance`` in the metadata state), so every node shows it and a new leader
    resumes an interrupted move."""

    def __init__(self, meta: Any, mover: Mover, replicas: int, *, period: float = 0.5,
                 meta_mover: MetaMover | None = None, leaders: Any = None) -> None:
        self.meta = meta
        self.mover = mover
        self.leaders = leaders  # a kvps.node.leaders.LeaderBalancer, run when nothing moves
        self.meta_mover = meta_mover
        self.replicas = replicas
        self.period = period
        self.failures = 0  # consecutive failed steps (back-off)

    async def run(self) -> None:
        while True:
            try:
                if self.meta.is_leader():
                    await self.step()
            except KvpsError as exc:
                log.warning("rebalancer: %s; retrying", exc)
                await asyncio.sleep(min(30.0, 1.0 * 2 ** min(self.failures, 5)))
                self.failures += 1
            except Exception:  # a bug must not silently end rebalancing: log it, back off, go on
                log.exception("rebalancer: step failed; retrying")
                await asyncio.sleep(min(30.0, 1.0 * 2 ** min(self.failures, 5)))
                self.failures += 1
            await asyncio.sleep(self.period)

    async def step(self) -> bool:
        """One move, or one drained node marked removed; False when there was nothing to do."""
        from kvps.meta import LEAVING, plan_meta_move, plan_move
        state = self.meta.state()
        move = plan_move(state, self.replicas)
        meta_mover = self.meta_mover
        meta_move = plan_meta_move(state) if move is None and meta_mover is not None else None
        if meta_move is not None and meta_mover is not None:
            return await self._meta_step(meta_mover, state, *meta_move)
        if move is None:
            for node in state.nodes:
                if node["state"] in LEAVING and not state.assignment.shards_of(node["id"]) \
                        and node["id"] not in state.meta_members:
                    await self.meta.propose({"op": "set_node_state", "id": node["id"], "state": "removed"})
                    log.info("rebalancer: node %d %s and removed", node["id"],
                             "drained" if node["state"] == "draining" else "replaced (it was dead)")
                    return True
            if self.leaders is None or not state.rebalance.get("auto", True):
                return False  # POST /v1/rebalance {"auto": false} stops spreading leaders too
            return await self.leaders.step(state)
        shard, source, target = move
        done = int(state.rebalance.get("moves_done", 0))
        if not state.rebalance.get("moving"):
            await self.meta.propose({"op": "rebalance", "moving": {"shard": shard, "source": source,
                                                                   "target": target}})
        log.info("rebalancer: moving shard %d's replica from node %d to node %d", shard, source, target)
        try:
            report = await self.mover.move(shard, source, target,
                                           source_dead=state.nodes[source]["state"] == "dead")
        except InvalidRequest as exc:  # the move no longer makes sense (placement changed): drop it
            log.warning("rebalancer: dropping the move of shard %d from node %d to node %d: %s",
                        shard, source, target, exc)
            await self.meta.propose({"op": "rebalance", "moving": None, "last": {
                "shard": shard, "source": source, "target": target, "error": exc.message}})
            return True
        await self.meta.propose({"op": "rebalance", "moving": None, "moves_done": done + 1,
                                 "last": report.to_json()})
        self.failures = 0
        return True

    async def _meta_step(self, meta_mover: MetaMover, state: Any, source: int, target: int) -> bool:
        if not state.rebalance.get("moving"):
            await self.meta.propose({"op": "rebalance", "moving": {"meta": True, "source": source,
                                                                   "target": target}})
        log.info("rebalancer: moving the metadata replica from node %d to node %d", source, target)
        report = await meta_mover.move(source, target)
        if report is None:
            return True  # leadership moved away: the new leader goes on
        await self.meta.propose({"op": "rebalance", "moving": None,
                                 "moves_done": int(state.rebalance.get("moves_done", 0)) + 1,
                                 "last": {**report.to_json(), "meta": True}})
        self.failures = 0
        return True
