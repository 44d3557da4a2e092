"""The replica side of moving replicas: the ``membership`` RPC of the data endpoint.

``POST /v1/rpc/membership`` with meta ``{"op": "members" | "add" | "remove" | "transfer",
"address": "host:port"}`` (raft address). ``members`` answers on any replica; the others only on
the serving leader (``NotLeader`` with a hint otherwise) and return once the change committed
(``transfer``: once the TimeoutNow was sent; poll the leader to see it happen). Retrying a
change that already happened is answered as done. The reply holds the member list, the leader's
raft address and the commit index after the change. ``kvps.rebalance`` drives moves with it.
"""
from __future__ import annotations

import asyncio
import re
import time
from typing import TYPE_CHECKING, Any

from kvps.errors import InvalidRequest, Unavailable
from kvps.raft import membership

if TYPE_CHECKING:
    from kvps.delta.frame import Frame
    from kvps.replica.replica import Replica

__all__ = ["describe", "membership_rpc"]

_ADDRESS = re.compile(r"^[A-Za-z0-9.\-\[\]:]{1,200}:\d{1,5}$")


def describe(replica: "Replica") -> dict[str, Any]:
    group = replica.group
    return {"members": membership.members(group), "leader": group.leader_address(),
            "commit_index": group.raftCommitIndex, "applied_index": group.raftLastApplied,
            "self": replica.address}


async def membership_rpc(replica: "Replica", req: "Frame") -> tuple[dict, tuple]:
    op = req.meta.get("op")
    if op == "members":
        return describe(replica), ()
    if op not in ("add", "remove", "transfer"):
        raise InvalidRequest(f"unknown membership op {op!r}", field="op")
    address = req.meta.get("address")
    if not isinstance(address, str) or not _ADDRESS.match(address):
        raise InvalidRequest(f"bad raft address {address!r}", field="address")
    if op == "remove" and address == replica.address:
        raise InvalidRequest("a leader cannot remove itself: transfer leadership first", field="address")
    await replica.ensure_serving()  # NotLeader (with a hint) on a follower
    if op == "transfer":
        await _hand_off(replica, address)
    else:
        await membership.change(replica.group, op, address)
    return describe(replica), ()


async def _hand_off(replica: "Replica", address: str) -> None:
    """Hold new writes, then ask ``address`` to take over as soon as it has every entry.

    pysyncobj grants a transfer only when the target has acknowledged the leader's whole log, and
    under a stream of pushes it rarely has; and a target that campaigns while the leader keeps
    appending loses the vote to members with newer entries, which ends in a string of elections.
    So: no new proposals for about two election timeouts (clients get ``Unavailable`` and retry),
    the in-flight ones commit, the target catches up, TimeoutNow goes out. If the transfer is
    still refused when the short wait ends, writes resume and the caller retries."""
    raft = replica.cfg.raft
    replica.leadership.hold_writes(2 * raft.election_timeout_max)
    deadline = time.monotonic() + raft.election_timeout_min
    while True:
        try:
            await membership.change(replica.group, "transfer", address)
            return  # the hold lapses by itself; by then this replica is a follower
        except Unavailable:  # REQUEST_DENIED: the target lacks entries still in flight
            if time.monotonic() > deadline:
                replica.leadership.hold_writes(0)
                raise
            await asyncio.sleep(0.005)
