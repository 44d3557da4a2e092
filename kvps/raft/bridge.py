"""From pysyncobj's tick-thread callbacks to asyncio, and from ``FAIL_REASON`` codes to our errors.

``FAIL_REASON_ERRORS`` is the one table that says what each failure means to a caller: whether
the command was definitely not applied or its outcome is unknown (``fields["outcome"]``) and
which error class (hence retryability) it maps to. A test enumerates ``FAIL_REASON`` so a new
reason in a future pysyncobj fails there first.
"""
from __future__ import annotations

import asyncio
from typing import Any, Protocol

from pysyncobj.config import FAIL_REASON

from kvps.errors import InvalidRequest, KvpsError, NotLeader, Overloaded, Unavailable
from kvps.raft.group import COMMAND_TOO_LARGE, GROUP_STOPPED

__all__ = ["FAIL_REASON_ERRORS", "error_for", "propose"]

FAIL_REASON_ERRORS: dict[int, type[KvpsError]] = {
    FAIL_REASON.QUEUE_FULL: Overloaded,
    FAIL_REASON.MISSING_LEADER: Unavailable,
    FAIL_REASON.DISCARDED: Unavailable,
    FAIL_REASON.NOT_LEADER: NotLeader,
    FAIL_REASON.LEADER_CHANGED: Unavailable,
    FAIL_REASON.REQUEST_DENIED: Unavailable,
    FAIL_REASON.UNKNOWN_OUTCOME: Unavailable,
    COMMAND_TOO_LARGE: InvalidRequest,
    GROUP_STOPPED: Unavailable,
}

# (reason name, whether the command may still have been applied, message)
_DESCRIPTIONS: dict[int, tuple[str, str, str]] = {
    FAIL_REASON.QUEUE_FULL: ("queue_full", "not_applied", "the leader's command queue is full"),
    FAIL_REASON.MISSING_LEADER: ("missing_leader", "not_applied", "no leader is known (election in progress?)"),
    FAIL_REASON.DISCARDED: ("discarded", "not_applied",
                            "a new leader replaced the entry with another one; it was not applied"),
    FAIL_REASON.NOT_LEADER: ("not_leader", "not_applied", "the replica asked is not the leader"),
    FAIL_REASON.LEADER_CHANGED: ("leader_changed", "unknown",
                                 "the leader changed before the command's outcome was known"),
    FAIL_REASON.REQUEST_DENIED: ("request_denied", "not_applied", "the request was denied"),
    FAIL_REASON.UNKNOWN_OUTCOME: ("unknown_outcome", "unknown", "the command's outcome is unknown"),
    COMMAND_TOO_LARGE: ("command_too_large", "not_applied", "the command exceeds raft.max_command_bytes"),
    GROUP_STOPPED: ("group_stopped", "unknown", "the replica stopped before the outcome was known"),
}


class _Proposer(Protocol):
    def propose(self, data: bytes, callback: Any) -> None: ...
    def leader_address(self) -> str | None: ...


def error_for(reason: int, *, leader_hint: str | None = None) -> KvpsError:
    """The error for a pysyncobj failure code (unknown codes: ``Unavailable``, outcome unknown)."""
    cls = FAIL_REASON_ERRORS.get(reason, Unavailable)
    name, outcome, message = _DESCRIPTIONS.get(reason, (f"reason_{reason}", "unknown",
                                                        f"unknown raft failure code {reason}"))
    fields: dict[str, Any] = {"reason": name, "outcome": outcome}
    if cls is NotLeader:
        return NotLeader(None, leader_hint, **fields)
    return cls(message, **fields)


async def propose(group: _Proposer, data: bytes) -> Any:
    """Replicate ``data`` through ``group`` and return the applier's result once committed.

    The result may itself be a ``KvpsError`` instance (a domain error returned by the applier):
    it is returned, not raised. Raft failures are raised as the errors of ``FAIL_REASON_ERRORS``;
    a ``NotLeader`` carries the raft address of the believed leader in ``raft_leader`` (the
    caller maps it to a data URL for ``leader_hint``). Cancelling the awaiting task does not
    withdraw the command: it may still commit.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, reason: int) -> None:  # on the loop thread
        if future.done():
            return
        if reason == FAIL_REASON.SUCCESS:
            future.set_result(result)
        else:
            error = error_for(reason)
            if isinstance(error, NotLeader):
                error.fields["raft_leader"] = group.leader_address()
            future.set_exception(error)

    def done(result: Any, reason: int) -> None:  # on pysyncobj's tick thread (or this one)
        try:
            loop.call_soon_threadsafe(settle, result, reason)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    group.propose(data, done)
    return await future
