"""``ShardGroup``: one shard's Raft group, the only ``SyncObj`` subclass in kvps.

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
* Log compaction writes our own snapshot format (``kvps.raft.snapshot_file``) through the
  ``serializer`` / ``deserializer`` / ``serializeChecker`` hooks and is triggered by applied
  *bytes* as well as entries (pysyncobj only counts entries, and its in-memory log holds every
  entry until compaction). It runs off the tick thread: pysyncobj calls the serializer on the tick
  thread, which only takes ``snapshot_state()`` (a consistent view of the state: references to
  immutable blocks, copies of what mutates in place) and starts a writer thread; the writer
  encodes and fsyncs ``raft.snapshot.partial``; ``serializeChecker`` (polled on the tick thread)
  renames it into place when the writer is done and reports SUCCESS, and only then does pysyncobj
  drop the log entries it covers. Every rename of the dump file happens on the tick thread, so a
  snapshot installed from the leader meanwhile cannot be overwritten by an older one (the
  finished compaction is discarded instead). pysyncobj renames its own ``.tmp`` into place right
  after the serializer returns; we never create that file, so its rename fails quietly (the
  checker decides the outcome). Extra memory while writing: the blocks replaced meanwhile.
* ``commandsWaitLeader=False``: a proposal made while no leader is known fails at once with
  MISSING_LEADER (retryable) instead of waiting, unbounded, in pysyncobj's queue.
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

import itertools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pysyncobj import SyncObj, SyncObjConf, replicated
from pysyncobj.config import FAIL_REASON, SERIALIZER_STATE
from pysyncobj.monotonic import monotonic
from pysyncobj.node import TCPNode
from pysyncobj.syncobj import _COMMAND_TYPE

# A REGULAR entry whose next byte is 0xFF holds our command bytes as they are: no pickle stream
# starts with 0xFF (protocol 2+ streams start with PROTO, 0x80), so older entries stay apart.
_ENTRY_PREFIX = bytes((_COMMAND_TYPE.REGULAR, 0xFF))

from kvps.config import RaftConfig
from kvps.errors import InvalidRequest
from kvps.raft import snapshot_file
from kvps.raft.failover import FastFailover
from kvps.raft.journal import name_native_thread, using_journal
from kvps.raft.recovery import Recovery
from kvps.raft.transport import make_transport_class

__all__ = ["COMMAND_TOO_LARGE", "GROUP_STOPPED", "ShardGroup", "syncobj_options"]

logger = logging.getLogger("kvps.raft")

# Our own failure codes, next to pysyncobj's FAIL_REASON values (0..7); bridge.py maps them.
COMMAND_TOO_LARGE = 100  # refused before proposing: len(data) > raft.max_command_bytes
GROUP_STOPPED = 101  # the group was stopped before the command's outcome was known

_ROLES = {0: "follower", 1: "candidate", 2: "leader"}  # pysyncobj's _RAFT_STATE values
_SNAPSHOT_CHUNK_BYTES = 4 * 1024 * 1024  # snapshot bytes per append_entries while installing one
_BATCH_HEADROOM = 64 * 1024  # appendEntriesBatchSizeBytes above max_command_bytes
_NEVER = 10.0 ** 9  # "no time-based compaction": compaction is by bytes and entries only


def syncobj_options(raft: RaftConfig, journal_dir: Path) -> dict[str, Any]:
    """``SyncObjConf`` keyword arguments for ``raft`` (SyncObjConf ignores unknown names silently:
    tests/test_raft_pin.py checks that every one of these still exists)."""
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
                 on_role_change: Callable[[str], None] | None = None) -> None:
        raft.validate()
        journal_dir = Path(journal_dir)
        journal_dir.mkdir(parents=True, exist_ok=True)
        dump_path = journal_dir / "raft.snapshot"
        first_index = 0  # the journal's records below this index are covered by the snapshot
        if dump_path.exists():  # refuse to start on a corrupt snapshot (CodecError)
            first_index = snapshot_file.read(dump_path).prev_entry[1]
        for leftover in (".partial", ".tmp", ".1.tmp", ".old"):  # a compaction or install cut short
            _unlink(str(dump_path) + leftover)
        for gone in journal_dir.glob("raft.snapshot*.gone-*"):  # unlinks a crash cut short
            _unlink(str(gone))

        # Everything the tick thread may touch is set before SyncObj.__init__ starts it.
        self._raft = raft
        self._applier = applier
        self._snapshot_state = snapshot_state
        self._restore_state = restore_state
        self._on_role_change = on_role_change
        self._role = "follower"
        self._applied_bytes = 0  # command bytes applied since the last compaction was forced
        self._pending: dict[int, Callable[[Any, int], None]] = {}
        self._pending_lock = threading.Lock()
        self._tokens = itertools.count()
        self._stopped = False
        self._tick_thread: threading.Thread | None = None
        self._dump_path = dump_path
        self._compaction: _Compaction | None = None  # the writer in flight, if any
        self._installs = 0  # snapshots installed from a leader (a running compaction is then stale)
        self.compactions = {"started": 0, "succeeded": 0, "failed": 0, "discarded": 0,
                            "last_seconds": 0.0, "last_bytes": 0}
        self._state_bytes = 0  # size of the last snapshot written or loaded (compaction pacing)
        self._last_tick: float | None = None
        self.tick_stalls = {"max_seconds": 0.0, "over_100ms": 0}  # tick thread gaps
        self._failover = FastFailover(self, raft.fast_failover_stagger)
        # A replica whose lost data was replaced votes only once caught up (kvps.raft.recovery).
        self._recovery = Recovery(journal_dir)
        if self._recovery.active:
            logger.warning("raft %s: recovering lost state: no vote and no election until this "
                           "replica has caught up with a leader", self_address)

        conf = SyncObjConf(
            **syncobj_options(raft, journal_dir),
            serializer=self._write_snapshot,
            deserializer=self._read_snapshot,
            serializeChecker=self._check_snapshot,
            onStateChanged=self._on_state_changed,
        )
        transport = make_transport_class(
            secret=secret, context=context.encode(), max_frame_bytes=raft.max_frame_bytes,
            socket_buffer_bytes=raft.socket_buffer_bytes,
            on_peer_gone=self._failover.on_peer_gone if raft.fast_failover else None)
        self._transport_stats = transport.stats
        with using_journal(journal_dir / "raft.journal", fsync=raft.fsync,  # ours, not FileJournal
                           fsync_interval=raft.fsync_interval, first_index=first_index,
                           on_damage=self._recover_from_damage):  # before the tick thread starts
            super().__init__(self_address, [p for p in peers if p != self_address], conf,
                             transportClass=transport)
        self.addOnTickCallback(self._note_tick_thread)
        if self._recovery.active:
            self.addOnTickCallback(self._check_recovered)

    # -- the one replicated method ------------------------------------------------------------

    @replicated
    def apply_command(self, data: bytes) -> Any:
        """Entries pickled by an older kvps; new ones arrive through ``_SyncObj__doApplyCommand``."""
        return self._apply_entry(data)

    def _SyncObj__doApplyCommand(self, command: bytes) -> Any:  # noqa: N802 (pysyncobj's name)
        """pysyncobj's ``__doApplyCommand`` for our entries (see the module docstring)."""
        if command[:2] == _ENTRY_PREFIX:
            return self._apply_entry(memoryview(command)[2:])
        return SyncObj._SyncObj__doApplyCommand(self, command)

    # -- recovery of lost state (kvps.raft.recovery) ------------------------------------------

    def _SyncObj__onMessageReceived(self, node: Any, message: Any) -> None:  # noqa: N802
        if self._recovery.withholds(message, self._SyncObj__raftCurrentTerm):
            return
        if not _last_install_chunk(message):
            SyncObj._SyncObj__onMessageReceived(self, node, message)
            return
        # pysyncobj renames the received snapshot over ours on this thread now. A second link to
        # ours makes that rename drop a name, not the last one: freeing the file's blocks waits,
        # on a filesystem mounted with ``discard``, behind all the writeback queued in the device
        # (seconds after heavy writes; seen in the tick thread's kernel stack as ``rename`` ->
        # ``evict`` -> ``blkdev_issue_discard``). A helper thread unlinks it afterwards.
        replaced = _gone_name(str(self._dump_path))
        try:
            os.link(self._dump_path, replaced)
        except OSError:  # no snapshot yet (nothing to free), or no hard links: as before
            replaced = None
        try:
            SyncObj._SyncObj__onMessageReceived(self, node, message)
        finally:
            if replaced is not None:
                _unlink_in_background([replaced])

    def _SyncObj__generateRaftTimeout(self) -> float:  # noqa: N802
        if self._recovery.active:
            return _NEVER  # no election of its own while recovering
        return SyncObj._SyncObj__generateRaftTimeout(self)

    def _recover_from_damage(self, reason: str) -> None:
        """The journal found damage while ``SyncObj.__init__`` opened it: recover from here on. That
        ``__init__`` drew the first election deadline before it opened the journal, so hold it too
        (a recovering replica that stood for election would win with the lagging member's vote)."""
        self._recovery.enter(reason)
        self._SyncObj__raftElectionDeadline = monotonic() + _NEVER

    def _check_recovered(self) -> None:
        if self._recovery.check(self):
            self._SyncObj__raftElectionDeadline = monotonic() + self._SyncObj__generateRaftTimeout()

    @property
    def recovering(self) -> bool:
        """Whether this replica withholds its vote until it has caught up (lost data replaced)."""
        return self._recovery.active

    def _apply_entry(self, data: bytes | memoryview) -> Any:
        index = self.raftLastApplied + 1  # pysyncobj advances lastApplied after we return
        self._applied_bytes += len(data)
        try:
            result = self._applier(data)
        except Exception as exc:  # must not escape: pysyncobj would re-apply this entry forever
            logger.critical("raft entry %d (%d bytes) raised in the applier: %r; recorded as "
                            "InvalidRequest", index, len(data), exc, exc_info=True)
            result = InvalidRequest(f"applying log entry {index} failed: {type(exc).__name__}: {exc}",
                                    index=index)
        if self._applied_bytes >= max(self._raft.compact_bytes,
                                      self._raft.compact_ratio * self._state_bytes):
            self._applied_bytes = 0
            self.forceLogCompaction()
        return result

    # -- proposing ----------------------------------------------------------------------------

    def propose(self, data: bytes | Sequence[Any], callback: Callable[[Any, int], None]) -> None:
        """Submit ``data`` (bytes, or a list of buffers that make it up); ``callback(result,
        reason)`` fires once on the tick thread (or at once on this thread for QUEUE_FULL,
        COMMAND_TOO_LARGE and GROUP_STOPPED). ``reason`` is a pysyncobj ``FAIL_REASON`` or one of
        our codes; ``result`` is the applier's return value."""
        parts = data if isinstance(data, (list, tuple)) else (data,)
        if sum(len(p) for p in parts) > self._raft.max_command_bytes:
            callback(None, COMMAND_TOO_LARGE)
            return
        token = next(self._tokens)
        with self._pending_lock:
            stopped = self._stopped
            if not stopped:
                self._pending[token] = callback
        if stopped:
            callback(None, GROUP_STOPPED)
            return
        command = b"".join((_ENTRY_PREFIX, *parts))  # queued as is: the type byte is in the prefix
        self._applyCommand(command, lambda result, reason: self._settle(token, result, reason))

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

    def _settle(self, token: int, result: Any, reason: int) -> None:
        with self._pending_lock:
            callback = self._pending.pop(token, None)
        if callback is not None:
            callback(result, reason)

    # -- status -------------------------------------------------------------------------------

    def is_leader(self) -> bool:
        return self._isLeader()

    def leader_address(self) -> str | None:
        leader = self._getLeader()
        return None if leader is None else leader.address

    def leader_reachable(self) -> bool:
        """This replica leads, or holds a connection to the leader it follows. A follower whose
        connection to its leader is down cannot tell a dead leader from a live one yet: it points
        clients nowhere rather than at a leader that may be gone (kvps.raft.failover elects a
        new one within ~0.1 s when it is)."""
        leader = self._getLeader()
        return leader is not None and (leader == self.selfNode or self.isNodeConnected(leader))

    def term(self) -> int:
        return self._getTerm()

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
            "term": self.term(),
            "leader": leader,
            "commit_index": self.raftCommitIndex,
            "applied_index": self.raftLastApplied,
            "log_entries": self._getRaftLogSize(),
            "compactions": dict(self.compactions),
            "tick_stalls": dict(self.tick_stalls),
            "fast_failovers": self._failover.scheduled,  # elections scheduled: the leader was gone
            "recovering": self._recovery.active,  # lost data replaced: no vote until caught up
            "recovering_reason": self._recovery.reason,
            "votes_withheld": self._recovery.votes_withheld,
            # caught up once with a leader's commit index, and a leader is known now
            "ready": bool(self.isReady()) and leader is not None,
        }

    # -- lifecycle ----------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop the tick thread (close sockets, flush the journal) and wait for it to end.

        Commands whose outcome is still unknown get ``GROUP_STOPPED``. Idempotent. Called from the
        tick thread itself (inside a callback) it only requests the stop."""
        with self._pending_lock:
            if self._stopped:
                return
            self._stopped = True
        if threading.current_thread() is self._tick_thread:
            self.destroy()
            return
        self.destroy_synchronous()
        job = self._compaction
        if job is not None and job.thread is not None:
            job.thread.join(timeout=60)  # a half-written .partial is harmless, but do not leave it
        with self._pending_lock:
            pending, self._pending = self._pending, {}
        for callback in pending.values():
            callback(None, GROUP_STOPPED)

    # -- tick-thread hooks --------------------------------------------------------------------

    def _note_tick_thread(self) -> None:
        now = time.monotonic()
        if self._tick_thread is None:
            self._tick_thread = threading.current_thread()
            name_native_thread("raft-tick")
        elif self._last_tick is not None:
            # How long the tick thread went without ticking: a gap near the election timeout
            # means heartbeats stopped (disk waits, GIL, CPU starvation); /v1/status shows it.
            gap = now - self._last_tick
            stalls = self.tick_stalls
            if gap > stalls["max_seconds"]:
                stalls["max_seconds"] = round(gap, 3)
            if gap > 0.1:
                stalls["over_100ms"] += 1
        self._last_tick = now

    def _on_state_changed(self, old: int, new: int) -> None:
        self._role = _ROLES.get(new, "follower")
        if self._on_role_change is None:
            return
        try:
            self._on_role_change(self._role)
        except Exception:  # an exception here would abort pysyncobj mid state transition
            logger.exception("on_role_change(%r) raised", self._role)

    def _write_snapshot(self, path: str, data: tuple) -> None:
        """pysyncobj's serializer hook (tick thread): take the state's view, start the writer."""
        last_entry, prev_entry, cluster = data
        if self._compaction is not None:  # pysyncobj does not call us while we report SERIALIZING
            return
        try:
            state = self._snapshot_state()
        except Exception:
            logger.exception("raft snapshot at entry %d: taking the state failed", last_entry[1])
            self._compaction = _Compaction.failed(last_entry[1])
            return
        snap = snapshot_file.RaftSnapshot(
            last_entry=(bytes(last_entry[0]), last_entry[1], last_entry[2]),
            prev_entry=(bytes(prev_entry[0]), prev_entry[1], prev_entry[2]),
            members=tuple(sorted(node.address for node in cluster)),
            state=b"")
        self.compactions["started"] += 1
        self._compaction = _Compaction(snap, state, str(self._dump_path) + ".partial", self._installs,
                                       dump=str(self._dump_path))
        self._compaction.start()

    def _check_snapshot(self) -> int:
        """pysyncobj's serializeChecker (tick thread): the running compaction's state; renames the
        finished file into place before answering SUCCESS (pysyncobj then truncates the log)."""
        job = self._compaction
        if job is None:
            return SERIALIZER_STATE.NOT_SERIALIZING
        if job.thread is not None and job.thread.is_alive():
            return SERIALIZER_STATE.SERIALIZING
        self._compaction = None
        if job.error is not None:
            self.compactions["failed"] += 1
            logger.error("raft snapshot at entry %d failed: %r", job.index, job.error)
            return SERIALIZER_STATE.FAILED
        if job.installs != self._installs:  # a leader's snapshot replaced the state meanwhile
            self.compactions["discarded"] += 1
            _unlink_elsewhere(job.partial, job.old)  # freeing blocks can wait seconds: not here
            logger.info("raft snapshot at entry %d discarded: a newer one was installed", job.index)
            return SERIALIZER_STATE.FAILED
        try:
            # No directory fsync here, on the tick thread: under heavy writes (another replica's
            # snapshot on the same disk) one can wait seconds for the filesystem journal and stall
            # the heartbeats. pysyncobj truncates the log next, and our journal makes that
            # durable with its own rename and fsync of this same directory, which persists this
            # rename too (renames in one directory reach the disk in order).
            os.replace(job.partial, self._dump_path)
            _unlink_elsewhere(job.old)
        except OSError as exc:
            self.compactions["failed"] += 1
            logger.error("raft snapshot at entry %d could not be put in place: %s", job.index, exc)
            return SERIALIZER_STATE.FAILED
        self.compactions["succeeded"] += 1
        self.compactions["last_seconds"] = round(job.seconds, 3)
        self.compactions["last_bytes"] = job.nbytes
        self._state_bytes = job.nbytes
        logger.info("raft snapshot at entry %d: %d bytes written in %.3f s (writer thread)",
                    job.index, job.nbytes, job.seconds)
        return SERIALIZER_STATE.SUCCESS

    def _read_snapshot(self, path: str) -> tuple:
        try:
            snap = snapshot_file.read(path)
            self._restore_state(snap.state)
        except Exception:  # pysyncobj logs and continues; make the cause visible
            logger.critical("raft snapshot %s could not be loaded", path, exc_info=True)
            raise
        self._applied_bytes = 0
        self._state_bytes = len(snap.state)
        self._installs += 1
        logger.info("raft snapshot loaded: entry %d, %d state bytes", snap.last_entry[1],
                    len(snap.state))
        return snap.last_entry, snap.prev_entry, {TCPNode(m) for m in snap.members}


class _Compaction:
    """One log compaction's writer thread: encodes the state view and writes ``partial``."""

    def __init__(self, snap: snapshot_file.RaftSnapshot | None, state: Any, partial: str,
                 installs: int, dump: str = "") -> None:
        self.snap = snap
        self.state = state
        self.partial = partial
        self.dump = dump
        self.old = dump + ".old"
        self.installs = installs
        self.index = snap.last_entry[1] if snap is not None else -1
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        self.seconds = 0.0
        self.nbytes = 0

    @classmethod
    def failed(cls, index: int) -> "_Compaction":
        job = cls(None, None, "", 0)
        job.index = index
        job.error = RuntimeError("taking the state failed (see the log)")
        return job

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name=f"kvps-compaction-{self.index}",
                                       daemon=True)
        self.thread.start()

    def _run(self) -> None:
        started = time.monotonic()
        background_priority()
        name_native_thread("raft-snapshot")
        try:
            assert self.snap is not None
            state = self.state() if callable(self.state) else self.state
            snap = snapshot_file.RaftSnapshot(self.snap.last_entry, self.snap.prev_entry,
                                              self.snap.members, state)
            snapshot_file.write(self.partial, snap)
            self.nbytes = os.path.getsize(self.partial)
            # A second link to the snapshot the rename will replace: the tick thread then drops a
            # name, not the last one, and freeing a GB-sized file's blocks (which can wait on the
            # filesystem journal while other replicas write) happens on a helper thread.
            _unlink(self.old)
            try:
                os.link(self.dump, self.old)
            except FileNotFoundError:
                pass
        except BaseException as exc:  # reported through the checker, on the tick thread
            self.error = exc
            _unlink(self.partial)
        finally:
            self.state = None  # let the view's arrays go
            self.seconds = time.monotonic() - started


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


_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}  # syscall numbers; glibc has no wrapper


def _lowest_io_priority(tid: int) -> None:
    import ctypes
    import platform

    number = _IOPRIO_SET.get(platform.machine())
    if number is None or not sys.platform.startswith("linux"):
        return
    best_effort, lowest = 2, 7  # IOPRIO_CLASS_BE, level 7 (0 is highest)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall(number, 1, tid, (best_effort << 13) | lowest)  # IOPRIO_WHO_PROCESS (a thread)
    except (OSError, AttributeError):
        pass


def _last_install_chunk(message: Any) -> bool:
    """Whether ``message`` carries the last chunk of a snapshot install (pysyncobj's append_entries
    with ``serialized`` = (data, is_first, is_last))."""
    if not isinstance(message, dict) or message.get("type") != "append_entries":
        return False
    serialized = message.get("serialized")
    try:
        return serialized is not None and bool(serialized[2])
    except (TypeError, IndexError):
        return False


_gone = itertools.count()


def _gone_name(path: str) -> str:
    """A name of its own for a file about to be unlinked (``ShardGroup`` removes ``*.gone-*``
    left by a crash at start)."""
    return f"{path}.gone-{os.getpid()}-{next(_gone)}"


def _unlink_elsewhere(*paths: str) -> None:
    """Unlink ``paths`` on a helper thread: the last link of a big file frees its blocks, which
    can wait seconds behind queued writeback (the tick thread must not). Each is first renamed to
    a name of its own (a rename onto a new name frees nothing), so the next compaction or install
    can reuse the path at once."""
    doomed = []
    for path in paths:
        target = _gone_name(path)
        try:
            os.rename(path, target)
        except OSError:
            continue
        doomed.append(target)
    _unlink_in_background(doomed)


def _unlink_in_background(paths: list[str]) -> None:
    if not paths:
        return

    def unlink_all() -> None:
        name_native_thread("kvps-unlink")  # else it shows as its creator, the tick thread
        for path in paths:
            _unlink(path)
    threading.Thread(target=unlink_all, daemon=True, name="kvps-unlink").start()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass

