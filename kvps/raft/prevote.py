"""PreVote (Raft thesis §9.6): a replica asks whether it *would* win before it raises its term.

pysyncobj 0.3.17 has no PreVote. A replica that was cut off (a network cut, its process paused)
runs out its election timer again and again, raising its term each time; when it comes back, its
vote request carries a term higher than the leader's, every member adopts that term, and the
healthy leader steps down: the shard stops taking writes for about a second while the group
elects again (measured before this module: 14 of 14 healed cuts were followed by an election).

The protocol, as ``ShardGroup`` runs it on its tick thread:

* When this replica's election deadline is due, ``before_tick`` (called before pysyncobj's own
  ``_onTick`` looks at the deadline) holds the election back: it sends every other member a
  ``pre_vote`` request carrying ``term + 1`` and its last log index and term, forgets the leader
  it followed (as pysyncobj does when it stands for election; it has not heard from it for an
  election timeout), and sets a fresh deadline for the next attempt. Nothing is persisted.
* A member answers ``pre_vote_response`` (``granted`` true or false). It grants only when (a) it
  has not heard from a live leader within the minimum election timeout (it leads itself, or it
  follows a leader whose last append arrived less than ``raft.election_timeout_min`` ago: it
  refuses), and (b) the candidate's log is at least as up to date as its own (Raft's rule: a
  higher last term, or the same last term and an index at least as high). A recovering replica
  (``kvps.raft.recovery``) refuses every pre-vote, as it withholds every vote.
* With grants from a majority of the members, itself included, in the same round and while its
  term is still the one it asked with, it sets its deadline to now and marks exactly that deadline
  as released: pysyncobj's own election starts on the next tick (term + 1, vote for itself,
  ``request_vote``). Without a majority it stays follower and asks again when its next deadline
  is due; an append from a leader closes the round (an election avoided).

Why it is safe: a pre-vote changes nobody's term, vote, log or commit index: neither side
writes anything, and the real election that may follow is pysyncobj's, unchanged. Raft's safety
(one leader per term, committed entries kept) rests on the real votes only, so PreVote can cost
availability, never safety (thesis §9.6). Availability is kept because (a) and (b) are the
conditions under which the real vote would be granted anyway, minus the term, which is left out
on purpose: a member refusing because its term is higher could keep out the one candidate whose
log is complete, and pysyncobj offers no way for the candidate to learn that term without changing
it. A candidate whose term is behind wins the pre-vote, loses the real vote, and catches up by one
term per attempt, as it would without PreVote.

What bypasses it (the deadline pysyncobj acts on is released as it stands):

* leadership transfer: a ``timeout_now`` from the leader (moves, ``kvps.raft.failover`` callers,
  ``membership.change("transfer")``) starts the election at once; the leader asked for it, and its
  followers, which still hear it, would refuse the pre-vote;
* fast failover (``kvps.raft.failover``): the leader's process is known dead (its kernel closed
  the connection, its port refuses connections); the survivors heard it well within the minimum
  election timeout and would refuse too. A cut or a pause closes nothing and refuses nothing, so
  it cannot take this path;
* a group of one: its own vote is the majority.

A request that arrives from a member running an older kvps goes unanswered by it (pysyncobj
ignores unknown message types): a replica needs grants from a majority of upgraded members before
it stands, while the old ones stand as before; an upgrade in progress still elects.

The election-deadline check of ``SyncObj._onTick`` runs a few microseconds after ``before_tick``;
a deadline within ``_EARLY`` of now counts as due, so a tick that spends longer than that between
the two (it never does in steady state) lets one election through without a pre-vote, which is
what every election was before this module.

pysyncobj internals used (``kvps.raft.internals``, pinned by tests/raft/test_raft_pin.py):
``__raftElectionDeadline``, ``__raftCurrentTerm``, ``__raftLog``, ``__raftLeader`` (forgotten),
``__transferInProgress`` (read), ``__transport`` (to send), ``_isLeader``, ``_getLeader``.
"""
from __future__ import annotations

import logging
from typing import Any

from pysyncobj.monotonic import monotonic

from kvps.raft import internals

__all__ = ["PRE_VOTE", "PRE_VOTE_RESPONSE", "PreVote", "log_up_to_date"]

logger = logging.getLogger("kvps.raft")

PRE_VOTE = "pre_vote"
PRE_VOTE_RESPONSE = "pre_vote_response"
# A deadline this close counts as due (see the module docstring), seconds.
_EARLY = 0.01


def log_up_to_date(candidate: tuple[int, int], own: tuple[int, int]) -> bool:
    """Raft's election restriction on (last log term, last log index) pairs."""
    return candidate >= own


class PreVote:
    """One group's pre-votes; every method runs on the group's tick thread."""

    def __init__(self, group: Any, min_timeout: float) -> None:
        self._group = group
        self._min_timeout = min_timeout
        self._round = 0
        self._open = False  # the current round may still win
        self._asked_term = 0  # the term the current round asked for
        self._grants: set[str] = set()  # addresses that granted the current round, ours included
        self._release: float | None = None  # the deadline pysyncobj may start an election at
        self._leader_heard = float("-inf")  # monotonic time of the last append from a leader
        # A quiet heartbeat (kvps.raft.quiet) promises the next one a quiet period later: the
        # leader counts as heard for that much longer. Set by ShardGroup after each message.
        self.quiet_window = 0.0
        # How the election last let through started: "election" (a pre-vote majority, or a
        # group of one), "transfer" (the leader's timeout_now) or "fast-failover" (the leader's
        # process is gone). ShardGroup reads it when this replica becomes leader ("won_by").
        self.last_start: str | None = None
        self._standing = "election"  # how the election in progress started (on_candidate)
        self._standing_term = 0  # the term it stands for
        # asked: rounds started; won: rounds that reached a majority (an election followed);
        # avoided: rounds that ended without one (no term raised); granted / refused: answers
        # this replica gave to others; bypassed: elections started without a round (transfer,
        # fast failover)
        self.counters = {"asked": 0, "won": 0, "avoided": 0, "granted": 0, "refused": 0,
                         "bypassed": 0}

    # -- this replica as a candidate -----------------------------------------------------------

    def before_tick(self, now: float | None = None) -> None:
        """Before pysyncobj's ``_onTick``: hold back an election that is due, asking first."""
        group = self._group
        if internals.is_leader(group):
            self._close()
            return
        now = monotonic() if now is None else now
        deadline = internals.election_deadline(group)
        if deadline > now + _EARLY:
            return
        if deadline == self._release:
            return  # granted by a majority, or waived: pysyncobj's election starts now
        if internals.transfer_in_progress(group) or not group.otherNodes:
            self._release = deadline  # the leader asked (timeout_now), or a group of one
            self.counters["bypassed"] += 1
            self.last_start = "transfer" if group.otherNodes else "election"
            return
        self.ask(now)

    def waive(self) -> None:
        """The election deadline just set (fast failover: the leader is dead) needs no round."""
        self._release = internals.election_deadline(self._group)
        self.counters["bypassed"] += 1
        self.last_start = "fast-failover"

    def ask(self, now: float) -> None:
        """Start a round now (``before_tick`` does when the deadline is due)."""
        group = self._group
        if self._open:
            self.counters["avoided"] += 1  # the previous round never reached a majority
        self._round += 1
        self._open = True
        self._asked_term = internals.current_term(group) + 1
        self._grants = {group.selfNode.address}
        last_index, last_term = _last_entry(group)
        request = {"type": PRE_VOTE, "round": self._round, "term": self._asked_term,
                   "last_log_index": last_index, "last_log_term": last_term}
        for node in list(group.otherNodes):
            internals.send(group, node, request)
        self.counters["asked"] += 1
        # Silent for an election timeout: forget the leader (pysyncobj does when it stands).
        internals.forget_leader(group)
        internals.set_election_deadline(group, now + internals.stock_generate_raft_timeout(group))

    def on_candidate(self, term: int) -> None:
        """pysyncobj just started an election here (tick thread; ``term`` is still the one before
        it stands, which it raises right after): note how it was let through; one it started
        unasked (see ``_EARLY``) was an election all the same."""
        self._standing = self.last_start or "election"
        self._standing_term = term + 1
        self.last_start = None

    def on_leader(self, term: int) -> str:
        """This replica just won ``term``: how its latest election started. A candidate that
        stands again starts without a state change, so a release since ``on_candidate`` is the
        newer; one that stood again unasked (a later term, no release) won by an election."""
        standing = self.last_start or (self._standing if term == self._standing_term else "election")
        self.last_start = None
        return standing

    def _close(self) -> None:
        if self._open:
            self._open = False
            self.counters["avoided"] += 1

    # -- messages (ShardGroup's __onMessageReceived) --------------------------------------------

    def on_message(self, node: Any, message: Any, recovering: bool) -> bool:
        """True when ``message`` was a pre-vote message (consumed here); notes leader appends."""
        if not isinstance(message, dict):
            return False
        kind = message.get("type")
        if kind == PRE_VOTE:
            self._answer(node, message, recovering)
            return True
        if kind == PRE_VOTE_RESPONSE:
            self._count(node, message)
            return True
        if kind == "append_entries":
            term = message.get("term")
            if isinstance(term, int) and term >= internals.current_term(self._group):
                self._leader_heard = monotonic()
                self._close()
                self.last_start = None  # a leader leads: no election of ours is let through
        return False

    def hears_leader(self, now: float | None = None) -> bool:
        """Whether a live leader was heard within the minimum election timeout (or we lead)."""
        group = self._group
        if internals.is_leader(group):
            return True
        now = monotonic() if now is None else now
        return (internals.leader(group) is not None
                and now - self._leader_heard < self._min_timeout + self.quiet_window)

    def would_grant(self, last_log_index: int, last_log_term: int) -> tuple[bool, str]:
        """This replica's answer to a pre-vote with that last entry, and why."""
        if self.hears_leader():
            return False, "hears a live leader"
        last_index, last_term = _last_entry(self._group)
        if not log_up_to_date((last_log_term, last_log_index), (last_term, last_index)):
            return False, "its log is behind"
        return True, "granted"

    def _answer(self, node: Any, message: dict[str, Any], recovering: bool) -> None:
        index, term = message.get("last_log_index"), message.get("last_log_term")
        if not (isinstance(index, int) and isinstance(term, int)):
            return  # malformed: no answer, as for any message pysyncobj cannot read
        if recovering:
            granted, why = False, "recovering"
        else:
            granted, why = self.would_grant(index, term)
        self.counters["granted" if granted else "refused"] += 1
        internals.send(self._group, node, {"type": PRE_VOTE_RESPONSE, "round": message.get("round"),
                                           "term": message.get("term"), "granted": granted})
        logger.debug("raft pre-vote from %s for term %s: %s", getattr(node, "address", node),
                     message.get("term"), why)

    def _count(self, node: Any, message: dict[str, Any]) -> None:
        group = self._group
        if not (self._open and message.get("round") == self._round
                and message.get("granted") is True) or internals.is_leader(group):
            return
        if internals.current_term(group) + 1 != self._asked_term:
            self._close()  # our term moved (we voted in another election): this round is stale
            return
        self._grants.add(node.address)
        members = 1 + len(group.otherNodes)
        if 2 * len(self._grants) > members:
            self._open = False
            self.counters["won"] += 1
            release = monotonic()
            internals.set_election_deadline(group, release)
            self._release = release
            self.last_start = "election"
            logger.info("raft pre-vote for term %d granted by %d of %d members: standing for "
                        "election", self._asked_term, len(self._grants), members)


def _last_entry(group: Any) -> tuple[int, int]:
    """(last log index, last log term)."""
    _, index, term = internals.raft_log(group)[-1]
    return index, term
