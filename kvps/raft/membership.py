"""Changing a shard group's members with pysyncobj's dynamic membership (one change at a time).

What pysyncobj 0.3.17 does, and what that asks of callers:

* ``addNodeToCluster`` / ``removeNodeFromCluster`` append a MEMBERSHIP entry; every member switches
  to the new configuration as soon as the entry is in its *log* (not when it commits). The leader
  refuses (REQUEST_DENIED) a change before its own no-op entry of the term has been applied, but
  does *not* enforce one change at a time (its ``__changeClusterIDx`` is never set): callers must
  let each change commit before the next; ``change`` returns only then. Adding a member that is
  already one, or removing one that is not, is REQUEST_DENIED too: ``change`` checks the member
  list first, so a retried change is answered as done.
* A leader cannot remove itself (REQUEST_DENIED): ``transfer`` moves leadership away first
  (Raft's TimeoutNow, ``transferLeadership``), which pysyncobj grants only when the target has
  acknowledged the leader's whole log; callers retry.
* A new member must start with the current member list as its peers (never an empty list: it
  would elect itself leader of a group of one at once). Until the leader appends the ``add``
  entry, the members refuse its connections (it is not in their node table), so it hears nobody;
  but a member that learns of it before the leader has reached it could receive its vote requests
  with ever higher terms and depose a healthy leader. ``hold_elections`` keeps a joining replica
  from starting elections for a while (an append from the leader resets the timer as usual).
* It catches up through the normal log path, or through a snapshot install (the leader streams
  its ``fullDumpFile`` in ``logCompactionBatchSize`` chunks; the new member loads it with our
  deserializer, which also sets its member list from the snapshot).

``transferLeadership`` reads and writes SyncObj state and sends on the transport, which only the
tick thread may do: it is run from a tick callback (``_TickCalls``), never from the caller's thread.
tests/cluster/test_membership.py pins the pysyncobj behaviour used here; its private names are reached
through ``kvps.raft.internals``.
"""
from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any

from pysyncobj.config import FAIL_REASON
from pysyncobj.monotonic import monotonic

from kvps.raft import internals
from kvps.raft.bridge import error_for

__all__ = ["change", "hears_leader", "hold_elections", "members"]

_OPS = ("add", "remove", "transfer")


def members(group: Any) -> list[str]:
    """Raft addresses of the group's members as this replica sees them (itself included), sorted."""
    return sorted({group.selfNode.address, *(n.address for n in group.otherNodes)})


def hears_leader(group: Any) -> bool:
    """Whether this replica leads, or has heard from its leader within an election timeout. A
    replica removed from its group keeps its last leader for good: nobody sends to it any more,
    and pysyncobj starts no election while it is connected to no one."""
    if internals.is_leader(group):
        return True
    return internals.leader(group) is not None and internals.election_deadline(group) >= monotonic()


def hold_elections(group: Any, seconds: float) -> None:
    """Start no election for ``seconds`` (a joining replica; see the module doc). Never brings
    an election nearer (a recovering replica holds its elections for good, kvps.raft.recovery)."""
    internals.set_election_deadline(group, max(internals.election_deadline(group),
                                               monotonic() + seconds))


class _TickCalls:
    """Functions to run once on a group's tick thread (installed as one tick callback)."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()

    def __call__(self) -> None:
        while True:
            try:
                fn = self.queue.get_nowait()
            except queue.Empty:
                return
            fn()


_install_lock = threading.Lock()


def _on_tick(group: Any, fn: Callable[[], None]) -> None:
    with _install_lock:
        calls = group.__dict__.get("_kvps_tick_calls")
        if calls is None:
            calls = _TickCalls()
            # An attribute set after SyncObj.__init__ would be pickled by pysyncobj's default
            # snapshot; kvps groups snapshot through their own serializer, so this one never is.
            group.__dict__["_kvps_tick_calls"] = calls
            group.addOnTickCallback(calls)
    calls.queue.put(fn)


async def change(group: Any, op: str, address: str) -> None:
    """``op`` ("add", "remove" or "transfer" of leadership) for the member at raft ``address``.

    Returns once the change is committed (add, remove) or the TimeoutNow was sent (transfer);
    raises the ``bridge`` error for pysyncobj's failure code (REQUEST_DENIED: ``Unavailable``,
    retry). Adding a member that is already one and removing one that is not return at once.
    """
    if op not in _OPS:
        raise ValueError(f"unknown membership op {op!r}")
    current = members(group)
    if (op == "add" and address in current) or (op == "remove" and address not in current):
        return
    loop = asyncio.get_running_loop()
    future: asyncio.Future[None] = loop.create_future()

    def settle(reason: int) -> None:  # on the loop thread
        if future.done():
            return
        if reason == FAIL_REASON.SUCCESS:
            future.set_result(None)
        else:
            future.set_exception(error_for(reason))

    def done(result: Any, reason: int) -> None:  # on the tick thread
        try:
            loop.call_soon_threadsafe(settle, reason)
        except RuntimeError:  # the loop is closed
            pass

    if op == "add":
        group.addNodeToCluster(address, callback=done)
    elif op == "remove":
        group.removeNodeFromCluster(address, callback=done)
    else:
        _on_tick(group, lambda: group.transferLeadership(address, callback=done))
    await future
