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

and deletes the file once its commit index points at an entry of the current term. Only the
current leader appends entries of its term, and that leader's log holds every committed entry
(Leader Completeness), so this replica's log, which matches the leader's up to that entry (Log
Matching), now holds them too: its vote is safe again.

The price: while the file exists the shard needs both other members to elect a leader; if the
leader dies before the replica has caught up, the shard waits for it to come back instead of
electing a member that may lack acknowledged entries (etcd's learners make the same trade).
The file survives a crash of the recovering replica, which then stays recovering after its
restart. A whole node's data directory lost is a different case (the node's markers are gone
too): that node must come back as a new node (README, "Guarantees").
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from kvps.raft.journal import _fsync_dir  # one helper for every durable rename/create here

__all__ = ["MARKER", "Recovery", "forget_hosted", "mark", "prepare_start"]

MARKER = "raft.recovering"

logger = logging.getLogger("kvps.raft")


def mark(journal_dir: Path) -> None:
    """Mark ``journal_dir`` as a replica's lost and replaced data (durably, before it starts)."""
    journal_dir.mkdir(parents=True, exist_ok=True)
    path = journal_dir / MARKER
    with open(path, "wb") as f:
        f.write(b"this replica lost its Raft state: it votes again once it has caught up\n")
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(journal_dir)
    _fsync_dir(journal_dir.parent)


def prepare_start(node_dir: Path, name: str) -> bool:
    """Called by a node before it starts its replica whose data lives in ``node_dir / name``.

    The first start records that this node hosts it (``node_dir/hosted/name``, fsynced); a later
    start that finds that record but no data marks the replica as recovering. True then."""
    hosted = node_dir / "hosted" / name
    data = node_dir / name
    has_data = data.is_dir() and any(data.iterdir())
    if hosted.exists():
        if has_data:
            return False
        mark(data)
        return True
    hosted.parent.mkdir(parents=True, exist_ok=True)
    with open(hosted, "wb") as f:
        os.fsync(f.fileno())
    _fsync_dir(hosted.parent)
    _fsync_dir(node_dir)
    return False


def forget_hosted(node_dir: Path, name: str) -> None:
    """The replica moved away and its data is deleted: a later move back starts it as new."""
    (node_dir / "hosted" / name).unlink(missing_ok=True)


class Recovery:
    """Whether a group is recovering (``active``), and the check that ends it (tick thread)."""

    def __init__(self, journal_dir: Path) -> None:
        self._path = Path(journal_dir) / MARKER
        self.active = self._path.exists()
        self.votes_withheld = 0  # vote requests dropped while recovering

    def withholds(self, message: Any) -> bool:
        """True for a vote request that must go unanswered."""
        if self.active and isinstance(message, dict) and message.get("type") == "request_vote":
            self.votes_withheld += 1
            return True
        return False

    def check(self, group: Any) -> bool:
        """End recovery if ``group``'s commit index points at an entry of its current term; True
        when it ended now. Uses pysyncobj internals pinned by tests/test_raft_pin.py."""
        if not self.active:
            return False
        term = group._SyncObj__raftCurrentTerm
        entries = group._SyncObj__getEntries(group._SyncObj__raftCommitIndex, 1)
        if term <= 0 or not entries or entries[0][2] != term:
            return False
        try:
            self._path.unlink()
            _fsync_dir(self._path.parent)
        except FileNotFoundError:
            pass
        except OSError as exc:  # it votes now; after a restart it recovers again (safe, slower)
            logger.error("raft: could not delete %s: %s", self._path, exc)
        self.active = False
        logger.warning("raft: caught up with the leader of term %d (commit index %d): this replica "
                       "votes again (%d vote requests withheld while recovering)",
                       term, group._SyncObj__raftCommitIndex, self.votes_withheld)
        return True
