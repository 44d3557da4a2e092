"""Every pysyncobj private name kvps touches, one accessor each (pysyncobj is pinned to 0.3.17).

pysyncobj offers no public way to do a few things kvps must do (DESIGN section 4): read the term
and log a follower holds, move its election deadline, queue our own entry bytes, replace its
journal and its connection classes. Those reach into its internals, and an upgrade may move any of
them without notice. So this module is the one place that names them: every other module calls
the accessor below instead, ``tests/raft/test_raft_pin.py`` pins each name against the pinned
pysyncobj (``test_every_private_name_still_exists``) and fails if a module other than this one
names one (``test_only_internals_touches_pysyncobj_private_names``).

Overrides stay method definitions on our subclasses (pysyncobj calls them through ``self``), but
their names are listed here too (``*_OVERRIDES``), and calling the stock implementation of a
name-mangled one goes through an accessor (``stock_*``).

=================================  =================================  ==============================
pysyncobj name                     used by                            accessor here
=================================  =================================  ==============================
``SyncObj._applyCommand``          group: propose our entry bytes     ``apply_command``
``SyncObj._isLeader``              group, transport, membership       ``is_leader``
``SyncObj._getLeader``             group, membership                  ``leader``
``SyncObj._getTerm``               group, transport (replication)     ``term``
``SyncObj._getRaftLogSize``        group: status                      ``log_size``
``SyncObj._poller``                transport, listener, probe         ``poller``
``SyncObj.__raftCurrentTerm``      group, recovery                    ``current_term``
``SyncObj.__raftCommitIndex``      recovery                           ``commit_index``
``SyncObj.__raftElectionDeadline`` failover, membership, group,       ``election_deadline``,
                                   prevote                            ``set_election_deadline``
``SyncObj.__raftLeader``           prevote: forgotten when it asks    ``forget_leader``
``SyncObj.__newAppendEntriesTime`` quiet: a still leader's next beat  ``next_heartbeat``,
                                                                      ``set_next_heartbeat``
``SyncObj.__raftMatchIndex``       quiet: every member caught up      ``match_indexes``
``SyncObj.__lastResponseTime``     group: the shared-memory mirror's  ``last_responses``
                                   lease (a majority heard when)
``SyncObj.__getCurrentLogIndex``   quiet: the last entry's index      ``last_log_index``
``SyncObj.__transferInProgress``   prevote: timeout_now bypasses it   ``transfer_in_progress``
``SyncObj.__transport``            prevote: its own messages          ``send``
``SyncObj.__getEntries``           recovery                           ``entries``
``SyncObj.__raftLog``              replication: the follower rebase   ``raft_log``
``SyncObj.__serializer``           group: snapshots being sent        ``restart_transmissions``
``Serializer.__transmissions``     group: restarted after compaction  ``restart_transmissions``,
                                   and compactions wait for them      ``transmissions_in_flight``
``SyncObj.__doApplyCommand``       ShardGroup overrides it            ``stock_do_apply_command``
``SyncObj.__onMessageReceived``    ShardGroup overrides it            ``stock_on_message_received``
``SyncObj.__parseChangeClusterRequest`` ShardGroup overrides it (views ``stock_parse_change_cluster_request``
                                   of received entries)
``SyncObj.__generateRaftTimeout``  ShardGroup overrides it            ``stock_generate_raft_timeout``
``SyncObj._onTick``                ShardGroup overrides it (prevote)  ``SYNCOBJ_OVERRIDES``
                                   ticker: one tick of one group      ``tick``
``syncobj._COMMAND_TYPE``          group: our entries' type byte      ``REGULAR_COMMAND``
``syncobj._RAFT_STATE``            group: role names                  ``ROLES``
``syncobj.createJournal``          journal: ours instead of its own   ``journal_factory``
``syncobj.createPoller``           ticker: one poller for all groups  ``using_poller``
``SyncObj._doDestroy``             group: destroyed on the ticker     ``destroy_now``
``TCPTransport._syncObj``          transport                          ``sync_obj``
``TCPTransport._connections``      transport                          ``connections``
``TCPTransport._unknownConnections``  transport                       ``unknown_connections``
``TCPTransport._nodeAddrToNode``   transport                          ``node_at``
``TCPTransport._nodes``            transport: voting members          ``is_member``
``TCPTransport._selfNode``         transport: the listen address      ``self_node``
``TCPTransport._server``           transport: our listener            ``set_server``
``TCPTransport._ready``            listener: rebind after a failure,  ``mark_unbound``,
                                   transport: bind on a later tick    ``transport_ready``
``TCPTransport._connToNode``       transport                          ``node_of``
``TCPTransport._onNewIncomingConnection``  transport                  ``add_incoming``
``TCPTransport._onOutgoingConnected``      transport                  ``outgoing_connected``
``TCPTransport._createServer`` ... AuthTransport overrides them       ``TRANSPORT_OVERRIDES``
``Journal._destroy``               RaftJournal implements it          ``JOURNAL_OVERRIDES``
=================================  =================================  ==============================
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pysyncobj.syncobj
from pysyncobj import SyncObj
from pysyncobj.syncobj import _COMMAND_TYPE, _RAFT_STATE

__all__ = [
    "JOURNAL_OVERRIDES", "REGULAR_COMMAND", "ROLES", "SYNCOBJ_ATTRIBUTES", "SYNCOBJ_METHODS",
    "SYNCOBJ_OVERRIDES", "TRANSPORT_ATTRIBUTES", "TRANSPORT_METHODS", "TRANSPORT_OVERRIDES",
    "add_incoming", "apply_command", "commit_index", "connections", "current_term",
    "destroy_now", "election_deadline", "entries", "forget_leader", "is_leader", "is_member",
    "journal_factory", "last_log_index", "last_responses", "leader", "log_size",
    "mark_unbound", "match_indexes", "next_heartbeat", "node_at", "node_of",
    "outgoing_connected", "poller", "raft_log", "restart_transmissions", "self_node", "send",
    "set_election_deadline", "set_next_heartbeat", "set_server", "stock_do_apply_command",
    "stock_generate_raft_timeout", "stock_on_message_received",
    "stock_parse_change_cluster_request", "sync_obj", "term", "tick", "transfer_in_progress",
    "transmissions_in_flight", "transport_ready", "unknown_connections", "using_poller",
]

# The names, as they appear on instances (mangled ones with their class prefix).
SYNCOBJ_ATTRIBUTES = ("_SyncObj__newAppendEntriesTime", "_SyncObj__raftCommitIndex",
                      "_SyncObj__raftCurrentTerm", "_SyncObj__raftElectionDeadline",
                      "_SyncObj__lastResponseTime", "_SyncObj__raftLeader", "_SyncObj__raftLog",
                      "_SyncObj__raftMatchIndex", "_SyncObj__serializer",
                      "_SyncObj__transferInProgress", "_SyncObj__transport", "_poller")
SYNCOBJ_METHODS = ("_SyncObj__getCurrentLogIndex", "_SyncObj__getEntries", "_applyCommand",
                   "_doDestroy", "_getLeader", "_getRaftLogSize", "_getTerm", "_isLeader")
SYNCOBJ_OVERRIDES = ("_SyncObj__doApplyCommand", "_SyncObj__generateRaftTimeout",
                     "_SyncObj__onMessageReceived", "_SyncObj__parseChangeClusterRequest",
                     "_onTick")  # defined on ShardGroup
TRANSPORT_ATTRIBUTES = ("_connections", "_nodeAddrToNode", "_nodes", "_ready", "_selfNode",
                        "_server", "_syncObj", "_unknownConnections")
TRANSPORT_METHODS = ("_connToNode", "_onNewIncomingConnection", "_onOutgoingConnected")
TRANSPORT_OVERRIDES = ("_createServer", "_onDisconnected", "_onIncomingMessageReceived",
                       "_onMessageReceived", "_onTick")  # defined on AuthTransport
JOURNAL_OVERRIDES = ("_destroy",)  # defined on RaftJournal: SyncObj closes its journal with it

# A log entry's first byte says what it is; ours are REGULAR (kvps.raft.group).
REGULAR_COMMAND = _COMMAND_TYPE.REGULAR
# pysyncobj's role codes (onStateChanged's arguments) by our names for them.
ROLES = {_RAFT_STATE.FOLLOWER: "follower", _RAFT_STATE.CANDIDATE: "candidate",
         _RAFT_STATE.LEADER: "leader"}


# -- SyncObj -----------------------------------------------------------------------------------

def apply_command(group: SyncObj, command: bytes, callback: Callable[[Any, int], None]) -> None:
    """Queue ``command`` (type byte included) as it is: no pickling, no copy."""
    group._applyCommand(command, callback)


def is_leader(group: SyncObj) -> bool:
    return group._isLeader()


def leader(group: SyncObj) -> Any:
    """The last known leader's node, or None."""
    return group._getLeader()


def term(group: SyncObj) -> int:
    return group._getTerm()


def log_size(group: SyncObj) -> int:
    """Entries in the in-memory log (up to the last compaction)."""
    return group._getRaftLogSize()


def poller(group: SyncObj) -> Any:
    """The poller of the tick thread, on which every peer socket lives."""
    return group._poller


def current_term(group: SyncObj) -> int:
    return group._SyncObj__raftCurrentTerm


def commit_index(group: SyncObj) -> int:
    return group._SyncObj__raftCommitIndex


def election_deadline(group: SyncObj) -> float:
    """The monotonic time (``pysyncobj.monotonic``) after which this replica stands for election."""
    return group._SyncObj__raftElectionDeadline


def set_election_deadline(group: SyncObj, deadline: float) -> None:
    """Tick thread only."""
    group._SyncObj__raftElectionDeadline = deadline


def last_log_index(group: SyncObj) -> int:
    """The index of the last entry in the log (committed or not)."""
    return group._SyncObj__getCurrentLogIndex()


def match_indexes(group: SyncObj) -> dict[Any, int]:
    """On a leader: member node -> the highest index it has acknowledged (a copy)."""
    return dict(group._SyncObj__raftMatchIndex)


def last_responses(group: SyncObj) -> list[float]:
    """On a leader: the monotonic time each other member last answered it (a copy)."""
    return list(group._SyncObj__lastResponseTime.values())


def next_heartbeat(group: SyncObj) -> float:
    """On a leader: the monotonic time after which its next tick sends appends to everyone."""
    return group._SyncObj__newAppendEntriesTime


def set_next_heartbeat(group: SyncObj, when: float) -> None:
    """Tick thread only."""
    group._SyncObj__newAppendEntriesTime = when


def forget_leader(group: SyncObj) -> None:
    """No leader known any more (as when pysyncobj stands for election). Tick thread only."""
    group._SyncObj__raftLeader = None


def transfer_in_progress(group: SyncObj) -> bool:
    """Whether a leader's ``timeout_now`` asked this replica to stand now (leadership transfer)."""
    return group._SyncObj__transferInProgress


def send(group: SyncObj, node: Any, message: Any) -> bool:
    """Send ``message`` to a member over the group's transport; False if not connected. Tick
    thread only."""
    return group._SyncObj__transport.send(node, message)


def entries(group: SyncObj, from_index: int, count: int) -> list[tuple[Any, int, int]]:
    """Up to ``count`` (command, index, term) entries from ``from_index`` ([] if not held)."""
    return group._SyncObj__getEntries(from_index, count)


def raft_log(group: SyncObj) -> Any:
    """The journal itself: ``len()`` and ``[i]`` give (command, index, term) entries."""
    return group._SyncObj__raftLog


def restart_transmissions(group: SyncObj) -> int:
    """Close every snapshot being sent to a follower, so that each restarts from the snapshot
    just written (returns how many). pysyncobj's forked serializer drops them itself when a dump
    succeeds; with a ``serializeChecker`` (ours) it keeps reading the file it had opened, which is
    by then the replaced snapshot: outdated, and overwritten once it is reused as the spare."""
    transmissions = group._SyncObj__serializer._Serializer__transmissions
    closed = 0
    for transmission in transmissions.values():
        handle = transmission.get("file")
        if handle is not None:
            handle.close()
        closed += 1
    transmissions.clear()
    return closed


def transmissions_in_flight(group: SyncObj) -> int:
    """How many snapshots are being sent to followers now (pysyncobj drops one when it is sent,
    when its follower disconnects, or through ``restart_transmissions``)."""
    return len(group._SyncObj__serializer._Serializer__transmissions)


def stock_do_apply_command(group: SyncObj, command: bytes) -> Any:
    return SyncObj._SyncObj__doApplyCommand(group, command)


def stock_parse_change_cluster_request(group: SyncObj, command: bytes) -> Any:
    return SyncObj._SyncObj__parseChangeClusterRequest(group, command)


def stock_on_message_received(group: SyncObj, node: Any, message: Any) -> None:
    SyncObj._SyncObj__onMessageReceived(group, node, message)


def stock_generate_raft_timeout(group: SyncObj) -> float:
    return SyncObj._SyncObj__generateRaftTimeout(group)


# -- TCPTransport (kvps.raft.transport subclasses it) ------------------------------------------

def sync_obj(transport: Any) -> SyncObj:
    return transport._syncObj


def connections(transport: Any) -> dict[Any, Any]:
    """node -> connection, the transport's own dict (read and written)."""
    return transport._connections


def unknown_connections(transport: Any) -> set[Any]:
    """Incoming connections that have not named their node yet."""
    return transport._unknownConnections


def node_at(transport: Any, address: str) -> Any:
    """The member node with this address, or None."""
    return transport._nodeAddrToNode.get(address)


def is_member(transport: Any, node: Any) -> bool:
    """Whether ``node`` is a voting member (dropNode removes it)."""
    return node in transport._nodes


def self_node(transport: Any) -> Any:
    return transport._selfNode


def set_server(transport: Any, server: Any) -> None:
    """Our listener in place of the stock ``TcpServer`` (bound through ``bind``/``unbind``)."""
    transport._server = server


def mark_unbound(transport: Any) -> None:
    """The listener is gone: ``TCPTransport._maybeBind`` binds it again on a later tick."""
    transport._ready = False


def transport_ready(transport: Any) -> bool:
    """Whether the transport's listener is bound (what ``TCPTransport.ready`` returns)."""
    return transport._ready


def node_of(transport: Any, conn: Any) -> Any:
    """The node a connection belongs to, or None."""
    return transport._connToNode(conn)


def add_incoming(transport: Any, conn: Any) -> None:
    """Hand an accepted connection to the stock bookkeeping (it waits for the peer's name)."""
    transport._onNewIncomingConnection(conn)


def outgoing_connected(transport: Any, conn: Any) -> None:
    """The stock reaction to an outgoing connection that is up: name ourselves, report it."""
    transport._onOutgoingConnected(conn)


# -- createJournal: our journal in place of pysyncobj's ----------------------------------------
#
# SyncObj.__init__ builds its journal by calling the module global
# pysyncobj.syncobj.createJournal(conf.journalFile); there is no configuration hook for a journal
# class. journal_factory replaces that global once (idempotently) with _create_journal, which
# builds the journal for a registered path with its factory and calls the original for any other
# path (so a plain SyncObj in the same process keeps pysyncobj's FileJournal).

_stock_create_journal = pysyncobj.syncobj.createJournal
_factories: dict[str, Callable[[str], Any]] = {}  # absolute journal path -> factory
_claimed: set[str] = set()
_factories_lock = threading.Lock()


def _create_journal(journalFile: str | None = None) -> Any:
    """Stands in for ``pysyncobj.syncobj.createJournal``."""
    if journalFile is not None:
        key = os.path.abspath(journalFile)
        with _factories_lock:
            make = _factories.get(key)
            if make is not None:
                _claimed.add(key)
        if make is not None:
            return make(journalFile)
    return _stock_create_journal(journalFile)


@contextmanager
def journal_factory(path: str | Path, make: Callable[[str], Any]) -> Iterator[None]:
    """While inside, a ``SyncObj`` constructed with ``journalFile=path`` gets ``make(path)`` as its
    journal. Raises ``RuntimeError`` if the block ends without pysyncobj asking for it."""
    pysyncobj.syncobj.createJournal = _create_journal
    key = os.path.abspath(path)
    with _factories_lock:
        if key in _factories:
            raise RuntimeError(f"raft journal {key} is already being opened")
        _factories[key] = make
    try:
        yield
    finally:
        with _factories_lock:
            del _factories[key]
            claimed = key in _claimed
            _claimed.discard(key)
    if not claimed:
        raise RuntimeError(f"pysyncobj did not open {key} through createJournal: the kvps journal "
                           f"was not installed (see kvps/raft/internals.py)")


def tick(group: SyncObj) -> None:
    """One tick of a group without ``autoTick``: its timers, applies and sends. Its poller's
    ``poll(0)`` at the end does nothing (``kvps.raft.ticker`` polls for every group at once)."""
    group._onTick(0.0)


def destroy_now(group: SyncObj) -> None:
    """Close a group's sockets and journal on the calling thread: what pysyncobj's own tick thread
    does on ``destroy()``. A group without ``autoTick`` must be destroyed on the thread that ticks
    it (``kvps.raft.ticker``); ``destroy()`` would do it on whichever thread calls it."""
    group._doDestroy()


# -- createPoller: the ticker's poller in place of one per group -------------------------------
#
# SyncObj.__init__ builds its poller by calling the module global
# pysyncobj.syncobj.createPoller(conf.pollerType) and hands it to its transport, which puts every
# socket on it. using_poller replaces that global once (idempotently) with _create_poller, which
# returns the poller set for the constructing thread, or the stock one when none is.

_stock_create_poller = pysyncobj.syncobj.createPoller
_next_poller = threading.local()


def _create_poller(pollerType: str) -> Any:  # noqa: N803 (pysyncobj's name)
    """Stands in for ``pysyncobj.syncobj.createPoller``."""
    poller = getattr(_next_poller, "value", None)
    if poller is None:
        return _stock_create_poller(pollerType)
    _next_poller.value = None
    _next_poller.claimed = True
    return poller


@contextmanager
def using_poller(poller: Any) -> Iterator[None]:
    """While inside, a ``SyncObj`` constructed on this thread gets ``poller`` as its poller.
    Raises ``RuntimeError`` if the block ends without pysyncobj asking for one."""
    pysyncobj.syncobj.createPoller = _create_poller
    _next_poller.value, _next_poller.claimed = poller, False
    try:
        yield
    finally:
        claimed = _next_poller.claimed
        _next_poller.value, _next_poller.claimed = None, False
    if not claimed:
        raise RuntimeError("pysyncobj did not build its poller through createPoller: the raft "
                           "ticker's poller was not installed (see kvps/raft/internals.py)")
