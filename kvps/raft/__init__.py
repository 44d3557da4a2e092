"""The Raft layer: the only package that imports pysyncobj (pinned to 0.3.17).

The group and what it is built from:

* ``group`` -- ``ShardGroup``, the one ``SyncObj`` subclass, with one ``@replicated`` method.
* ``internals`` -- every pysyncobj private name kvps touches, one accessor each, each pinned.
* ``bridge`` -- pysyncobj callbacks to asyncio futures, ``FAIL_REASON`` to kvps errors.
* ``threads`` -- kernel-visible names and background priority for the threads of this layer.
* ``ticker`` -- one thread and one poller that tick every group of a process (no autoTick).

Log compaction and durability:

* ``compaction`` -- log compaction through pysyncobj's serializer hooks, on a writer thread.
* ``snapshot_file`` -- our log-compaction snapshot format.
* ``journal`` -- our Raft journal (checksummed, crash-safe, explicit fsync policy), installed in
  place of pysyncobj's ``FileJournal``.
* ``segments`` -- the journal's preallocated, recycled segment files: layout (records summed
  with the segment's epoch), reading the log back at open (torn tail, damage).
* ``segment_pool`` -- segments in use and in reserve: retiring, freeing and preparing them on
  a worker thread.
* ``log_memory`` -- the commands the log holds in memory: released to the journal once applied
  and held by every follower, read back for a follower that lags.
* ``released`` -- ``Released``, the placeholder of a released command; pure.
* ``journal_file`` -- the single-file journal of earlier kvps versions, read once to move it
  into segments.
* ``meta_file`` -- term, vote and commit index, in two slots overwritten in place.
* ``disk`` -- positional writes, in-kernel copies and fsyncs (journal, meta file, recovery marker).

Peer traffic:

* ``transport`` -- ``make_transport_class``: pysyncobj's ``TCPTransport`` with the pieces below.
* ``wire`` -- the peer wire format (frames, message bodies, the no-globals unpickler, the
  handshake MAC); pure.
* ``handshake`` -- the mutual HMAC challenge-response as a state machine; pure.
* ``connection`` -- one authenticated, size-capped peer connection on pysyncobj's poller.
* ``frame_buffers`` -- the recycled buffers large peer frames are received into, one pool per
  tick thread.
* ``peer_settings`` -- the secret, limits, counters and socket options every connection shares.
* ``listener`` -- the Raft port's listening socket.
* ``probe`` -- whether a member that closed its connection still listens (its process is gone).
* ``replication`` -- the leader's nextIndex restore and back-pressure, the follower's rebase;
  pure.

Membership and faults:

* ``membership`` -- adding, removing members and moving leadership, one change at a time.
* ``failover`` -- a new election ~0.1 s after the leader's process is gone.
* ``recovery`` -- a replica that lost its data withholds its vote until it has caught up.
* ``prevote`` -- PreVote: an election starts only once a majority would vote for it.
* ``first_election`` -- a fresh group's preferred replica stands once connected to a majority.
* ``quiet`` -- a still group's leader heartbeats every quiet period, not every 50 ms.

``tests/raft/test_raft_pin.py`` fails first when a pysyncobj upgrade moves an internal we rely on.
The names below are loaded on first use, so that importing a pure module of this package (``wire``,
``handshake``, ``replication``) imports neither pysyncobj nor a socket.
"""
from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "COMMAND_TOO_LARGE",
    "FAIL_REASON_ERRORS",
    "GROUP_STOPPED",
    "ShardGroup",
    "error_for",
    "make_transport_class",
    "propose",
]

_HOMES = {
    "COMMAND_TOO_LARGE": "kvps.raft.group",
    "FAIL_REASON_ERRORS": "kvps.raft.bridge",
    "GROUP_STOPPED": "kvps.raft.group",
    "ShardGroup": "kvps.raft.group",
    "error_for": "kvps.raft.bridge",
    "make_transport_class": "kvps.raft.transport",
    "propose": "kvps.raft.bridge",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'kvps.raft' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
