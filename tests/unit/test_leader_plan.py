"""Planning leadership transfers that spread leaders over the nodes (kvps.node.leaders)."""
from __future__ import annotations

import random

import pytest

from kvps.node.leaders import plan_spread, plan_transfer

SEEDS = range(40)


def spread(leaders: dict[int, int], members: dict[int, list[int]], active: list[int]) -> dict[int, int]:
    """Apply plan_transfer until it has nothing to do (bounded: it must end)."""
    leaders = dict(leaders)
    for _ in range(10 * len(leaders) + 10):
        path = plan_transfer(leaders, members, active)
        if not path:
            return leaders
        before = counts(leaders, active)
        sink = path[0][2]
        for shard, source, target in path:  # in order: no node but the sink ever leads more
            assert leaders[shard] == source and target in members[shard] and target != source
            leaders[shard] = target
            assert all(now <= was for n, now, was in zip(active, counts(leaders, active), before) if n != sink)
        after = counts(leaders, active)
        assert sum(c * c for c in after) < sum(c * c for c in before)
    raise AssertionError("plan_transfer did not settle")


def counts(leaders: dict[int, int], active: list[int]) -> list[int]:
    return [sum(1 for n in leaders.values() if n == a) for a in active]


@pytest.mark.parametrize("seed", SEEDS)
def test_round_robin_placements_end_with_every_node_within_one_of_fair(seed):
    rng = random.Random(seed)
    nodes = rng.randint(3, 7)
    shards = rng.randint(1, 40)
    members = {s: [(s + k) % nodes for k in range(3)] for s in range(shards)}
    leaders = {s: rng.choice(members[s]) for s in range(shards)}
    out = spread(leaders, members, list(range(nodes)))
    c = counts(out, list(range(nodes)))
    assert max(c) - min(c) <= 1, (seed, c)


def test_the_start_up_skew_seen_here_is_evened_out():
    # kvps up --nodes 3 --shards 8: six of eight leaders on node 0
    members = {s: [(s + k) % 3 for k in range(3)] for s in range(8)}
    leaders = {s: 0 for s in range(6)} | {6: 1, 7: 2}
    assert sorted(counts(spread(leaders, members, [0, 1, 2]), [0, 1, 2])) == [2, 3, 3]


def test_a_balanced_cluster_is_left_alone_and_ties_go_to_the_preferred_replica():
    members = {0: [0, 1, 2], 1: [1, 2, 0], 2: [2, 0, 1]}
    assert plan_transfer({0: 0, 1: 1, 2: 2}, members, [0, 1, 2]) == []
    assert plan_transfer({0: 1, 1: 1, 2: 1}, members, [0, 1, 2]) == [(0, 1, 0)]  # preferred, low shard


def test_a_leader_on_a_node_that_is_not_active_hands_over():
    members = {0: [0, 1, 2]}
    assert plan_transfer({0: 0}, members, [1, 2]) == [(0, 0, 1)]


@pytest.mark.parametrize("seed", SEEDS)
def test_one_round_of_transfers_ends_as_even_as_moving_one_at_a_time(seed):
    rng = random.Random(seed)
    nodes, shards = rng.randint(3, 6), rng.randint(1, 30)
    members = {s: [(s + k) % nodes for k in range(3)] for s in range(shards)}
    leaders = {s: rng.choice(members[s]) for s in range(shards)}
    plan = plan_spread(leaders, members, list(range(nodes)))
    assert len({s for s, _, _ in plan}) == len(plan)
    after = dict(leaders)
    for shard, source, target in plan:
        assert leaders[shard] == source and target in members[shard]
        after[shard] = target
    c = counts(after, list(range(nodes)))
    assert max(c) - min(c) <= 1, (seed, c)
