"""kvps.raft.threads.Workers: every job runs at once (no job waits behind another), threads are
kept for the next jobs instead of started per job, a job that raises keeps its thread, and
background workers run at background priority under their kernel-visible name."""
from __future__ import annotations

import os
import threading

from conftest import wait_for

from kvps.raft.threads import Workers


def named(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


def test_jobs_run_at_once_and_their_threads_are_kept_for_the_next():
    workers = Workers("t-kept")
    for _ in range(2):  # the second round finds three idle threads and starts none
        together = threading.Barrier(3, timeout=10)  # breaks unless all three run at once
        done = []
        for k in range(3):
            workers.submit(lambda k=k: done.append((k, together.wait())))
        wait_for(lambda: len(done) == 3, 10, "three jobs to meet")
        wait_for(lambda: workers._idle == 3, 10, "the threads to be idle")
        assert len(named("t-kept")) == 3


def test_a_job_that_raises_keeps_its_thread(caplog):
    workers = Workers("t-raises")
    ran = threading.Event()
    workers.submit(lambda: 1 / 0)
    wait_for(lambda: workers._idle == 1, 10, "the thread to be idle again")
    workers.submit(ran.set)
    assert ran.wait(10)
    assert len(named("t-raises")) == 1
    assert "t-raises: a job raised" in caplog.text


def test_background_workers_run_at_background_priority_under_their_name():
    seen = {}
    done = threading.Event()

    def job():
        tid = threading.get_native_id()
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, tid)
        with open(f"/proc/self/task/{tid}/comm") as f:
            seen["comm"] = f.read().strip()
        done.set()

    Workers("t-background", background=True).submit(job)
    assert done.wait(10)
    assert seen == {"nice": 10, "comm": "t-background"}
