"""Log compaction of one group: our snapshot file, written off the tick thread.

pysyncobj's default compaction pickles and gzips the whole object on the tick thread, and counts
only entries (its in-memory log holds every entry until compaction). ``Compaction`` answers its
``serializer`` / ``deserializer`` / ``serializeChecker`` hooks instead (``ShardGroup`` passes
them), writes our own format (``kvps.raft.snapshot_file``), and is due after applied *bytes* as
well as entries (``applied``/``due``).

It runs off the tick thread: pysyncobj calls the serializer on the tick thread, which only takes
``snapshot_state()`` (a consistent view of the state: references to immutable blocks, copies of
what mutates in place) and hands the writer to a writer thread (one kept for the next,
``kvps.raft.threads.Workers``); the writer encodes and fsyncs
``raft.snapshot.partial``; ``serializeChecker`` (polled on the tick thread) renames it into place
when the writer is done and reports SUCCESS, and only then does pysyncobj drop the log entries it
covers. Every rename of the dump file happens on the tick thread, so a snapshot installed from
the leader meanwhile cannot be overwritten by an older one (the finished compaction is discarded
instead). pysyncobj renames its own ``.tmp`` into place right after the serializer returns; we
never create that file, so its rename fails quietly (the checker decides the outcome). Extra
memory while writing: the blocks replaced meanwhile.

Freeing a replaced snapshot's blocks (its last link unlinked) can wait seconds behind the
writeback queued in the device on a filesystem mounted with ``discard``: the tick thread never
drops a last link itself. A compaction links the snapshot it replaces first, and an install from
the leader does the same around pysyncobj's rename (``replacing_dump``); helper threads unlink.

A replaced snapshot of at most ``SPARE_MAX_BYTES`` is kept as ``raft.snapshot.spare`` instead, and
the next compaction's writer overwrites it in place: its pages are still in the page cache, where
a new file's pages are fresh memory (DESIGN §11; a B1 run compacts every replica every few
seconds). Bigger ones are unlinked, as their compactions are rare (``compact_ratio``) and a spare
would double the disk they take. A snapshot being sent to a lagging follower reads the file in
chunks over many ticks; when a compaction finishes, those transmissions restart from the new
file (``ShardGroup._check_compaction``), so none reads on in a spare being overwritten.
"""
from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pysyncobj.config import SERIALIZER_STATE
from pysyncobj.node import TCPNode

from kvps.config import RaftConfig
from kvps.raft import snapshot_file
from kvps.raft.threads import Workers

__all__ = ["Compaction", "is_last_install_chunk", "prepare"]

logger = logging.getLogger("kvps.raft")

SPARE = ".spare"  # a replaced snapshot kept for the next compaction to overwrite
SPARE_MAX_BYTES = 256 << 20
DEFER_FACTOR = 4  # a due compaction waits for a snapshot being sent up to this many times its bytes

# The process's snapshot writers and unlinkers: threads kept for the next job, not one per job.
_WRITERS = Workers("raft-snapshot", background=True)
_UNLINKERS = Workers("kvps-unlink")


def prepare(dump_path: Path) -> int:
    """Before a group starts on ``dump_path``: the index of its snapshot's previous entry (the
    journal's records below it are covered; 0 without a snapshot); removes what a compaction, an
    install or a crash cut short. Refuses to start on a corrupt snapshot (``CodecError``)."""
    first_index = 0
    if dump_path.exists():
        first_index = snapshot_file.read(dump_path).prev_entry[1]
    # a compaction or install cut short (a .spare is only bytes to overwrite: kept)
    for leftover in (".partial", ".tmp", ".1.tmp", ".old"):
        _unlink(str(dump_path) + leftover)
    for gone in dump_path.parent.glob(dump_path.name + "*.gone-*"):  # unlinks a crash cut short
        _unlink(str(gone))
    return first_index


def is_last_install_chunk(message: Any) -> bool:
    """Whether ``message`` carries the last chunk of a snapshot install (pysyncobj's append_entries
    with ``serialized`` = (data, is_first, is_last))."""
    if not isinstance(message, dict) or message.get("type") != "append_entries":
        return False
    serialized = message.get("serialized")
    try:
        return serialized is not None and bool(serialized[2])
    except (TypeError, IndexError):
        return False


class Compaction:
    """pysyncobj's serializer hooks for one group (tick thread), and its pacing by bytes."""

    def __init__(self, dump_path: Path, raft: RaftConfig, snapshot_state: Callable[[], Any],
                 restore_state: Callable[[memoryview], None],
                 busy: Callable[[], bool] | None = None) -> None:
        self.dump_path = dump_path
        self._busy = busy  # the replica is serving: writers run at half speed
        self._raft = raft
        self._snapshot_state = snapshot_state
        self._restore_state = restore_state
        self._writer: _Writer | None = None  # the writer in flight, if any
        self._install_leader: str | None = None  # the sender of a snapshot being installed
        self._installs = 0  # snapshots installed from a leader (a running compaction is then stale)
        self._applied_bytes = 0  # command bytes applied since the last compaction was forced
        self._state_bytes = 0  # size of the last snapshot written or loaded (compaction pacing)
        self._deferring = False  # a due compaction is waiting for a snapshot being sent
        self.counters = {"started": 0, "succeeded": 0, "failed": 0, "discarded": 0, "deferred": 0,
                         "last_seconds": 0.0, "last_bytes": 0}

    @property
    def running(self) -> bool:
        return self._writer is not None

    def applied(self, nbytes: int) -> None:
        self._applied_bytes += nbytes

    def threshold(self) -> float:
        """Command bytes applied between two compactions."""
        raft = self._raft
        return max(raft.compact_bytes, raft.compact_ratio * self._state_bytes)

    def due(self, sending: bool = False) -> bool:
        """Whether enough bytes were applied to force a compaction (then counts from zero).

        ``sending``: a snapshot is being sent to a lagging follower. pysyncobj sends no chunk
        while a compaction is being written, and one finishing restarts the send from the new
        snapshot (``ShardGroup._check_compaction``); a leader compacting back to back would never
        let a big snapshot through. So the compaction waits for the send, up to ``DEFER_FACTOR``
        times the usual bytes, which bounds the log a stuck or abandoned send can keep."""
        threshold = self.threshold()
        if self._applied_bytes < threshold:
            return False
        if sending and self._applied_bytes < DEFER_FACTOR * threshold:
            if not self._deferring:
                self._deferring = True
                self.counters["deferred"] += 1
            return False
        self._applied_bytes = 0
        self._deferring = False
        return True

    def join(self, timeout: float) -> None:
        """Wait for the writer in flight (stopping: a half-written .partial is harmless, but do not
        leave it)."""
        job = self._writer
        if job is not None:
            job.done.wait(timeout=timeout)

    @contextmanager
    def replacing_dump(self) -> Iterator[None]:
        """Around pysyncobj's rename of a received snapshot over ours: a second link to ours makes
        that rename drop a name, not the last one; a helper thread unlinks it afterwards."""
        replaced: str | None = _gone_name(str(self.dump_path))
        try:
            os.link(self.dump_path, replaced)
        except OSError:  # no snapshot yet (nothing to free), or no hard links: as before
            replaced = None
        try:
            yield
        finally:
            if replaced is not None:
                _unlink_in_background([replaced])

    @contextmanager
    def installing_from(self, leader: str) -> Iterator[None]:
        """Around the install of a snapshot sent by ``leader``: ``deserialize`` keeps it among the
        members it returns. A snapshot lists the members of its own time, and a leader that joined
        later (a move, a lost node's replacement) sends the one it was given, which does not name
        it; pysyncobj would set the installer's members to that list, drop its own leader and
        refuse its connection, so the entries that add the leader would never arrive. Members
        the snapshot names that have left since stay until those later entries remove them, as
        they would for a follower that replays its log. The superset only lasts until those
        entries arrive from the leader this replica is hearing, and while it hears a live leader
        PreVote keeps it from standing for election with it."""
        self._install_leader = leader
        try:
            yield
        finally:
            self._install_leader = None

    def serialize(self, path: str, data: tuple) -> None:
        """pysyncobj's serializer hook (tick thread): take the state's view, start the writer."""
        last_entry, prev_entry, cluster = data
        if self._writer is not None:  # pysyncobj does not call us while we report SERIALIZING
            return
        try:
            state = self._snapshot_state()
        except Exception:
            logger.exception("raft snapshot at entry %d: taking the state failed", last_entry[1])
            self._writer = _Writer.failed(last_entry[1])
            return
        snap = snapshot_file.RaftSnapshot(
            last_entry=(bytes(last_entry[0]), last_entry[1], last_entry[2]),
            prev_entry=(bytes(prev_entry[0]), prev_entry[1], prev_entry[2]),
            members=tuple(sorted(node.address for node in cluster)),
            state=b"")
        self.counters["started"] += 1
        self._writer = _Writer(snap, state, str(self.dump_path) + ".partial", self._installs,
                               dump=str(self.dump_path), busy=self._busy)
        self._writer.start()

    def check(self) -> int:
        """pysyncobj's serializeChecker (tick thread): the running compaction's state; renames the
        finished file into place before answering SUCCESS (pysyncobj then truncates the log)."""
        job = self._writer
        if job is None:
            return SERIALIZER_STATE.NOT_SERIALIZING
        if not job.done.is_set():
            return SERIALIZER_STATE.SERIALIZING
        self._writer = None
        if job.error is not None:
            self.counters["failed"] += 1
            logger.error("raft snapshot at entry %d failed: %r", job.index, job.error)
            return SERIALIZER_STATE.FAILED
        if job.installs != self._installs:  # a leader's snapshot replaced the state meanwhile
            self.counters["discarded"] += 1
            _unlink_elsewhere(job.partial, job.old)  # freeing blocks can wait seconds: not here
            logger.info("raft snapshot at entry %d discarded: a newer one was installed", job.index)
            return SERIALIZER_STATE.FAILED
        try:
            # No directory fsync here, on the tick thread: under heavy writes (another replica's
            # snapshot on the same disk) one can wait seconds for the filesystem journal and stall
            # the heartbeats. pysyncobj truncates the log next, and our journal makes that
            # durable with its own rename and fsync of this same directory, which persists this
            # rename too (renames in one directory reach the disk in order).
            os.replace(job.partial, self.dump_path)
            self._keep_or_drop(job)
        except OSError as exc:
            self.counters["failed"] += 1
            logger.error("raft snapshot at entry %d could not be put in place: %s", job.index, exc)
            return SERIALIZER_STATE.FAILED
        self.counters["succeeded"] += 1
        self.counters["last_seconds"] = round(job.seconds, 3)
        self.counters["last_bytes"] = job.nbytes
        self._state_bytes = job.nbytes
        logger.info("raft snapshot at entry %d: %d bytes written in %.3f s (writer thread)",
                    job.index, job.nbytes, job.seconds)
        return SERIALIZER_STATE.SUCCESS

    def _keep_or_drop(self, job: _Writer) -> None:
        """The snapshot ``job`` replaced (``job.old``): kept as the spare the next compaction
        overwrites when small enough and no spare is kept yet, else unlinked elsewhere."""
        spare = str(self.dump_path) + SPARE
        if 0 < job.old_bytes <= SPARE_MAX_BYTES and not os.path.exists(spare):
            try:
                os.rename(job.old, spare)  # a rename frees nothing: fine on the tick thread
                return
            except OSError:
                pass
        _unlink_elsewhere(job.old)

    def deserialize(self, path: str) -> tuple:
        """pysyncobj's deserializer hook (tick thread): restore the state from our snapshot file."""
        try:
            snap = snapshot_file.read(path)
            self._restore_state(snap.state)
        except Exception:  # pysyncobj logs and continues; make the cause visible
            logger.critical("raft snapshot %s could not be loaded", path, exc_info=True)
            raise
        self._applied_bytes = 0
        self._state_bytes = len(snap.state)
        self._installs += 1
        members = set(snap.members)
        leader = self._install_leader
        if leader is not None and leader not in members:
            members.add(leader)
            logger.info("raft snapshot from %s predates its membership (it names %s): kept the "
                        "leader among the members", leader, ", ".join(snap.members))
        logger.info("raft snapshot loaded: entry %d, %d state bytes", snap.last_entry[1],
                    len(snap.state))
        return snap.last_entry, snap.prev_entry, {TCPNode(m) for m in sorted(members)}


class _Writer:
    """One log compaction's writer (on a writer thread): encodes the state view, writes ``partial``."""

    def __init__(self, snap: snapshot_file.RaftSnapshot | None, state: Any, partial: str,
                 installs: int, dump: str = "", busy: Callable[[], bool] | None = None) -> None:
        self.snap = snap
        self.busy = busy
        self.state = state
        self.partial = partial
        self.dump = dump
        self.old = dump + ".old"
        self.installs = installs
        self.index = snap.last_entry[1] if snap is not None else -1
        self.error: BaseException | None = None
        self.done = threading.Event()  # set when the writer has finished (or was never needed)
        self.seconds = 0.0
        self.nbytes = 0
        self.old_bytes = 0  # size of the snapshot this one replaces (linked as ``old``)

    @classmethod
    def failed(cls, index: int) -> _Writer:
        job = cls(None, None, "", 0)
        job.index = index
        job.error = RuntimeError("taking the state failed (see the log)")
        job.done.set()
        return job

    def start(self) -> None:
        _WRITERS.submit(self._run)

    def _run(self) -> None:
        started = time.monotonic()
        try:
            if self.snap is None:  # only failed() jobs have none, and they never start
                raise RuntimeError("a compaction writer started without a snapshot")
            state = self.state() if callable(self.state) else self.state
            snap = snapshot_file.RaftSnapshot(self.snap.last_entry, self.snap.prev_entry,
                                              self.snap.members, state)
            try:  # the snapshot before last, kept to be overwritten (see the module docstring)
                os.rename(self.dump + SPARE, self.partial)
                reuse = True
            except OSError:
                reuse = False
            snapshot_file.write(self.partial, snap, busy=self.busy, reuse=reuse)
            self.nbytes = os.path.getsize(self.partial)
            # A second link to the snapshot the rename will replace: the tick thread then drops a
            # name, not the last one, and freeing a GB-sized file's blocks (which can wait on the
            # filesystem journal while other replicas write) happens on a helper thread.
            _unlink(self.old)
            try:
                os.link(self.dump, self.old)
                self.old_bytes = os.path.getsize(self.old)
            except FileNotFoundError:
                pass
        except BaseException as exc:  # reported through the checker, on the tick thread
            self.error = exc
            _unlink(self.partial)
        finally:
            self.state = None  # let the view's arrays go
            self.seconds = time.monotonic() - started
            self.done.set()


_gone = itertools.count()


def _gone_name(path: str) -> str:
    """A name of its own for a file about to be unlinked (``prepare`` removes ``*.gone-*`` left
    by a crash)."""
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
        for path in paths:
            _unlink(path)
    _UNLINKERS.submit(unlink_all)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
