"""A replica that lost its data withholds its vote until it has caught up with a leader.

Raft assumes that every member's log, term and vote survive a restart. A replica whose data
directory is lost (a disk replaced, a directory deleted) comes back empty and has forgotten the
entries it acknowledged: an entry committed with its help may now be on one other member only. If
it voted at once, it would vote for any candidate, also one that lacks that entry (its own empty
log is never "more up to date"); with its vote that candidate wins, and the entry is overwritten on
the member that still had it. Acknowledged writes are lost. It has also forgotten whom it voted for
in the current term, so it could vote twice in one term.

So the node marks such a replica (it knows it hosted the shard before, from a marker outside the
shard's directory; ``kvps.node``) with ``raft.recovering`` in the new, empty journal directory.
While that file exists, ``ShardGroup``:

* drops vote requests unanswered (no vote, no term taken from them);
* starts no election of its own (its election timer is held; a leader's ``timeout_now`` still
  starts one, and the leader sends that only to a member that acknowledged its whole log);

and deletes the file once its commit index (a) points at an entry of the current term and (b) has
reached the commit index the leader of that term announced in its first message to this replica
since it started. (a): only the current leader appends entries of its term, and that leader's log
holds every committed entry (Leader Completeness), so this replica's log, which matches the
leader's up to that entry (Log Matching), holds every entry committed in earlier terms. (b) covers
the entries of the current term itself: when the same leader still leads, entries this replica
acknowledged in its term before it lost them are past (a)'s entry; every one of them committed
with this replica's help was committed before the replica came back, so it lies at or below what
that leader announced then. Its vote is safe again.

A damaged journal (a complete record failing its checksum in the middle, ``kvps.raft.journal``)
is the same situation with part of the log kept: the entries after the damage may have been
acknowledged with this replica's help. The journal reports it while it opens, before it drops
anything, and ``Recovery.enter`` writes the same marker, so the replica keeps what precedes the
damage and votes again once caught up.

The price: while the file exists the shard needs both other members to elect a leader; if the
leader dies before the replica has caught up, the shard waits for it to come back instead of
electing a member that may lack acknowledged entries (etcd's learners make the same trade).
The file survives a crash of the recovering replica, which then stays recovering after its
restart. A whole node's data directory lost is a different case (the node's markers are gone
too): ``kvps.node.identity`` refuses it under its old id, unless it is started with ``--replace``,
which brings every replica of it up recovering.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from kvps.raft import internals
from kvps.raft.disk import fsync_dir  # one helper for every durable rename/create here

__all__ = ["MARKER", "REPLACED", "Recovery", "forget_hosted", "mark", "prepare_start"]

MARKER = "raft.recovering"
# in a node directory: the node was started with --replace (kvps.node.identity); every replica
# of it that starts without data lost what the replaced node held
REPLACED = "REPLACED"

logger = logging.getLogger("kvps.raft")


LOST = "its Raft state was lost"


def mark(journal_dir: Path, reason: str = LOST) -> None:
    """Mark ``journal_dir`` as a replica's lost and replaced data (durably, before it starts);
    ``reason`` (one line) is kept in the marker and shown in status."""
    journal_dir.mkdir(parents=True, exist_ok=True)
    path = journal_dir / MARKER
    with open(path, "wb") as f:
        f.write(f"{' '.join(reason.split())}\nit votes again once it has caught up\n".encode())
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(journal_dir)
    fsync_dir(journal_dir.parent)


def prepare_start(node_dir: Path, name: str) -> bool:
    """Called by a node before it starts its replica whose data lives in ``node_dir / name``.

    The first start records that this node hosts it (``node_dir/hosted/name``, fsynced); a later
    start that finds that record but no data marks the replica as recovering, as does a start
    without data on a node that replaced a lost one (``REPLACED``). True then."""
    hosted = node_dir / "hosted" / name
    data = node_dir / name
    has_data = data.is_dir() and any(data.iterdir())
    if hosted.exists() or (node_dir / REPLACED).exists():
        if has_data:
            return False
        mark(data)
        return True
    hosted.parent.mkdir(parents=True, exist_ok=True)
    with open(hosted, "wb") as f:
        os.fsync(f.fileno())
    fsync_dir(hosted.parent)
    fsync_dir(node_dir)
    return False


def forget_hosted(node_dir: Path, name: str) -> None:
    """The replica moved away and its data is deleted: a later move back starts it as new."""
    (node_dir / "hosted" / name).unlink(missing_ok=True)


class Recovery:
    """Whether a group is recovering (``active``), and the check that ends it (tick thread)."""

    def __init__(self, journal_dir: Path) -> None:
        self._path = Path(journal_dir) / MARKER
        self.active = self._path.exists()
        self.reason = _reason(self._path) if self.active else None
        self.votes_withheld = 0  # vote requests dropped while recovering
        # (term, commit index) announced by the first leader message of the newest term heard
        # since this replica started: (b) in the module docstring
        self._heard: tuple[int, int] | None = None

    def enter(self, reason: str) -> None:
        """Start recovering now (a damaged journal, found while it opens): durably marked first."""
        mark(self._path.parent, reason)
        self.active = True
        self.reason = reason

    def withholds(self, message: Any, current_term: int) -> bool:
        """True for a vote request that must go unanswered; notes what a leader announces."""
        if not self.active or not isinstance(message, dict):
            return False
        kind = message.get("type")
        if kind == "request_vote":
            self.votes_withheld += 1
            return True
        if kind == "append_entries":
            term, commit = message.get("term"), message.get("commit_index")
            if isinstance(term, int) and isinstance(commit, int) and term >= current_term \
                    and (self._heard is None or term > self._heard[0]):
                self._heard = (term, commit)
        return False

    def check(self, group: Any) -> bool:
        """End recovery once caught up (the module docstring's (a) and (b)); True when it ended
        now. Uses pysyncobj internals (``kvps.raft.internals``, pinned by tests/raft/test_raft_pin.py)."""
        if not self.active or self._heard is None:
            return False
        term = internals.current_term(group)
        commit = internals.commit_index(group)
        entries = internals.entries(group, commit, 1)
        if term <= 0 or not entries or entries[0][2] != term:
            return False
        heard_term, announced = self._heard
        if heard_term != term or commit < announced:
            return False
        try:
            self._path.unlink()
            fsync_dir(self._path.parent)
        except FileNotFoundError:
            pass
        except OSError as exc:  # it votes now; after a restart it recovers again (safe, slower)
            logger.error("raft: could not delete %s: %s", self._path, exc)
        self.active = False
        self.reason = None
        logger.warning("raft %s: caught up with the leader of term %d (commit index %d): this "
                       "replica votes again (%d vote requests withheld while recovering)",
                       group.selfNode.address, term, internals.commit_index(group), self.votes_withheld)
        return True


def _reason(path: Path) -> str:
    """The first line of a marker (older markers hold a sentence about lost state)."""
    try:
        first = path.read_text(errors="replace").splitlines()
    except OSError:
        return LOST
    return first[0] if first and not first[0].startswith("this replica lost") else LOST
