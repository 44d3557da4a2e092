"""``ShardGroup``: one shard's Raft group, the only ``SyncObj`` subclass in kvps.

(Past 450 lines because every override pysyncobj calls through ``self`` must live on this one
class; the logic behind each lives in its own module: prevote, failover, recovery, compaction.)

What pysyncobj 0.3.17 forces on us and how this class answers it (DESIGN section 4):

* Replicated methods are numbered by sorted name and their arguments pickled, and applying an
  entry slices off its type byte and unpickles it: four copies of every command on the leader
  and two more on each follower. ``propose()`` therefore queues ``_ENTRY_PREFIX + data`` through
  the semi-private ``_applyCommand`` (one copy), and ``_SyncObj__doApplyCommand`` is overridden
  to hand such an entry to the applier as a memoryview (no copy). Entries pickled by an older
  kvps (``(funcID, (data,))``, protocol 5, for the one replicated method ``apply_command``),
  no-ops and membership changes go to pysyncobj's own code.
* An exception raised while applying an entry is re-applied on every tick forever (pysyncobj
  raises before advancing lastApplied): ``apply_command`` never raises; it logs the error as
  critical with the entry's index and returns ``InvalidRequest`` as the entry's result.
* Peer traffic goes through ``kvps.raft.transport`` (authenticated, capped, no globals unpickled).
  ``password`` stays unset: pysyncobj's own encryption needs ``cryptography`` and still unpickles
  before checking anything.
* ``appendEntriesUseBatch=False`` (with batching every hop waits a full ``appendEntriesPeriod``),
  and ``appendEntriesBatchSizeBytes`` just above ``max_command_bytes`` so the chunked path for
  large entries (which truncates them) is never taken; larger commands are refused up front.
* Log compaction writes our own snapshot format through the ``serializer`` / ``deserializer`` /
  ``serializeChecker`` hooks, off the tick thread, and is also triggered by applied *bytes*
  (``kvps.raft.compaction``).
* ``commandsWaitLeader=False``: a proposal made while no leader is known fails at once with
  MISSING_LEADER (retryable) instead of waiting, unbounded, in pysyncobj's queue.
* PreVote (Raft thesis §9.6, ``kvps.raft.prevote``): pysyncobj has none; ``_onTick`` is
  overridden to hold back an election until a majority would vote for this replica, so a replica
  that was cut off or paused does not depose a healthy leader when it comes back.
* Quiet heartbeats (``kvps.raft.quiet``): a leader with nothing to replicate heartbeats every
  ``raft.quiet_period`` instead of every ``heartbeat_period``, and tells its ticker so
  (``next_tick``); its followers wait that much longer before they stand.
* ``raft.fast_failover``: when the transport reports that the leader's process is gone (its
  connection closed by its kernel, its port refusing connections), a follower stands for election
  after ~0.1 s instead of a full election timeout (``kvps.raft.failover``).

Durability: the journal (``journal_dir/raft.journal`` and ``.meta``) is ours, not pysyncobj's
mmap: ``kvps.raft.journal`` is installed in its place around ``SyncObj.__init__`` (checksummed
records, a torn tail truncated at open, compaction rewrites by rename, term and vote fsynced
before pysyncobj sends the message that reflects them). ``raft.fsync`` says when appends reach
stable storage. Under every setting an acknowledged command survives ``kill -9`` of any process
(the page cache holds it). On a power loss or kernel crash of a majority of replicas, ``never``
can lose acknowledged commands the kernel had not written back yet, ``interval`` (the default)
those of the last ``raft.fsync_interval`` seconds, ``always`` none (each replica fdatasyncs an
entry before it counts towards the majority). Snapshots are fsynced.

Threads: pysyncobj runs everything (applier, snapshot hooks, role and result callbacks) on its
tick thread. That thread stops when the thread that *constructed* the group exits, so build the
group on a long-lived thread (the main thread / the event loop's thread), and keep a reference to
it: the tick thread only holds a weak proxy.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pysyncobj import SyncObj, SyncObjConf, replicated
from pysyncobj.config import FAIL_REASON, SERIALIZER_STATE
from pysyncobj.monotonic import monotonic

from kvps.config import RaftConfig
from kvps.errors import InvalidRequest
from kvps.raft import compaction, internals, segments
from kvps.raft.failover import FastFailover
from kvps.raft.journal import using_journal
from kvps.raft.prevote import PreVote
from kvps.raft.quiet import Quiet
from kvps.raft.recovery import Recovery
from kvps.raft.replication import is_append
from kvps.raft.threads import background_priority, name_native_thread
from kvps.raft.ticker import GroupHalted, Ticker
from kvps.raft.transport import make_transport_class

# background_priority lives in kvps.raft.threads; kvps.replica imports it from here.
__all__ = ["COMMAND_TOO_LARGE", "ENTRY_OFFSET", "GROUP_STOPPED", "ShardGroup",
           "background_priority", "syncobj_options"]

logger = logging.getLogger("kvps.raft")

# A REGULAR entry whose next byte is 0xFF holds our command bytes as they are: no pickle stream
# starts with 0xFF (protocol 2+ streams start with PROTO, 0x80), so older entries stay apart.
_ENTRY_PREFIX = bytes((internals.REGULAR_COMMAND, 0xFF))
# Where a proposed command starts in its entry: a frame encoded for it (``at=ENTRY_OFFSET``) has
# its arrays aligned in the entry, so applying it reads them in place (kvps.delta.frame).
ENTRY_OFFSET = len(_ENTRY_PREFIX)



# Our own failure codes, next to pysyncobj's FAIL_REASON values (0..7); bridge.py maps them.
COMMAND_TOO_LARGE = 100  # refused before proposing: len(data) > raft.max_command_bytes
GROUP_STOPPED = 101  # the group was stopped before the command's outcome was known

_SNAPSHOT_CHUNK_BYTES = 4 * 1024 * 1024  # snapshot bytes per append_entries while installing one
_BATCH_HEADROOM = 64 * 1024  # appendEntriesBatchSizeBytes above max_command_bytes
# The journal's segment pool is sized for this many compaction intervals of log (plus a largest
# command and the active segment) once the log first reaches a compaction; at most this many
# bytes of segments are made ahead (a bigger log still gets segments as it grows).
RESERVE_INTERVALS = 3
RESERVE_MAX_BYTES = 1 << 30
_NEVER = 10.0 ** 9  # "no time-based compaction": compaction is by bytes and entries only


def syncobj_options(raft: RaftConfig, journal_dir: Path) -> dict[str, Any]:
    """``SyncObjConf`` keyword arguments for ``raft`` (SyncObjConf ignores unknown names silently:
    tests/raft/test_raft_pin.py checks that every one of these still exists)."""
    return {
        "password": None,
        "appendEntriesUseBatch": False,
        "appendEntriesPeriod": raft.heartbeat_period,
        "raftMinTimeout": raft.election_timeout_min,
        "raftMaxTimeout": raft.election_timeout_max,
        "leaderFallbackTimeout": raft.leader_fallback_timeout,
        "connectionTimeout": raft.connection_timeout,
        "connectionRetryTime": raft.connection_retry,
        "appendEntriesBatchSizeBytes": raft.max_command_bytes + _BATCH_HEADROOM,
        "commandsQueueSize": raft.queue_size,
        "commandsWaitLeader": False,
        "journalFile": str(journal_dir / "raft.journal"),
        "fullDumpFile": str(journal_dir / "raft.snapshot"),
        "logCompactionMinEntries": raft.compact_entries,
        "logCompactionMinTime": _NEVER,
        "logCompactionBatchSize": _SNAPSHOT_CHUNK_BYTES,
        "dynamicMembershipChange": True,
    }


class ShardGroup(SyncObj):
    """A Raft replica of one shard. ``applier``, ``snapshot_state`` and ``restore_state`` run on the
    tick thread; ``propose`` may be called from any thread; callbacks arrive on the tick thread.

    ``snapshot_state()`` returns the state's bytes, a list of buffers, or a callable returning
    either (called on the compaction's writer thread: take a consistent view, encode later).
    ``restore_state(data)`` gets a bytes-like view of the snapshot file's state section.
    ``applier(data)`` gets a read-only memoryview of the entry's command (bytes for an entry
    pickled by an older kvps); it may keep views into it (the entry's bytes never change)."""

    def __init__(self, *, self_address: str, peers: Sequence[str], raft: RaftConfig, secret: bytes,
                 context: str, journal_dir: Path, applier: Callable[[bytes | memoryview], Any],
                 snapshot_state: Callable[[], Any], restore_state: Callable[[memoryview], None],
                 on_role_change: Callable[[str], None] | None = None,
                 busy: Callable[[], bool] | None = None, bind_address: str | None = None,
                 ticker: Ticker | None = None,
                 on_halted: Callable[[str], None] | None = None, autostart: bool = True,
                 command_digest: Callable[[memoryview], int | None] | None = None) -> None:
        """``busy()``: whether the replica is serving requests right now (compaction writers then
        run at half speed). ``bind_address``: where to listen when not ``self_address``.
        ``ticker``: the ``kvps.raft.ticker.Ticker`` that ticks this group together with the
        process's others (None: pysyncobj's own tick thread). With a ticker, an applier that
        raises ``GroupHalted`` stops this group where it is (the entry stays unapplied, its
        sockets and journal are closed) and ``on_halted(reason)`` is called on the ticker's
        thread; without one the applier exits the process instead (``kvps.replica``).
        ``autostart=False`` (with a ticker): built, but not ticked until ``start()``, so nothing is
        applied (the journal's committed entries replay on the first ticks) before the owner
        has wired what its applier reads.
        ``command_digest``: the proposed commands carry their own checksums (kvps frames): the
        journal checks and digests each one with it (``kvps.raft.segments``)."""
        raft.validate()
        journal_dir = Path(journal_dir)
        journal_dir.mkdir(parents=True, exist_ok=True)
        dump_path = journal_dir / "raft.snapshot"
        first_index = compaction.prepare(dump_path)  # the journal's records below it are covered

        # Everything the tick thread may touch is set before SyncObj.__init__ starts it.
        self._raft = raft
        self._applier = applier
        self._on_role_change = on_role_change
        self._role = "follower"
        self._won_by: str | None = None
        self._pending: dict[int, Callable[[Any, int], None]] = {}
        self._pending_lock = threading.Lock()
        self._tokens = itertools.count()
        self._stopped = False
        self._tick_thread: threading.Thread | None = None
        self._ticker = ticker
        self._on_halted = on_halted
        self._destroyed = False  # by the ticker (halted or stopped)
        self._compaction = compaction.Compaction(dump_path, raft, snapshot_state, restore_state, busy)
        self._own_digests = segments.KnownDigests()  # of frames proposed here (propose)
        self._last_tick: float | None = None
        self._tick_wait = 0.0  # the wait between ticks this group last asked its ticker for
        self.tick_stalls = {"max_seconds": 0.0, "over_100ms": 0}  # tick thread gaps
        # An election waits for a majority of pre-votes (kvps.raft.prevote); fast failover's don't.
        self._prevote = PreVote(self, raft.election_timeout_min)
        self._failover = FastFailover(self, raft.fast_failover_stagger, on_scheduled=self._prevote.waive)
        # A replica whose lost data was replaced votes only once caught up (kvps.raft.recovery).
        self._recovery = Recovery(journal_dir)
        if self._recovery.active:
            logger.warning("raft %s: recovering lost state: no vote and no election until this "
                           "replica has caught up with a leader", self_address)

        conf = SyncObjConf(
            **syncobj_options(raft, journal_dir),
            serializer=self._compaction.serialize,
            deserializer=self._compaction.deserialize,
            serializeChecker=self._check_compaction,
            onStateChanged=self._on_state_changed,
            bindAddress=bind_address,
            autoTick=ticker is None,
        )
        # An idle leader heartbeats every quiet_heartbeat_period (kvps.raft.quiet).
        self._quiet = Quiet(self, conf, period=raft.quiet_period, after=raft.quiet_after,
                            heartbeat_period=raft.heartbeat_period,
                            fallback=raft.leader_fallback_timeout,
                            longest=raft.connection_timeout / 2,
                            election_timeout=self._SyncObj__generateRaftTimeout)
        transport = make_transport_class(
            secret=secret, context=context.encode(), max_frame_bytes=raft.max_frame_bytes,
            socket_buffer_bytes=raft.socket_buffer_bytes,
            on_peer_gone=self._failover.on_peer_gone if raft.fast_failover else None,
            on_send=self._quiet.mark if raft.quiet_period else None,
            defer_bind=ticker is not None)
        self._transport_stats = transport.stats
        others = [p for p in peers if p != self_address]

        def build() -> None:
            # On the ticker's thread (ticker.call) when there is one: nothing of this group is
            # seen by the shared poll before it is whole.
            poller = ticker.poller() if ticker is not None else None
            with using_journal(journal_dir / "raft.journal", fsync=raft.fsync,  # ours, not FileJournal
                               fsync_interval=raft.fsync_interval, first_index=first_index,
                               segment_bytes=raft.journal_segment_bytes,
                               on_damage=self._recover_from_damage,
                               digest=segments.prefixed_digest(_ENTRY_PREFIX, command_digest,
                                                               self._own_digests)), \
                    internals.using_poller(poller) if poller is not None else contextlib.nullcontext():
                SyncObj.__init__(self, self_address, others, conf, transportClass=transport)
            self.addOnTickCallback(self._note_tick_thread)
            if raft.quiet_period:
                self.addOnTickCallback(self._quiet.after_tick)
            if self._recovery.active:
                self.addOnTickCallback(self._check_recovered)
            if hasattr(internals.raft_log(self), "release_to"):  # ours, not a MemoryJournal
                self.addOnTickCallback(self._release_log)
            if ticker is not None:
                transport.deferring_bind = False  # its first ticks bind the Raft port
                self._group_poller = poller
                if autostart:
                    ticker.add(self, poller, on_halted=self._halted)

        if ticker is None:
            build()  # the tick thread starts inside
        else:
            ticker.call(build)

    # -- the one replicated method ------------------------------------------------------------

    @replicated
    def apply_command(self, data: bytes) -> Any:
        """Entries pickled by an older kvps; new ones arrive through ``_SyncObj__doApplyCommand``."""
        return self._apply_entry(data)

    def _SyncObj__doApplyCommand(self, command: Any) -> Any:  # noqa: N802 (pysyncobj's name)
        """pysyncobj's ``__doApplyCommand`` for our entries (see the module docstring). A large
        entry a follower received is a read-only view of its frame (``kvps.raft.wire``), not
        ``bytes``: pysyncobj's own code (``ord(command[:1])``) gets a copy of any such entry
        that is not ours (none is, but an older kvps's pickled ones)."""
        if command[:2] == _ENTRY_PREFIX:
            return self._apply_entry(memoryview(command)[2:])
        return internals.stock_do_apply_command(self, bytes(command))

    def _SyncObj__parseChangeClusterRequest(self, command: Any) -> Any:  # noqa: N802
        """pysyncobj reads every appended entry's type with ``ord(command[:1])``, which a view
        (a large entry as a follower received it) does not take; membership commands are small,
        always ``bytes``, so a view is never one."""
        if type(command) is not bytes:
            return None
        return internals.stock_parse_change_cluster_request(self, command)

    # -- recovery of lost state (kvps.raft.recovery) ------------------------------------------

    def _SyncObj__onMessageReceived(self, node: Any, message: Any) -> None:  # noqa: N802
        if self._recovery.withholds(message, internals.current_term(self)):
            return
        if self._prevote.on_message(node, message, self._recovery.active):
            return
        if not compaction.is_last_install_chunk(message):
            internals.stock_on_message_received(self, node, message)
            if self._quiet.period and is_append(message):
                self._prevote.quiet_window = self._quiet.on_append(node, message)
            return
        # pysyncobj renames the received snapshot over ours on this thread now; freeing ours
        # must not happen here (kvps.raft.compaction). It then sets our members to the
        # snapshot's, which may predate the leader sending it: the leader is kept among them.
        with self._compaction.replacing_dump(), self._compaction.installing_from(node.address):
            internals.stock_on_message_received(self, node, message)

    def _SyncObj__generateRaftTimeout(self) -> float:  # noqa: N802
        if self._recovery.active:
            return _NEVER  # no election of its own while recovering
        return internals.stock_generate_raft_timeout(self)

    # -- PreVote (kvps.raft.prevote) ----------------------------------------------------------

    def _onTick(self, timeToWait: float = 0.0) -> None:  # noqa: N802,N803 (pysyncobj's names)
        self._prevote.before_tick()  # may hold back the election pysyncobj is about to start
        self._quiet.before_tick()  # a still leader heartbeats less often (kvps.raft.quiet)
        super()._onTick(timeToWait)

    def next_tick(self, period: float) -> float:
        """The ticker's hint: seconds until this group needs a tick with no event."""
        self._tick_wait = period if self._recovery.active else self._quiet.next_tick(period)
        return self._tick_wait

    def _recover_from_damage(self, reason: str) -> None:
        """The journal found damage while ``SyncObj.__init__`` opened it: recover from here on. That
        ``__init__`` drew the first election deadline before it opened the journal, so hold it too
        (a recovering replica that stood for election would win with the lagging member's vote)."""
        self._recovery.enter(reason)
        internals.set_election_deadline(self, monotonic() + _NEVER)

    def _check_compaction(self) -> int:
        """pysyncobj's serializeChecker: the compaction's state. Once a new snapshot is in place,
        snapshots being sent to lagging followers restart from it, as pysyncobj's own forked
        serializer does; they would otherwise read on in the replaced file, which the next
        compaction overwrites in place (``kvps.raft.compaction``'s spare)."""
        status = self._compaction.check()
        if status == SERIALIZER_STATE.SUCCESS:
            restarted = internals.restart_transmissions(self)
            if restarted:
                logger.info("raft %s: %d snapshot transmission(s) restart from the new snapshot",
                            self.selfNode.address, restarted)
        return status

    def _check_recovered(self) -> None:
        if self._recovery.check(self):
            internals.set_election_deadline(self, monotonic() + self._SyncObj__generateRaftTimeout())

    @property
    def recovering(self) -> bool:
        """Whether this replica withholds its vote until it has caught up (lost data replaced)."""
        return self._recovery.active

    def _apply_entry(self, data: bytes | memoryview) -> Any:
        index = self.raftLastApplied + 1  # pysyncobj advances lastApplied after we return
        self._compaction.applied(len(data))
        try:
            result = self._applier(data)
        except GroupHalted:  # the ticker stops this group before it applies anything more
            raise
        except Exception as exc:  # must not escape: pysyncobj would re-apply this entry forever
            logger.critical("raft entry %d (%d bytes) raised in the applier: %r; recorded as "
                            "InvalidRequest", index, len(data), exc, exc_info=True)
            result = InvalidRequest(f"applying log entry {index} failed: {type(exc).__name__}: {exc}",
                                    index=index)
        if self._compaction.due(sending=internals.transmissions_in_flight(self) > 0):
            self.forceLogCompaction()
            self._reserve_segments()
        return result

    def _release_log(self) -> None:
        """After each tick: let the journal drop the payloads nobody needs in memory any more
        (``kvps.raft.log_memory``): applied here and, on a leader, held by every follower, unless
        the commands held pass ``log_memory_bytes``; a follower lacking a released one is then
        served from the journal."""
        log = internals.raft_log(self)
        upto = self.raftLastApplied
        if upto <= log.released_through:
            return  # nothing applied since the last release (every tick of a still group)
        if internals.is_leader(self) and log.held_bytes <= self._raft.log_memory_bytes:
            matches = internals.match_indexes(self)
            if matches:
                upto = min(upto, min(matches.values()))
        log.release_to(upto)

    def _reserve_segments(self) -> None:
        """Size the journal's segment pool for the log it will hold at its longest, once it first
        reaches a compaction: the log of a compaction interval before one is forced, another
        while it is written (a snapshot is written off the tick thread and pysyncobj only drops
        entries below the index it started at) and one more while the next one runs late, plus
        a largest command and the active segment. Measured on B1 (`kvps bench`): the pool grew
        to 6-8 segments of 16 MiB per replica with 32 MiB compaction intervals, one segment per
        new longest log over more than a minute of training."""
        raft = self._raft
        log = RESERVE_INTERVALS * self._compaction.threshold() + raft.max_command_bytes
        count = min(-(-int(log) // raft.journal_segment_bytes) + 1,
                    RESERVE_MAX_BYTES // raft.journal_segment_bytes)
        reserve = getattr(internals.raft_log(self), "reserve", None)
        if reserve is not None:
            reserve(count)

    # -- proposing ----------------------------------------------------------------------------

    def propose(self, data: bytes | Sequence[Any], callback: Callable[[Any, int], None]) -> None:
        """Submit ``data`` (bytes, or a list of buffers that make it up; with a ``digest``, as
        ``FrameParts`` have, the ``command_digest`` of their join, which the journal takes instead
        of hashing them again). ``callback(result, reason)`` fires once on the tick thread (or at
        once on this thread for QUEUE_FULL, COMMAND_TOO_LARGE and GROUP_STOPPED); ``reason`` is a
        pysyncobj ``FAIL_REASON`` or one of our codes; ``result`` is the applier's return value."""
        parts = data if isinstance(data, (list, tuple)) else (data,)
        if sum(len(p) for p in parts) > self._raft.max_command_bytes:
            callback(None, COMMAND_TOO_LARGE)
            return
        token = next(self._tokens)
        with self._pending_lock:
            stopped = self._stopped or self._destroyed
            if not stopped:
                self._pending[token] = callback
        if stopped:
            callback(None, GROUP_STOPPED)
            return
        command = b"".join((_ENTRY_PREFIX, *parts))  # queued as is: the type byte is in the prefix
        digest = getattr(data, "digest", None)  # a frame built here (kvps.delta.frame.FrameParts)
        key = None if digest is None else self._own_digests.note(command, digest)
        internals.apply_command(self, command,
                                lambda result, reason: self._settle(token, result, reason, key))

    def abandon_pending(self) -> int:
        """Answer every proposal still waiting with LEADER_CHANGED (outcome unknown).

        pysyncobj fails forwarded commands when leadership changes, but a command proposed on a
        leader that steps down waits until its index is applied, which for a partitioned old
        leader is when the partition heals. Callers retry with the same push id, which the
        applied table makes safe; if the entry does commit later, its callback finds nobody."""
        with self._pending_lock:
            pending, self._pending = self._pending, {}
        for callback in pending.values():
            callback(None, FAIL_REASON.LEADER_CHANGED)
        return len(pending)

    def _settle(self, token: int, result: Any, reason: int, digest_key: int | None = None) -> None:
        if digest_key is not None:
            self._own_digests.forget(digest_key)  # journaled by now, or never will be here
        with self._pending_lock:
            callback = self._pending.pop(token, None)
        if callback is not None:
            callback(result, reason)

    # -- status -------------------------------------------------------------------------------

    def is_leader(self) -> bool:
        return internals.is_leader(self)

    def leader_address(self) -> str | None:
        leader = internals.leader(self)
        return None if leader is None else leader.address

    def leader_reachable(self) -> bool:
        """This replica leads, or holds a connection to the leader it follows. A follower whose
        connection to its leader is down cannot tell a dead leader from a live one yet: it points
        clients nowhere rather than at a leader that may be gone (kvps.raft.failover elects a
        new one within ~0.1 s when it is)."""
        leader = internals.leader(self)
        return leader is not None and (leader == self.selfNode or self.isNodeConnected(leader))

    def term(self) -> int:
        return internals.term(self)

    def quorum(self) -> tuple[int, int]:
        """(members this replica is connected to, itself included; members of the group)."""
        others = list(self.otherNodes)
        return 1 + sum(1 for n in others if self.isNodeConnected(n)), 1 + len(others)

    def connected_peers(self) -> list[str]:
        """Peers with an authenticated connection, sorted."""
        return sorted(n.address for n in self.otherNodes if self.isNodeConnected(n))

    def peer_progress(self) -> dict[str, dict[str, Any]]:
        """Per peer: connected, and (on the leader) the highest log index it has acknowledged."""
        st = self.getStatus()  # pysyncobj's public debug dict; match_idx_* exists on leaders only
        return {n.address: {"connected": self.isNodeConnected(n),
                            "match_index": st.get("match_idx_server_" + n.id)}
                for n in sorted(self.otherNodes, key=lambda n: n.address)}

    def transport_stats(self) -> dict[str, int]:
        """Peer-traffic counters: frames/bytes sent and received, rejected connections."""
        return self._transport_stats.snapshot()

    def status(self) -> dict[str, Any]:
        leader = self.leader_address()
        return {
            "role": self._role,
            # how this replica won the leadership it holds: "election", "transfer" (asked by
            # the previous leader: a move, the leader spreader) or "fast-failover"; None unless leader
            "won_by": self._won_by if self._role == "leader" else None,
            "term": self.term(),
            "leader": leader,
            "commit_index": self.raftCommitIndex,
            "applied_index": self.raftLastApplied,
            "log_entries": internals.log_size(self),
            # commands the log holds in memory (bytes), and those released to the journal only
            "log_memory": self._log_memory(),
            "compactions": dict(self._compaction.counters),
            "tick_stalls": dict(self.tick_stalls),
            "fast_failovers": self._failover.scheduled,  # elections scheduled: the leader was gone
            "recovering": self._recovery.active,  # lost data replaced: no vote until caught up
            "recovering_reason": self._recovery.reason,
            "votes_withheld": self._recovery.votes_withheld,
            "pre_votes": dict(self._prevote.counters),  # asked, won, avoided, granted, refused
            # leading a still group that heartbeats every quiet period; times it became quiet /
            # busy again; quiet heartbeats honoured as a follower
            "quiet": {"now": self._quiet.quiet, **self._quiet.counters},
            # caught up once with a leader's commit index, and a leader is known now
            "ready": bool(self.isReady()) and leader is not None,
        }

    def _log_memory(self) -> dict[str, int] | None:
        log = internals.raft_log(self)
        if not hasattr(log, "release_to"):
            return None
        return {"held_bytes": log.held_bytes, "released_entries": log.released["entries"],
                "released_bytes": log.released["bytes"], "read_back_entries": log.reads["entries"],
                "read_back_bytes": log.reads["bytes"]}

    # -- lifecycle ----------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop the tick thread (close sockets, flush the journal) and wait for it to end.

        Commands whose outcome is still unknown get ``GROUP_STOPPED``. Idempotent. Called from the
        tick thread itself (inside a callback) it only requests the stop."""
        with self._pending_lock:
            if self._stopped:
                return
            self._stopped = True
        if self._ticker is not None:
            if self._ticker.on_thread():
                self._ticker.defer(self._destroy_now)  # after the tick this is called from
                return
            try:
                self._ticker.call(self._destroy_now, timeout=30.0)
            except RuntimeError:  # the ticker is gone: nothing ticks this group any more
                pass
        elif threading.current_thread() is self._tick_thread:
            self.destroy()
            return
        else:
            self.destroy_synchronous()
        self._compaction.join(timeout=60)
        self._fail_pending()

    def start(self) -> None:
        """Begin ticking a group built with ``autostart=False`` on its ticker."""
        if self._ticker is None:
            raise RuntimeError("only a group ticked by a ticker is started by hand")
        self._ticker.call(lambda: None if self._destroyed else
                          self._ticker.add(self, self._group_poller, on_halted=self._halted))

    def _fail_pending(self) -> None:
        with self._pending_lock:
            pending, self._pending = self._pending, {}
        for callback in pending.values():
            callback(None, GROUP_STOPPED)

    def _destroy_now(self) -> None:
        """Close this group's sockets and journal (the ticker's thread, between ticks)."""
        with self._pending_lock:  # proposals check it under this lock
            if self._destroyed:
                return
            self._destroyed = True
        self._ticker.remove(self)
        internals.destroy_now(self)

    def _halted(self, reason: str) -> None:
        """The applier raised ``GroupHalted`` (the ticker's thread): stop here, tell the owner."""
        self._destroy_now()
        self._fail_pending()
        if self._on_halted is not None:
            self._on_halted(reason)

    # -- tick-thread hooks --------------------------------------------------------------------

    def _note_tick_thread(self) -> None:
        now = time.monotonic()
        if self._tick_thread is None:
            self._tick_thread = threading.current_thread()
            if self._ticker is None:  # a ticker's thread keeps its own name
                name_native_thread("raft-tick")
        elif self._last_tick is not None:
            # How long the tick thread went without ticking: a gap near the election timeout
            # means heartbeats stopped (disk waits, GIL, CPU starvation); /v1/status shows it.
            # A quiet group asks to be ticked less often (next_tick): only the excess counts.
            gap = now - self._last_tick - self._tick_wait
            stalls = self.tick_stalls
            if gap > stalls["max_seconds"]:
                stalls["max_seconds"] = round(gap, 3)
            if gap > 0.1:
                stalls["over_100ms"] += 1
        self._last_tick = now

    def _on_state_changed(self, old: int, new: int) -> None:
        self._role = internals.ROLES.get(new, "follower")
        if self._role == "candidate":
            self._prevote.on_candidate(self.term())
        elif self._role == "leader":
            self._won_by = self._prevote.on_leader(self.term())
        if self._on_role_change is None:
            return
        try:
            self._on_role_change(self._role)
        except Exception:  # an exception here would abort pysyncobj mid state transition
            logger.exception("on_role_change(%r) raised", self._role)
