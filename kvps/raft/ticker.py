"""``Ticker``: one thread and one poller that drive every Raft group of a process.

pysyncobj gives each ``SyncObj`` its own tick thread and its own poller (``autoTick``). A node that
hosts eight replicas in one process would then run eight threads that each wake twenty times a
second to find nothing to do, all contending for one interpreter lock. pysyncobj's extension
points for the alternative are ``autoTick=False`` (the owner calls ``_onTick`` itself) and the
poller the transport puts its sockets on (``SyncObj._poller``, built by the module global
``createPoller``, which ``kvps.raft.internals.using_poller`` points at ours while a group is built).

Each group gets a ``GroupPoller``: its sockets go onto the ticker's one ``epoll``, and its own
``poll()`` (called at the end of every pysyncobj tick) does nothing, because the ticker polls once
for everyone. An event on a group's socket marks that group due, so a round ticks the groups that
received something plus, every ``period``, all of them (heartbeats, election deadlines): an idle
process wakes ``1 / period`` times a second in total, not per group. A group may say when it next
needs a tick with no event (``group.next_tick(period)``: seconds from now, at least ``period``); a
quiet one (``kvps.raft.quiet``) asks for fewer, and the thread sleeps until the earliest one due
(groups due within half a period of each other are ticked in the same round).

Everything pysyncobj does still happens on one thread per group, as it did with ``autoTick``:
the ticker's. Groups are built and destroyed on that thread too (``call``), so no socket or
callback of a half-built or half-destroyed group is ever seen by the poll. A group whose tick
raises ``GroupHalted`` (its state machine cannot go on: ``kvps.replica`` restarts it) is
destroyed at once, before it applies another entry; its siblings keep ticking.
"""
from __future__ import annotations

import errno
import logging
import os
import select
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from pysyncobj.poller import POLL_EVENT_TYPE

from kvps.raft import internals
from kvps.raft.threads import name_native_thread

__all__ = ["GroupHalted", "GroupPoller", "Ticker"]

logger = logging.getLogger("kvps.raft")

# pysyncobj's autoTickPeriod: how long an idle tick thread waits for a socket event.
DEFAULT_PERIOD = 0.05

_TO_EPOLL = ((POLL_EVENT_TYPE.READ, select.EPOLLIN), (POLL_EVENT_TYPE.WRITE, select.EPOLLOUT),
             (POLL_EVENT_TYPE.ERROR, select.EPOLLERR))


class GroupHalted(Exception):
    """Raised from a group's apply when its state machine cannot follow the log: the ticker stops
    ticking that group (the entry stays unapplied) and calls ``on_halted(reason)``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class GroupPoller:
    """The poller one group sees: subscriptions go to the ticker's epoll, ``poll`` does nothing."""

    def __init__(self, ticker: "Ticker") -> None:
        self._ticker = ticker
        self.group: Any = None  # set by Ticker.add; events before that mark nothing
        self.fds: set[int] = set()

    def subscribe(self, descr: int, callback: Callable[[int, int], None], eventMask: int) -> None:  # noqa: N803
        self.fds.add(descr)
        self._ticker._subscribe(self, descr, callback, eventMask)

    def unsubscribe(self, descr: int) -> None:
        self.fds.discard(descr)
        self._ticker._unsubscribe(descr)

    def poll(self, timeout: float) -> None:
        """pysyncobj ends every tick by polling; the ticker polls once for all groups."""


class Ticker:
    """Ticks every registered group on one thread. ``call(fn)`` runs ``fn`` on that thread."""

    def __init__(self, *, period: float = DEFAULT_PERIOD, name: str = "raft-ticker") -> None:
        self.period = period
        self._epoll = select.epoll()
        self._handlers: dict[int, tuple[GroupPoller, Callable[[int, int], None]]] = {}
        self._groups: list[Any] = []
        self._halted: dict[int, Callable[[str], None]] = {}  # id(group) -> on_halted
        self._due: set[int] = set()  # id(group) of groups with events since their last tick
        self._next: dict[int, float] = {}  # id(group) -> when it needs a tick with no event
        self._calls: deque[tuple[Callable[[], Any], Future]] = deque()
        self._lock = threading.Lock()
        self._stopping = False
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._epoll.register(self._wake_r, select.EPOLLIN)
        self.rounds = 0  # wake-ups of the thread
        self.ticks = 0  # group ticks
        # rounds that took long; the longest single tick of a group; the most a group's tick
        # started after it was due (a leader's heartbeats wait that long)
        self.stalls = {"max_seconds": 0.0, "over_100ms": 0, "tick_max_seconds": 0.0,
                       "late_max_seconds": 0.0}
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- called from any thread ---------------------------------------------------------------

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def on_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def call(self, fn: Callable[[], Any], *, timeout: float | None = None) -> Any:
        """Run ``fn`` on the ticker's thread between rounds and return its result (or raise)."""
        if self.on_thread():
            return fn()
        fut: Future = Future()
        with self._lock:
            if self._stopping:
                raise RuntimeError("the raft ticker is stopped")
            self._calls.append((fn, fut))
        self._wake()
        return fut.result(timeout)

    def defer(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on the ticker's thread before its next round; do not wait for it."""
        with self._lock:
            if self._stopping:
                return
            self._calls.append((fn, Future()))
        self._wake()

    def poller(self) -> GroupPoller:
        """A poller for one group under construction (``kvps.raft.internals.using_poller``)."""
        return GroupPoller(self)

    def add(self, group: Any, poller: GroupPoller, on_halted: Callable[[str], None] | None = None) -> None:
        """Tick ``group`` from now on (ticker thread only: call it through ``call``)."""
        self._require_thread()
        poller.group = group
        self._groups.append(group)
        if on_halted is not None:
            self._halted[id(group)] = on_halted
        self._due.add(id(group))

    def remove(self, group: Any) -> None:
        """Tick ``group`` no more (ticker thread only). Its sockets stay until it destroys them."""
        self._require_thread()
        self._groups = [g for g in self._groups if g is not group]
        self._halted.pop(id(group), None)
        self._due.discard(id(group))
        self._next.pop(id(group), None)

    @property
    def groups(self) -> int:
        return len(self._groups)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread (after the groups: a group left here is no longer ticked)."""
        with self._lock:
            self._stopping = True
        self._wake()
        if not self.on_thread():
            self._thread.join(timeout)

    # -- the poller behind every GroupPoller ---------------------------------------------------

    def _subscribe(self, owner: GroupPoller, fd: int, callback: Callable[[int, int], None], mask: int) -> None:
        events = 0
        for ours, theirs in _TO_EPOLL:
            if mask & ours:
                events |= theirs
        self._handlers[fd] = (owner, callback)
        try:
            self._epoll.modify(fd, events)
        except FileNotFoundError:
            self._epoll.register(fd, events)

    def _unsubscribe(self, fd: int) -> None:
        self._handlers.pop(fd, None)
        try:
            self._epoll.unregister(fd)
        except (FileNotFoundError, OSError):  # never registered, or already closed
            pass

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:  # the pipe is full: a wake-up is pending anyway
            pass

    def _require_thread(self) -> None:
        if not self.on_thread():
            raise RuntimeError("only on the raft ticker's thread (use Ticker.call)")

    # -- the thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        name_native_thread(self._thread.name)
        try:
            while True:
                self._run_calls()
                if self._stopping:
                    break
                started = time.monotonic()
                self._tick(started)
                self._note_round(time.monotonic() - started)
                wake = min(self._next.values(), default=started + self.period)
                self._poll(max(0.0, wake - time.monotonic()))
                self.rounds += 1
        finally:
            self._fail_calls()
            self._epoll.close()
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _tick(self, now: float) -> None:
        """Tick the groups with events, and those whose time is due within half a period."""
        due, self._due = self._due, set()
        soon = now + self.period / 2
        for i, group in enumerate(list(self._groups)):
            if id(group) not in due and self._next.get(id(group), 0.0) > soon:
                continue
            if i:
                # Read what arrived while the groups before it worked (a round that applies
                # several large entries takes a while): a tick checks its election deadline
                # before anything else, and a heartbeat left unread in the socket would let a
                # busy round look like a silent leader.
                self._poll(0.0)
            self._tick_one(group)

    def _tick_one(self, group: Any) -> None:
        started = time.monotonic()
        self.ticks += 1
        late = started - self._next.get(id(group), started)
        if late > self.stalls["late_max_seconds"]:
            self.stalls["late_max_seconds"] = round(late, 3)
        self._next[id(group)] = started + self.period  # also if what follows raises
        try:
            internals.tick(group)
            hint = getattr(group, "next_tick", None)
            if hint is not None:
                self._next[id(group)] = time.monotonic() + max(self.period, hint(self.period))
        except GroupHalted as exc:
            self._halt(group, exc.reason)
        except Exception:  # as pysyncobj's own tick thread: log it and go on
            logger.exception("raft ticker: a group's tick failed")
        spent = time.monotonic() - started
        if spent > self.stalls["tick_max_seconds"]:
            self.stalls["tick_max_seconds"] = round(spent, 3)

    def _halt(self, group: Any, reason: str) -> None:
        on_halted = self._halted.get(id(group))
        self.remove(group)
        logger.critical("raft ticker: a group halted: %s; it is no longer ticked", reason)
        if on_halted is not None:
            try:
                on_halted(reason)
            except Exception:
                logger.exception("raft ticker: on_halted raised")

    def _poll(self, timeout: float) -> None:
        try:
            events = self._epoll.poll(timeout)
        except InterruptedError:
            return
        for fd, ev in events:
            if fd == self._wake_r:
                self._drain_wake()
                continue
            handler = self._handlers.get(fd)
            if handler is None:
                continue
            owner, callback = handler
            mask = 0
            if ev & (select.EPOLLIN | select.EPOLLPRI):
                mask |= POLL_EVENT_TYPE.READ
            if ev & select.EPOLLOUT:
                mask |= POLL_EVENT_TYPE.WRITE
            if ev & (select.EPOLLERR | select.EPOLLHUP):
                mask |= POLL_EVENT_TYPE.ERROR
            if owner.group is not None:
                self._due.add(id(owner.group))
            try:
                callback(fd, mask)
            except Exception:
                logger.exception("raft ticker: a socket callback failed")

    def _drain_wake(self) -> None:
        while True:
            try:
                if not os.read(self._wake_r, 4096):
                    return
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno != errno.EINTR:
                    return

    def _run_calls(self) -> None:
        while True:
            with self._lock:
                if not self._calls:
                    return
                fn, fut = self._calls.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # handed to the caller
                fut.set_exception(exc)

    def _fail_calls(self) -> None:
        with self._lock:
            calls, self._calls = list(self._calls), deque()
        for _, fut in calls:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(RuntimeError("the raft ticker stopped"))

    def _note_round(self, seconds: float) -> None:
        if seconds > self.stalls["max_seconds"]:
            self.stalls["max_seconds"] = round(seconds, 3)
        if seconds > 0.1:
            self.stalls["over_100ms"] += 1

    def status(self) -> dict[str, Any]:
        return {"groups": len(self._groups), "rounds": self.rounds, "ticks": self.ticks,
                "stalls": dict(self.stalls)}
