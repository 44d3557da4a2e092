"""Fast failover: elect a new leader ~0.1 s after the leader's *process* dies, not after a full
election timeout.

A follower learns nothing from silence before its election timeout (``raft.election_timeout_min``
to ``_max``) runs out. But a process that dies (``kill -9``, a crash, a stop) has its sockets
closed by its kernel: its peers' connections to it end at once (EOF or reset), and its Raft port
refuses new connections. The transport reports exactly that combination for a member
(``make_transport_class(on_peer_gone=...)``: the peer's kernel ended an authenticated connection,
then a bare connect to its port was refused). A follower told so about the leader it follows moves
its election deadline to a short delay, staggered by address among the survivors.

What does not trigger it: a partition or a slow leader (connections go silent, nothing is closed:
the election timeout decides, as before); connections the transport closes itself (idle timeout,
a rejected frame, a reconnect replacing a connection); a live leader that closes a connection
(its idle timeout, a rejected frame, our removal from the group): it still listens, the probe
connects, no report.

Why it is safe: Raft's safety (at most one leader per term, committed entries never lost) does not
depend on timing: a vote is granted once per term and only to a candidate whose log is at least as
up to date, whatever the timeouts. Timeouts only decide availability. The worst a wrong report can
do is start one election early, as an election timeout on a loaded machine does; a live old leader
then steps down on the higher term and the group elects again.

Why it does not make elections more frequent:
* only a report about the leader this replica follows counts (``leader_address()`` is the lost
  peer: so this replica is a follower, and has not started an election since); one report per
  lost connection, and a dead process does not reconnect;
* the report only sets the deadline (``schedule_election``): anything pysyncobj does afterwards
  wins as usual (an append from a leader, or a vote it grants, resets it to a full timeout).

PreVote (``kvps.raft.prevote``) is bypassed for this election: the survivors heard the leader
well within the minimum election timeout and would refuse the pre-vote, and a cut or a paused
process closes no connection and refuses no connect, so it cannot take this path.

Why the survivors do not split the vote: the k-th of them by address stands after
``stagger * (k + U(0, 1/4))`` (``election_delay``), so the first candidate's vote request has at
least 3/4 of a stagger to reach the others before their turn (the default, 0.15 s, is for a loaded
2-core machine, where 0.1 s was seen to be too little for a busy replica to handle it). That is
why the deadline is *set*, not only moved earlier: a later survivor whose own timeout was about to
run out anyway would otherwise stand together with the first one (seen in the B3 benchmark: both
candidates vote for themselves, and the group waits out a full election timeout). Its election
moves at most one slot later than its timeout would have; the first survivor's moves earlier. The
jitter covers replicas that disagree on the member list. A split vote costs what it always did:
one more election timeout.

pysyncobj checks the deadline once per tick; its tick thread polls at most 50 ms
(``autoTickPeriod``) when no socket is busy, so keep ``stagger`` above that. The one pysyncobj
internal used is ``SyncObj.__raftElectionDeadline`` (``kvps.raft.internals``; also used by
``membership.hold_elections``), compared with ``pysyncobj.monotonic.monotonic()`` in
``SyncObj._onTick``; tests/raft/test_raft_pin.py checks both.
"""
from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterable
from typing import Any

from pysyncobj.monotonic import monotonic

from kvps.raft import internals

__all__ = ["FastFailover", "election_delay", "majority_heard_at", "schedule_election"]

logger = logging.getLogger("kvps.raft")


def election_delay(self_address: str, members: Iterable[str], gone: str, stagger: float,
                   u: float) -> float:
    """Seconds this replica waits before standing for election once ``gone`` is known dead:
    ``stagger * (rank + u / 4)`` with ``rank`` its place by address among the members left
    (``u`` in [0, 1) is the caller's random draw)."""
    survivors = sorted({*members, self_address} - {gone})
    return stagger * (survivors.index(self_address) + u / 4)


def schedule_election(group: Any, delay: float) -> float:
    """Set ``group``'s election deadline to ``delay`` seconds from now; returns how many seconds
    the deadline moved (negative: earlier). Tick thread only."""
    deadline = monotonic() + delay
    moved = deadline - internals.election_deadline(group)
    internals.set_election_deadline(group, deadline)
    return moved


class FastFailover:
    """The transport's ``on_peer_gone`` for one group (runs on its tick thread)."""

    def __init__(self, group: Any, stagger: float, rng: random.Random | None = None,
                 on_scheduled: Callable[[], None] | None = None) -> None:
        """``on_scheduled()`` runs right after an election deadline was set (``kvps.raft.prevote``
        lets that election start without asking for pre-votes)."""
        self._group = group
        self._stagger = stagger
        self._rng = rng or random.Random()
        self._on_scheduled = on_scheduled
        self.scheduled = 0  # elections scheduled because the leader's process was gone

    def on_peer_gone(self, address: str) -> None:
        group = self._group
        if group.leader_address() != address:
            return  # not the leader we follow (or we lead, or an election is already under way)
        if getattr(group, "recovering", False):
            return  # its vote and its candidacy wait until it has caught up (kvps.raft.recovery)
        delay = election_delay(group.selfNode.address, (n.address for n in group.otherNodes),
                               address, self._stagger, self._rng.random())
        moved = schedule_election(group, delay)
        if self._on_scheduled is not None:
            self._on_scheduled()
        self.scheduled += 1
        logger.info("raft leader %s is gone (connection closed, port refused); standing for "
                    "election in %.0f ms (%+.0f ms)", address, 1000 * delay, 1000 * moved)


def majority_heard_at(group: Any) -> float:
    """On a leader: the monotonic time by which a majority of its group (itself included) had last
    answered it; 0.0 on a replica that does not lead. No other member wins an election before this
    plus the shortest election timeout (a member that heard from its leader refuses pre-votes that
    long), unless the leader's process died (the fast failover above): the shared-memory mirror's
    lease (``kvps.delta.mirror``) counts from it, and its readers check the writer is alive."""
    if not group.is_leader():
        return 0.0
    try:
        times = sorted(internals.last_responses(group), reverse=True)
    except RuntimeError:  # a member added or removed on the tick thread meanwhile
        return 0.0
    need = (len(times) + 1) // 2  # answers needed besides its own for a majority
    if need == 0:
        return monotonic()
    return times[need - 1] if len(times) >= need else 0.0
