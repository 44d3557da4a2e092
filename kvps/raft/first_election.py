"""A brand-new group's first election, stood for by the replica the placement prefers.

pysyncobj starts every replica with an election deadline one random election timeout away (1-2 s
by default), so a cluster that ``kvps up`` just started served nothing for that long, and whoever
won first led: right after start-up most leaders could sit on one node, until the leader
balancer (``kvps.node.leaders``) moved them, one settle period later, with one more election per
shard moved. ``stand_first`` lets the placement's preferred replica of a group that has never
elected anyone (term 0, only pysyncobj's initial entry in its log) stand as soon as it is
connected to a majority of its members: the group serves once its processes are up, led where
the placement spread the leaders.

Why it is safe: it only moves this replica's election deadline nearer, once, which an election
timeout running out does anyway; the pre-vote round (``kvps.raft.prevote``) and pysyncobj's own
election follow unchanged, so Raft's safety (one leader per term, committed entries kept) is
untouched. A member that already hears a leader refuses the pre-vote; a replica that is not fresh
(it has a term, or entries), that recovers lost data (it stands for nothing until caught up,
``kvps.raft.recovery``) or never gets connected to a majority within ``window`` seconds
just keeps pysyncobj's deadline. Replicas that join a running group never stand first (their
callers hold their elections back instead, ``kvps.raft.membership``).

Runs as a tick callback, on the group's tick thread; uses ``__raftElectionDeadline`` and
``__raftCurrentTerm`` through ``kvps.raft.internals`` and pysyncobj's public ``isNodeConnected``.
"""
from __future__ import annotations

from typing import Any

from pysyncobj.monotonic import monotonic

from kvps.raft import internals

__all__ = ["stand_first"]


def stand_first(group: Any, window: float = 30.0) -> None:
    """Have ``group`` (a fresh replica the placement prefers) stand for its first election as soon
    as it is connected to a majority of its members; installed before the group starts ticking."""
    group.addOnTickCallback(_FirstElection(group, monotonic() + window))


class _FirstElection:
    def __init__(self, group: Any, until: float) -> None:
        self._group = group
        self._until = until
        self._done = False

    def __call__(self) -> None:
        if self._done:
            return
        group = self._group
        if (internals.current_term(group) != 0 or internals.last_log_index(group) > 1
                or internals.leader(group) is not None or getattr(group, "recovering", False)
                or monotonic() > self._until):
            self._done = True  # not fresh any more, or it took too long: pysyncobj's timer rules
            return
        others = list(group.otherNodes)
        connected = sum(1 for node in others if group.isNodeConnected(node))
        if 2 * (connected + 1) > len(others) + 1:
            self._done = True
            internals.set_election_deadline(group, min(internals.election_deadline(group), monotonic()))
