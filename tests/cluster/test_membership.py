"""Assignments (pure) and the pysyncobj internals kvps/raft/membership.py relies on."""
from __future__ import annotations

import inspect
import re

import pytest
from pysyncobj import SyncObj

from kvps.assignment import Assignment
from kvps.config import ClusterConfig, NodeConfig
from conftest import wait_for
from kvps.errors import InvalidRequest, KvpsError, VersionConflict


def src(obj) -> str:
    return re.sub(r"\s+", " ", inspect.getsource(obj))


def cfg(nodes: int = 4, shards: int = 4) -> ClusterConfig:
    return ClusterConfig(nodes=tuple(NodeConfig(id=i) for i in range(nodes)), shards=shards).validate()


def test_initial_assignment_is_the_config_placement():
    c = cfg()
    a = Assignment.initial(c)
    assert a.version == 0 and a.epochs == (0, 0, 0, 0)
    assert [list(a.nodes_of(s)) for s in range(4)] == [c.replica_nodes(s) for s in range(4)]
    assert a.shards_of(0) == c.shards_on(0)
    assert a.load([0, 1, 2, 3, 4]) == {0: 3, 1: 3, 2: 3, 3: 3, 4: 0}


def test_with_shard_bumps_version_and_that_shards_epoch_and_round_trips():
    a = Assignment.initial(cfg()).with_shard(1, [1, 2, 3, 0])
    assert a.version == 1 and a.epochs == (0, 1, 0, 0) and a.nodes_of(1) == (1, 2, 3, 0)
    assert Assignment.from_json(a.to_json()) == a
    with pytest.raises(InvalidRequest):
        a.with_shard(0, [1, 1, 2])
    with pytest.raises(InvalidRequest):
        Assignment.from_json({"version": 1, "shards": [{"id": 1, "nodes": [0]}]})


def test_pysyncobj_membership_internals_are_where_we_expect():
    init = src(SyncObj.__init__)
    # hold_elections() moves this deadline
    assert "self.__raftElectionDeadline = monotonicTime() + self.__generateRaftTimeout()" in init
    tick = src(SyncObj._onTick)
    assert "if self.__raftElectionDeadline < monotonicTime() and self.__connectedToAnyone():" in tick
    assert list(inspect.signature(SyncObj.addNodeToCluster).parameters) == ["self", "node", "callback"]
    assert list(inspect.signature(SyncObj.removeNodeFromCluster).parameters) == ["self", "node", "callback"]
    assert list(inspect.signature(SyncObj.transferLeadership).parameters) == ["self", "node", "callback"]
    change = src(SyncObj._SyncObj__doChangeCluster)
    # re-adding a member / removing a non-member or oneself is refused, not applied twice
    assert "if newNode == self.__selfNode or newNode in self.__otherNodes: return False" in change
    assert "if oldNode == self.__selfNode: return False" in change
    assert "if oldNode not in self.__otherNodes: return False" in change
    # a change is refused until the leader's no-op of its term is applied
    assert "if self.__raftLastApplied < self.__noopIDx: # No-op entry was not commited yet return False" \
        in src(SyncObj._SyncObj__changeCluster)


# ---- the metadata state machine and the rebalancing plan ----------------------------------------

from kvps.meta import MetaState, meta_address, plan_meta_move, plan_move  # noqa: E402


def settle(state: MetaState, replicas: int = 3, limit: int = 100) -> list[tuple[int, int, int]]:
    """Apply plan_move's moves (as the rebalancer would, in one step each) until it has none."""
    moves = []
    while (move := plan_move(state, replicas)) is not None:
        shard, source, target = move
        nodes = [target if n == source else n for n in state.assignment.nodes_of(shard)]
        assert state.apply({"op": "set_assignment",
                            "assignment": state.assignment.with_shard(shard, nodes).to_json()}).result["ok"]
        moves.append(move)
        assert len(moves) < limit
    return moves


def add_node(state: MetaState, port: int) -> int:
    return state.apply({"op": "add_node", "host": "127.0.0.1", "admin_port": port,
                        "port_base": port + 1, "scheme": "http"}).result["id"]


def test_join_is_idempotent_and_refuses_taken_ports():
    state = MetaState.initial(cfg(3, 8))
    assert add_node(state, 9000) == 3
    assert add_node(state, 9000) == 3  # a retried join gets its id back
    r = state.apply({"op": "add_node", "host": "127.0.0.1", "admin_port": 9100, "port_base": 9001,
                     "scheme": "http"}).result
    assert isinstance(r, KvpsError) and len(state.nodes) == 4
    assert isinstance(state.apply({"op": "nope"}).result, KvpsError)
    assert meta_address(cfg(3, 8).node(1), 8).endswith(":7216")


def test_growing_spreads_replicas_evenly_one_move_at_a_time():
    state = MetaState.initial(cfg(3, 8))  # 24 replicas on 3 nodes
    assert plan_move(state, 3) is None
    add_node(state, 9000), add_node(state, 9100)
    moves = settle(state)
    load = state.assignment.load(state.active_nodes())
    assert max(load.values()) - min(load.values()) <= 1 and sum(load.values()) == 24
    assert len(moves) == 9  # 24 over 5: the two new nodes take 5 and 4
    for s in range(8):  # never two replicas of a shard on one node
        assert len(set(state.assignment.nodes_of(s))) == 3


def test_draining_moves_every_replica_away_then_the_node_can_be_removed():
    state = MetaState.initial(cfg(3, 8))
    add_node(state, 9000), add_node(state, 9100)
    settle(state)
    assert isinstance(state.apply({"op": "set_node_state", "id": 4, "state": "removed"}).result, KvpsError)  # still hosts
    for n in (3, 4):
        assert state.apply({"op": "set_node_state", "id": n, "state": "draining"}).result["ok"]
    settle(state)
    assert state.assignment.shards_of(3) == state.assignment.shards_of(4) == []
    assert state.apply({"op": "set_node_state", "id": 4, "state": "removed"}).result["ok"]
    load = state.assignment.load([0, 1, 2])
    assert load == {0: 8, 1: 8, 2: 8}


def test_an_interrupted_move_is_resumed_first_and_stale_assignments_conflict():
    state = MetaState.initial(cfg(3, 8))
    add_node(state, 9000)
    state.apply({"op": "rebalance", "moving": {"shard": 5, "source": 0, "target": 3}, "moves_done": 2}).result
    assert plan_move(state, 3) == (5, 0, 3)
    stale = state.assignment.to_json()  # same version: does not follow the current one
    assert isinstance(state.apply({"op": "set_assignment", "assignment": stale}).result, VersionConflict)


def test_a_draining_metadata_node_hands_its_shards_over_first_then_its_metadata_replica():
    state = MetaState.initial(cfg(3, 4))
    add_node(state, 9000)
    settle(state)
    assert state.apply({"op": "set_node_state", "id": 0, "state": "draining"}).result["ok"]
    assert plan_meta_move(state) is None  # its shard replicas move first
    settle(state)
    assert state.assignment.shards_of(0) == [] and plan_move(state, 3) is None
    assert isinstance(state.apply({"op": "set_node_state", "id": 0, "state": "removed"}).result, KvpsError)  # still a member
    assert plan_meta_move(state) == (0, 3)
    state.apply({"op": "rebalance", "moving": {"meta": True, "source": 0, "target": 3}}).result
    assert plan_move(state, 3) is None and plan_meta_move(state) == (0, 3)  # resumed first
    # one change at a time: add the target, then drop the source
    assert isinstance(state.apply({"op": "set_meta_members", "members": [1, 2, 3]}).result, KvpsError)
    assert state.apply({"op": "set_meta_members", "members": [0, 1, 2, 3]}).result["ok"]
    assert state.apply({"op": "set_meta_members", "members": [1, 2, 3]}).result["ok"]
    state.apply({"op": "rebalance", "moving": None}).result
    assert plan_meta_move(state) is None and state.meta_members == [1, 2, 3]
    assert state.apply({"op": "set_node_state", "id": 0, "state": "removed"}).result["ok"]
    assert isinstance(state.apply({"op": "set_meta_members", "members": [0, 1, 2, 3]}).result, KvpsError)  # removed


def test_metadata_states_from_before_meta_members_restore_with_the_first_three():
    state = MetaState.initial(cfg(4, 4))
    data = state.to_json()
    del data["meta_members"]
    assert MetaState.from_json(data).meta_members == [0, 1, 2]


def test_meta_snapshot_round_trips_byte_identically():
    state = MetaState.initial(cfg(3, 8))
    add_node(state, 9000)
    settle(state)
    again = MetaState.restore(state.snapshot())
    assert again.snapshot() == state.snapshot() and again.version == state.version


def test_status_shows_node_states_and_rebalancing_progress():
    from kvps.cli.status import format_status
    cmap = {"nodes": [{"id": 0, "reachable": True, "state": "active"},
                      {"id": 1, "reachable": True, "state": "draining"},
                      {"id": 2, "reachable": False, "state": "removed"}],
            "shards": [{"id": 0, "leader": 0, "term": 3, "replicas": [
                {"node": 0, "role": "leader", "alive": True, "applied_index": 5}]}],
            "membership": {"rebalance": {"moving": {"shard": 0, "source": 1, "target": 0},
                                         "moves_done": 4}}}
    text = format_status(cmap).splitlines()
    assert text[-2] == "rebalance: moving shard 0's replica from node 1 to node 0; 4 moves done"
    assert text[-1].startswith("nodes: 0:up, 1:up (draining)    1/1 shards healthy")


# ---- the rebalancer's loop, against the real state machine and a fake mover -----------------

import asyncio  # noqa: E402
import copy  # noqa: E402

from kvps.node.rebalance import MoveReport, Rebalancer  # noqa: E402


class _Meta:
    def __init__(self, state: MetaState) -> None:
        self._state = state

    def state(self) -> MetaState:
        return copy.deepcopy(self._state)

    def is_leader(self) -> bool:
        return True

    async def propose(self, command: dict) -> dict:
        result = self._state.apply(copy.deepcopy(command)).result
        assert not isinstance(result, KvpsError), result
        return result


class _Mover:
    """Moves by rewriting the assignment, as a finished real move leaves it."""

    def __init__(self, meta: _Meta, refuse: bool = False) -> None:
        self.meta, self.refuse, self.moves, self.dead_sources = meta, refuse, [], []

    async def move(self, shard: int, source: int, target: int, *, source_dead: bool = False) -> MoveReport:
        self.dead_sources.append(source) if source_dead else None
        if self.refuse:
            raise InvalidRequest(f"shard {shard} has no replica on node {source}")
        a = self.meta.state().assignment
        nodes = [target if n == source else n for n in a.nodes_of(shard)]
        await self.meta.propose({"op": "set_assignment", "assignment": a.with_shard(shard, nodes).to_json()})
        self.moves.append((shard, source, target))
        return MoveReport(shard, source, target, seconds=0.1)


def test_rebalancer_grows_then_drains_and_removes_the_node():
    meta = _Meta(MetaState.initial(cfg(3, 4)))
    add_node(meta._state, 9000)
    mover = _Mover(meta)
    rebalancer = Rebalancer(meta, mover, replicas=3)

    async def run_until_idle() -> None:
        while await rebalancer.step():
            pass

    asyncio.run(run_until_idle())
    assert meta.state().assignment.load([0, 1, 2, 3]) == {0: 3, 1: 3, 2: 3, 3: 3}
    assert meta.state().rebalance["moves_done"] == len(mover.moves) == 3
    asyncio.run(meta.propose({"op": "set_node_state", "id": 3, "state": "draining"}))
    asyncio.run(run_until_idle())
    assert meta.state().nodes[3]["state"] == "removed" and meta.state().assignment.shards_of(3) == []
    assert meta.state().rebalance["moving"] is None


def test_rebalancer_drops_a_move_that_no_longer_makes_sense():
    meta = _Meta(MetaState.initial(cfg(3, 4)))
    add_node(meta._state, 9000)
    rebalancer = Rebalancer(meta, _Mover(meta, refuse=True), replicas=3)
    assert asyncio.run(rebalancer.step())
    rebalance = meta.state().rebalance
    assert rebalance["moving"] is None and "error" in rebalance["last"]


# ---- failure domains, dead nodes and the watch that declares them -----------------------------

def zoned(zones: list[str], shards: int) -> ClusterConfig:
    return ClusterConfig(nodes=tuple(NodeConfig(id=i, zone=z, admin_port=7100 + i, port_base=8000 + 100 * i)
                                     for i, z in enumerate(zones)), shards=shards).validate()


def domains_distinct(state: MetaState) -> bool:
    return all(len({state.domain(n) for n in nodes}) == len(nodes) for nodes in state.assignment.shards)


def test_zones_keep_each_shards_replicas_in_distinct_failure_domains():
    state = MetaState.initial(zoned(["a", "a", "b", "b", "c", "c"], 6))
    assert not domains_distinct(state)  # the config's placement ignores zones: shard 0 on 0, 1, 2
    settle(state)
    assert domains_distinct(state)
    load = state.assignment.load(state.active_nodes())
    assert max(load.values()) - min(load.values()) <= 1
    assert MetaState.initial(cfg(3, 2)).domain(1) == "node-1"  # no zone: a domain of its own


def test_zones_round_trip_through_the_config_file(tmp_path):
    import dataclasses

    from kvps.config import ServerConfig, dump_cluster, load_cluster
    c = zoned(["a", "b", ""], 2)
    c = dataclasses.replace(c, server=ServerConfig(node_dead_after=30.0))
    path = tmp_path / "cluster.toml"
    path.write_text(dump_cluster(c))
    back = load_cluster(path)
    assert [n.zone for n in back.nodes] == ["a", "b", ""] and back.server.node_dead_after == 30.0
    assert "zone" not in dump_cluster(cfg(3, 2))  # only where set


def test_a_dead_nodes_replicas_are_re_created_in_other_domains_then_it_is_removed():
    state = MetaState.initial(zoned(["a", "a", "b", "b", "c", "c"], 6))
    settle(state)
    hosted = state.assignment.shards_of(4)
    assert hosted and state.apply({"op": "set_node_state", "id": 4, "state": "dead"}).result["ok"]
    moves = settle(state)
    assert {m[0] for m in moves if m[1] == 4} == set(hosted) and moves[0][1] == 4  # the dead node first
    assert state.assignment.shards_of(4) == [] and domains_distinct(state)
    assert all(len(nodes) == 3 for nodes in state.assignment.shards)
    # dead is never undone: the node can only leave
    assert isinstance(state.apply({"op": "set_node_state", "id": 4, "state": "active"}).result, KvpsError)
    assert state.apply({"op": "set_node_state", "id": 4, "state": "removed"}).result["ok"]
    assert isinstance(state.apply({"op": "set_node_state", "id": 4, "state": "dead"}).result, KvpsError)


def test_a_dead_nodes_replica_with_nowhere_to_go_stays_rather_than_share_a_domain():
    state = MetaState.initial(zoned(["a", "b", "c", "c"], 4))
    settle(state)
    assert domains_distinct(state)
    state.apply({"op": "set_node_state", "id": 0, "state": "dead"})
    settle(state)  # zone a had only node 0: its replicas cannot go to b or c without sharing one
    assert state.assignment.shards_of(0) and domains_distinct(state)


def test_the_rebalancer_replaces_a_dead_nodes_replicas_remove_first_and_removes_it():
    meta = _Meta(MetaState.initial(cfg(4, 4)))
    hosted = meta.state().assignment.shards_of(3)
    asyncio.run(meta.propose({"op": "set_node_state", "id": 3, "state": "dead"}))
    mover = _Mover(meta)
    rebalancer = Rebalancer(meta, mover, replicas=3)

    async def run_until_idle() -> None:
        while await rebalancer.step():
            pass

    asyncio.run(run_until_idle())
    assert [m[0] for m in mover.moves] == hosted and mover.dead_sources == [3] * len(hosted)
    assert meta.state().nodes[3]["state"] == "removed"


class _Http:
    """Answers ``/healthz`` for every node but the silent ones."""

    def __init__(self, silent: set[int]) -> None:
        self.silent = silent

    async def text(self, url: str, *, timeout: float | None = None) -> str:
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        if port - 7100 in self.silent:
            from kvps.errors import ConnectError
            raise ConnectError(url, "connection refused")
        return "ok"


def _watch(state: MetaState, silent: set[int], dead_after: float):
    from kvps.node.liveness import NodeWatch
    meta = _Meta(state)
    c = cfg(len(state.nodes), len(state.assignment.shards))
    return meta, NodeWatch(meta, _Http(silent), lambda n: NodeConfig(id=n, admin_port=7100 + n), 0,
                           dead_after=dead_after, replicas=c.replicas, period=0.05)


def test_the_node_watch_declares_a_silent_node_dead_after_node_dead_after():
    import time
    meta, watch = _watch(MetaState.initial(cfg(4, 4)), {3}, dead_after=0.5)
    started = time.monotonic()
    assert asyncio.run(watch.check()) == []  # the first silence starts the count
    declared = wait_for(lambda: asyncio.run(watch.check()), 10, "node 3 to be declared dead")
    assert declared == [3] and time.monotonic() - started >= 0.5
    assert meta.state().nodes[3]["state"] == "dead"
    assert [n["state"] for n in meta.state().nodes[:3]] == ["active"] * 3  # the others answer
    assert asyncio.run(watch.check()) == []  # a dead node is no longer watched


def test_the_node_watch_leaves_a_node_whose_replicas_have_nowhere_to_go():
    import time
    meta, watch = _watch(MetaState.initial(cfg(3, 4)), {2}, dead_after=0.2)
    deadline = time.monotonic() + 0.6
    while time.monotonic() < deadline:  # well past dead_after: three nodes, nowhere to re-create
        assert asyncio.run(watch.check()) == []
    assert meta.state().nodes[2]["state"] == "active" and watch.unreachable()[2] >= 0.2


def test_a_node_records_its_own_zone():
    state = MetaState.initial(cfg(3, 2))
    assert state.apply({"op": "set_zone", "id": 1, "zone": "eu-1b"}).result["ok"] and state.domain(1) == "eu-1b"
    assert state.apply({"op": "set_zone", "id": 1, "zone": ""}).result["ok"] and state.domain(1) == "node-1"
    for bad in ({"id": 9, "zone": "a"}, {"id": 1, "zone": 3}, {"id": 1, "zone": "z" * 65}):
        assert isinstance(state.apply({"op": "set_zone", **bad}).result, KvpsError)


def test_with_uneven_zones_the_load_is_as_even_as_the_zones_allow():
    # zone c has one node: it must hold a replica of every shard; a and b share theirs evenly
    state = MetaState.initial(zoned(["a", "b", "c"], 4))
    for port, zone in ((9000, "a"), (9100, "b")):
        n = add_node(state, port)
        assert state.apply({"op": "set_zone", "id": n, "zone": zone}).result["ok"]
    settle(state)
    assert domains_distinct(state)
    assert state.assignment.load(state.active_nodes()) == {0: 2, 1: 2, 2: 4, 3: 2, 4: 2}


def test_a_replacement_makes_a_dead_or_removed_node_active_again_and_nothing_else_does():
    state = MetaState.initial(cfg(4, 4))
    for n in range(4):
        state.apply({"op": "set_incarnation", "id": n, "incarnation": f"old-{n}"})
    state.apply({"op": "set_node_state", "id": 3, "state": "dead"})
    settle(state)
    assert state.apply({"op": "set_node_state", "id": 3, "state": "removed"}).result["ok"]
    # the same incarnation again (the old disk back): refused by the identity check, stays removed
    assert isinstance(state.apply({"op": "set_incarnation", "id": 3, "incarnation": "other"}).result, KvpsError)
    assert state.apply({"op": "set_incarnation", "id": 3, "incarnation": "old-3"}).result["ok"]
    assert state.nodes[3]["state"] == "removed"
    # kvps node --replace: a new incarnation naming the old one
    assert state.apply({"op": "set_incarnation", "id": 3, "incarnation": "new-3", "replaces": "old-3"}).result["ok"]
    assert state.nodes[3]["state"] == "active"
    settle(state)
    assert state.assignment.shards_of(3)  # replicas are placed on it again
