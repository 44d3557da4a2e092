"""Worker clocks of training jobs: the replicated state behind bounded-staleness (SSP) and
synchronous (BSP) training.

``{job: {worker: Clock(step, expires_at)}}``. A worker reports the steps it has completed with a
``ClockTick``; the leader stamps the tick with its wall time ``now``, and the clock lives until
``now + lease_s``. Workers wait (client side) until the slowest live clock of their job is close
enough. A worker that dies stops renewing its lease, its clock expires, and the others stop waiting
for it: expiry compares lease ends with the leader-stamped time of later commands (or, for reads,
the reading replica's clock), never a clock read inside ``apply``.

Steps only grow while a lease lives (a retried or reordered tick cannot move a clock back); a tick
with ``lease_s == 0`` removes the worker, which is how a worker that finished leaves its job.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Clock", "ClockTable"]


@dataclass(frozen=True)
class Clock:
    step: int  # steps the worker has completed
    expires_at: float  # leader wall time after which the worker counts as gone


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
