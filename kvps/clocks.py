"""Time in the replicated state, and the worker clocks of training jobs (the state behind
bounded-staleness (SSP) and synchronous (BSP) training).

**Cluster time.** Leases and exactly-once sessions expire by time, so the time they are judged by
must not jump when a machine's wall clock does (an NTP step, a VM resumed, an operator's mistake):
a leader whose wall clock ran an hour ahead would expire every session (a retried push would then
apply twice) and make a dead worker's lease live an hour; one running behind would expire every
lease at once. So no wall clock is involved. The leader stamps commands with ``ClusterTime.now()``:
the largest time stamped in the log so far (which every replica applies) plus the *monotonic* time
elapsed on this replica since it applied it. Each replica keeps that estimate as it applies
entries, so a new leader continues from the last stamp it applied, and the state machine takes
the maximum of the stamps it applies (``ShardState.time``), so time in the state never goes back.
It advances at the rate of real time on the leader; across a failover it loses the time between
the old leader's last entry reaching this replica and the new leader's first stamp (a lease then
lasts at most that much longer, a session is kept that much longer: the safe direction). A whole
cluster restarted resumes from its last stamp. It starts at 0 for a new shard: it is a duration
since the first stamp, not a date.

**Worker clocks.** ``{job: {worker: Clock(step, expires_at)}}``. A worker reports the steps it has
completed with a ``ClockTick``; the leader stamps the tick with the cluster time ``now``, and the
clock lives until ``now + lease_s``. Workers wait (client side) until the slowest live clock of
their job is close enough. A worker that dies stops renewing its lease, its clock expires, and the
others stop waiting for it: expiry compares lease ends with the cluster time of later commands
(or, for reads, the reading replica's ``ClusterTime``), never a clock read inside ``apply``.

Steps only grow while a lease lives (a retried or reordered tick cannot move a clock back); a tick
with ``lease_s == 0`` removes the worker, which is how a worker that finished leaves its job.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Clock", "ClockTable", "ClusterTime"]


class ClusterTime:
    """One replica's estimate of the cluster time (see the module docstring): the newest stamp it
    applied plus the monotonic time since. ``monotonic`` is injected (``time.monotonic`` in a
    replica), so this module reads no clock itself. ``applied`` is called by the thread that
    applies entries, ``now`` from any thread: the base is one tuple, replaced whole."""

    def __init__(self, monotonic: Callable[[], float]) -> None:
        self._monotonic = monotonic
        self._base = (0.0, monotonic())  # (cluster time, monotonic time when it was that)

    def now(self) -> float:
        at, since = self._base
        return at + (self._monotonic() - since)

    def applied(self, stamp: float) -> None:
        """The state's time is now ``stamp``: move the estimate up to it if it lags (never down:
        the leader's own stamps come back applied a commit later than it made them)."""
        if stamp > self.now():
            self._base = (stamp, self._monotonic())


@dataclass(frozen=True)
class Clock:
    step: int  # steps the worker has completed
    expires_at: float  # cluster time after which the worker counts as gone


class ClockTable:
    def __init__(self) -> None:
        self.jobs: dict[str, dict[str, Clock]] = {}

    def tick(self, now: float, job: str, worker: str, step: int, lease_s: float) -> dict[str, int]:
        """Apply one tick; the job's live clocks afterwards, ``{worker: step}``."""
        self.expire(now)
        workers = self.jobs.setdefault(job, {})
        if lease_s == 0:
            workers.pop(worker, None)
        else:
            old = workers.get(worker)
            workers[worker] = Clock(max(step, old.step) if old else step, now + lease_s)
        if not workers:
            del self.jobs[job]
        return self.live(job, now)

    def live(self, job: str, now: float) -> dict[str, int]:
        """``{worker: step}`` of the job's workers whose lease has not ended at ``now``."""
        return {w: c.step for w, c in sorted(self.jobs.get(job, {}).items()) if c.expires_at > now}

    def expire(self, now: float) -> None:
        """Forget every clock whose lease ended at or before ``now`` (all jobs: bounded memory)."""
        for job in list(self.jobs):
            workers = self.jobs[job]
            for worker in [w for w, c in workers.items() if c.expires_at <= now]:
                del workers[worker]
            if not workers:
                del self.jobs[job]

    # ---- snapshot form (JSON-safe, deterministic order) -----------------------------------------

    def to_json(self) -> list:
        return [[job, [[w, c.step, c.expires_at] for w, c in sorted(workers.items())]]
                for job, workers in sorted(self.jobs.items())]

    def load_json(self, data: Any) -> None:
        """Replace the table with ``data`` from ``to_json`` (TypeError/ValueError when malformed)."""
        jobs: dict[str, dict[str, Clock]] = {}
        for job, workers in data:
            if not isinstance(job, str) or not isinstance(workers, list):
                raise TypeError("malformed clock job")
            jobs[job] = {}
            for worker, step, expires_at in workers:
                if not isinstance(worker, str) or isinstance(step, bool) or not isinstance(step, int) \
                        or not isinstance(expires_at, (int, float)):
                    raise TypeError("malformed clock")
                jobs[job][worker] = Clock(step, float(expires_at))
        self.jobs = jobs
