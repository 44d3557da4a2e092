"""What the Raft layer's threads tell the kernel: their names, and that some may wait.

The tick thread, the journal's syncing and rewriting threads and the snapshot writers all show as
``python`` in ``top -H``, ``ps -L``, py-spy and ``/proc/<pid>/task/*/stack`` unless they name
themselves (a new thread inherits its creator's kernel name, not its Python one). Snapshot
writers run at background priority so that they yield the cores and the disk to the tick thread,
whose heartbeats must not wait.
"""
from __future__ import annotations

import functools
import logging
import os
import queue
import sys
import threading
from collections.abc import Callable

__all__ = ["Workers", "background_priority", "name_native_thread"]

logger = logging.getLogger("kvps.raft")

_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}  # syscall numbers; glibc has no wrapper


def name_native_thread(name: str) -> None:
    """Give the calling thread a kernel-visible name (Linux ``comm``, 15 bytes): ``top -H``,
    ``ps -L``, py-spy and ``/proc/<pid>/task/*/stack`` then tell the Raft threads apart."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
            f.write(name[:15])
    except OSError:  # not Linux, or /proc not mounted: names are only for diagnosis
        pass


def background_priority(niceness: int = 10) -> None:
    """Lower the calling thread's CPU and disk priority (Linux: both are per thread): snapshot
    writers yield the cores to the Raft tick thread and request handling, and their disk writes
    (submitted by this thread's periodic fdatasync) to the journals', where the I/O scheduler
    honours priorities (mq-deadline, bfq)."""
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, niceness)
    except (AttributeError, OSError):  # not Linux, or not permitted: run at normal priority
        pass
    _lowest_io_priority(tid)


@functools.cache
def _ioprio_syscall() -> Callable[..., int] | None:
    """libc's ``syscall`` and ioprio_set's number, looked up once per process (a compaction
    starts a writer every few seconds under load: loading libc each time showed in profiles)."""
    import ctypes
    import platform

    number = _IOPRIO_SET.get(platform.machine())
    if number is None or not sys.platform.startswith("linux"):
        return None
    try:
        return functools.partial(ctypes.CDLL(None, use_errno=True).syscall, number)
    except (OSError, AttributeError):
        return None


def _lowest_io_priority(tid: int) -> None:
    syscall = _ioprio_syscall()
    if syscall is None:
        return
    best_effort, lowest = 2, 7  # IOPRIO_CLASS_BE, level 7 (0 is highest)
    syscall(1, tid, (best_effort << 13) | lowest)  # IOPRIO_WHO_PROCESS (a thread)


class Workers:
    """Daemon threads that run the jobs handed to them, each job at once (a thread is started
    only when none is idle), and stay for the next ones. A compaction used to start a thread of
    its own on the tick thread, whose ``Thread.start`` waits until the new thread has run: on a
    loaded machine, milliseconds of the tick (and of every group it ticks next) per compaction.
    ``background``: the threads run at ``background_priority``."""

    def __init__(self, name: str, *, background: bool = False) -> None:
        self._name = name
        self._background = background
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # threads waiting for a job that no submitted job has claimed yet

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            start = self._idle == 0
            if not start:
                self._idle -= 1  # claimed: that thread takes this job (or another, equally)
        self._jobs.put(job)
        if start:
            threading.Thread(target=self._serve, name=self._name, daemon=True).start()

    def _serve(self) -> None:
        name_native_thread(self._name)
        if self._background:
            background_priority()
        while True:
            job = self._jobs.get()
            try:
                job()
            except BaseException:  # a job reports its own failures; this keeps the thread
                logger.exception("%s: a job raised", self._name)
            with self._lock:
                self._idle += 1
