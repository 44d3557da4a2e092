"""Quiet heartbeats: a leader with nothing to replicate heartbeats every quiet period.

A Raft leader heartbeats each follower every ``heartbeat_period`` (50 ms) so that a follower can
tell a dead leader from a live one within its election timeout. A node hosts every replica of
its shards in one process, and most shards of an idle cluster have nothing to replicate: 3 nodes
x 9 groups sent ~720 heartbeats and replies a second, most of the 0.18 cores an idle, settled
cluster burned here (profiled: message handling on the Raft tickers). So a leader whose group has
been still for ``raft.quiet_after`` seconds (every entry committed, applied and acknowledged by
every member, every member connected) heartbeats only every ``raft.quiet_period`` (0.8 s) and
marks those heartbeats ``quiet``; a follower that receives a quiet heartbeat from the leader it
follows waits that much longer before it stands for election (its deadline is the period plus a
fresh election timeout). The first proposal ends the quiet: its append goes out at once, unmarked,
and every later heartbeat is a normal one again, which brings the followers' deadlines back.

What it costs: a leader of a *quiet* group that is cut off (a partition, a paused process) is
replaced after up to a quiet period more than an election timeout (~1.6 s instead of ~0.8 s). A leader whose process dies is replaced as fast as before: its kernel closes its
connections (``kvps.raft.failover``). A busy group is never quiet.

What keeps it consistent:
* safety never depends on heartbeats or timeouts (Raft's votes and log checks decide), only
  availability does; a quiet heartbeat is an ordinary empty ``append_entries`` with one extra
  key, which replicas that do not know it ignore (they just time out sooner);
* the leader's own step-down (pysyncobj's ``leaderFallbackTimeout``: no reply from a majority for
  that long) is stretched by the quiet period while it is quiet, and for one fallback timeout
  after, since replies then come once a period; linearizable reads are log barriers in kvps,
  never a lease, so a leader that keeps its role a little longer cannot serve one stale;
* a follower's pre-vote (``kvps.raft.prevote``) counts a quiet leader as heard for the quiet period
  longer, so the quiet does not let a replica that was cut off win a pre-vote against it;
* the period is capped at the peer connections' keepalive (``connectionTimeout / 4`` of silence,
  1 s), so quiet heartbeats and their replies take the keepalives' place instead of adding to them;
* a quiet group asks its ticker (``next_tick``) for a tick by its next heartbeat or election
  deadline only: messages and proposals tick it at once anyway.

pysyncobj internals used (``kvps.raft.internals``): the leader's next heartbeat time
(``__newAppendEntriesTime``), its match indexes, its last log index; the election deadline.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pysyncobj.monotonic import monotonic

from kvps.raft import internals

__all__ = ["QUIET", "Quiet", "is_heartbeat"]

QUIET = "quiet"  # the key a quiet heartbeat carries: the leader's quiet period in seconds


def is_heartbeat(message: Any) -> bool:
    """An ``append_entries`` with no entries and no snapshot chunk."""
    return (isinstance(message, dict) and message.get("type") == "append_entries"
            and "prevLogIdx" in message and not message.get("entries")
            and "transmission" not in message)


class Quiet:
    """One group's quiet heartbeats; every method runs on the group's tick thread (or, for
    ``mark``, in its transport's ``send``, which that thread calls)."""

    def __init__(self, group: Any, conf: Any, *, period: float, after: float,
                 heartbeat_period: float, fallback: float, longest: float,
                 election_timeout: Callable[[], float]) -> None:
        """``conf``: the group's SyncObjConf (its leaderFallbackTimeout is read every tick);
        ``longest``: the longest quiet period a follower honours (a leader's ask is capped);
        ``election_timeout()``: a fresh election timeout, as pysyncobj draws them."""
        self._group = group
        self._conf = conf
        self.period = period  # 0: never quiet
        self._after = after
        self._heartbeat_period = heartbeat_period
        self._fallback = fallback
        self._longest = longest
        self._election_timeout = election_timeout
        self.quiet = False  # this replica leads a quiet group now
        self._state: tuple | None = None  # what the group looked like at the last tick
        self._still_since = 0.0
        self._next_beat = 0.0  # the heartbeat time pysyncobj last set (or we set) while quiet
        self._stretch_until = 0.0  # the fallback timeout stays stretched until then
        self.following = False  # the last append from our leader was a quiet heartbeat
        self.counters = {"entered": 0, "left": 0, "heard": 0}

    # -- the leader ------------------------------------------------------------------------------

    def before_tick(self, now: float | None = None) -> None:
        if not self.period:
            return
        now = monotonic() if now is None else now
        group = self._group
        if not internals.is_leader(group):
            if self.quiet:
                self._leave(now)
            self._state = None
            return
        state = self._look()
        if state != self._state:
            self._state, self._still_since = state, now
            if self.quiet:
                self._leave(now)
        elif not self.quiet and state[-1] and now - self._still_since >= self._after:
            self._enter(now)
        if not self.quiet and self._stretch_until and now >= self._stretch_until:
            self._conf.leaderFallbackTimeout = self._fallback
            self._stretch_until = 0.0

    def after_tick(self) -> None:
        """pysyncobj sets its next heartbeat a ``heartbeat_period`` after each one it sends;
        while quiet, the next one is a quiet period after it instead."""
        if not self.quiet:
            return
        beat = internals.next_heartbeat(self._group)
        if beat != self._next_beat:
            self._next_beat = beat - self._heartbeat_period + self.period
            internals.set_next_heartbeat(self._group, self._next_beat)

    def next_tick(self, period: float) -> float:
        """Seconds until the group needs a tick with no event (``kvps.raft.ticker``): a quiet
        leader, or a follower of one, needs one by its next heartbeat or election deadline, and
        every quiet period (its transport's keepalives and reconnects); others every round.
        Socket events and proposals tick a group at once whatever this says."""
        if not self.period:
            return period
        group = self._group
        if self.quiet:
            until = internals.next_heartbeat(group) - monotonic()
        elif self.following and not internals.is_leader(group):
            until = internals.election_deadline(group) - monotonic()
        else:
            return period
        return max(period, min(self.period, until))

    def mark(self, message: Any) -> None:
        """The transport's hook for every message the group sends: mark quiet heartbeats."""
        if self.quiet and is_heartbeat(message):
            message[QUIET] = self.period

    def _look(self) -> tuple:
        """The group's progress, and whether it is still: everything committed, applied and
        acknowledged by every member, every member connected, no transfer or snapshot in flight."""
        group = self._group
        last = internals.last_log_index(group)
        matched = internals.match_indexes(group)
        commit, applied = internals.commit_index(group), group.raftLastApplied
        still = (commit == last == applied and all(m == last for m in matched.values())
                 and all(group.isNodeConnected(n) for n in group.otherNodes)
                 and not internals.transmissions_in_flight(group))
        return (internals.term(group), last, commit, applied, tuple(sorted(matched.values())), still)

    def _enter(self, now: float) -> None:
        self.quiet = True
        self.counters["entered"] += 1
        # The heartbeat already due goes out on time, marked: a follower learns that the next
        # one comes a quiet period later before it has to wait for it.
        self._next_beat = internals.next_heartbeat(self._group)
        self._conf.leaderFallbackTimeout = self._fallback + self.period
        self._stretch_until = 0.0

    def _leave(self, now: float) -> None:
        self.quiet = False
        self.counters["left"] += 1
        # replies came once a quiet period: keep the stretched fallback until normal heartbeats
        # have been answered
        self._stretch_until = now + self._fallback
        if internals.is_leader(self._group):
            beat = internals.next_heartbeat(self._group)
            internals.set_next_heartbeat(self._group, min(beat, now + self._heartbeat_period))

    # -- a follower --------------------------------------------------------------------------------

    def on_append(self, node: Any, message: Any) -> float:
        """After pysyncobj handled ``message``: a quiet heartbeat from the leader this replica
        follows, in its term, moves the election deadline a quiet period further. Returns the
        period it honoured (0.0 for any other message)."""
        self.following = False
        period = message.get(QUIET) if isinstance(message, dict) else None
        if not isinstance(period, (int, float)) or isinstance(period, bool) or not is_heartbeat(message):
            return 0.0
        group = self._group
        if (period <= 0 or internals.is_leader(group) or internals.leader(group) != node
                or message.get("term") != internals.current_term(group)
                or internals.transfer_in_progress(group)):
            return 0.0
        period = min(float(period), self._longest)
        deadline = monotonic() + period + self._election_timeout()
        if deadline > internals.election_deadline(group):
            internals.set_election_deadline(group, deadline)
        self.following = True
        self.counters["heard"] += 1
        return period
