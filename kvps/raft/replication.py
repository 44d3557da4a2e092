"""Two patches to pysyncobj's log replication, applied by the transport (which sees both sides).

Pure: no socket, no thread; ``AuthTransport`` calls these around ``TCPTransport``'s own send and
receive paths. ``tests/raft/test_raft_pin.py`` guards the SyncObj code they rely on;
``tests/raft/test_raft_group.py`` checks that followers receive each entry once and that a stale append
truncates nothing.

**Leader: keep nextIndex from moving backwards** (``AppendPipeline``). With
``appendEntriesUseBatch=False`` the leader sends every new entry at once and advances nextIndex
optimistically, so several append_entries are in flight per follower. But when a success reply
arrives, SyncObj sets nextIndex = the reply's next_node_idx, which is behind the entries still in
flight; the next send then re-sends them. Each follower gets most entries several times (halving
throughput with 4 commands in flight), and on receipt it deletes its log from the resent
prevLogIdx and re-adds the entries, logging "truncating already-applied log entries ... may have
diverged" (the entries are identical, so nothing diverges, but a size-limited resend briefly
leaves the follower's log shorter than its commit index). So right after such a reply the
transport restores nextIndex by delivering a synthetic "reset" reply (SyncObj's reset path sets
nextIndex only; matchIndex, which decides commits, is left to the real reply). Safety never
depends on nextIndex: a follower still checks prevLogIdx/prevLogTerm, and a lost in-flight append
makes it answer with a real reset, which wins. Forgotten on disconnect, on a real reset, on a
snapshot transfer and on a term change.

Back-pressure: SyncObj sends every entry to every follower at once, so a slow follower's queue
would grow without bound. Above 2 x max_frame_bytes queued for a peer, appends that carry entries
are not sent (heartbeats still are); the follower then answers the next heartbeat with a reset to
its real log end, and SyncObj re-sends from there once the queue has drained.

**Follower: never truncate entries we already hold from this leader** (``rebase_append``). On any
append_entries whose prevLogIdx is below its last index, SyncObj deletes its log from prevLogIdx +
1 and re-adds the message's entries, whether or not they differ ("truncating already-applied log
entries ... may have diverged"). Raft deletes only from the first *conflicting* entry. A stale or
re-sent append (a reconnect, a reset, a stall) can then cut entries this follower already
acknowledged, so the leader counts it for entries it no longer has. When our last entry carries
the leader's current term, the leader wrote it and still has it, so by Log Matching our log equals
the leader's up to there: the message is rewritten to append after our last entry (only its
entries beyond it, none truncated), and the reply (matching up to our last index) is true.
Anything else goes to SyncObj as sent.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["AppendPipeline", "is_append", "rebase_append"]


def is_append(message: Any) -> bool:
    return type(message) is dict and message.get("type") == "append_entries"


class AppendPipeline:
    """The leader's view of the appends in flight to each follower (see the module doc)."""

    def __init__(self, queue_cap: int) -> None:
        self._queue_cap = queue_cap  # bytes queued per peer above which appends wait
        self._sent_up_to: dict[Any, tuple[int, int]] = {}  # node -> (term, last index sent)

    def must_defer(self, node: Any, message: Any, queued_bytes: Callable[[], int]) -> bool:
        """Whether to hold back ``message``: an append with entries to a peer whose queue is full."""
        if is_append(message) and message.get("entries") and queued_bytes() > self._queue_cap:
            self._sent_up_to.pop(node, None)
            return True
        return False

    def after_send(self, node: Any, message: Any, sent: bool) -> None:
        if not is_append(message):
            return
        if not sent or "serialized" in message or "transmission" in message:
            self._sent_up_to.pop(node, None)  # not sent, or a snapshot chunk: no pipelining
        elif message.get("entries"):
            self._sent_up_to[node] = (message["term"], message["entries"][-1][1])

    def after_reply(self, node: Any, message: Any, leading: bool, term: int) -> dict | None:
        """After SyncObj handled ``message`` from ``node``: the synthetic reset reply that puts
        nextIndex back after the entries still in flight, if it moved behind them."""
        if type(message) is not dict or message.get("type") != "next_node_idx":
            return None
        if message.get("reset") or not message.get("success"):
            self._sent_up_to.pop(node, None)
            return None
        sent = self._sent_up_to.get(node)
        if sent is None or not leading or sent[0] != term:
            return None
        next_index = message.get("next_node_idx")
        if isinstance(next_index, int) and sent[1] + 1 > next_index:
            return {"type": "next_node_idx", "next_node_idx": sent[1] + 1, "reset": True,
                    "success": False}
        return None

    def forget(self, node: Any) -> None:
        self._sent_up_to.pop(node, None)


def rebase_append(log: Any, message: dict) -> dict:
    """``message`` (an append_entries to this follower) rewritten to append after the last entry
    of ``log`` (SyncObj's: ``len()`` and ``[i]`` give (command, index, term)) when it would only
    re-add entries we hold; ``message`` itself otherwise (see the module doc)."""
    if "prevLogIdx" not in message or "transmission" in message or "serialized" in message:
        return message
    if len(log) == 0:
        return message
    first, (_, last_idx, last_term) = log[0][1], log[len(log) - 1]
    prev, term, entries = message["prevLogIdx"], message["term"], message.get("entries") or []
    if not (isinstance(prev, int) and first <= prev < last_idx and last_term == term):
        return message
    if log[prev - first][2] != message["prevLogTerm"]:
        return message  # SyncObj answers with a reset
    for entry in entries:
        idx = entry[1]
        if idx > last_idx:
            break
        if log[idx - first][2] != entry[2]:
            return message  # a real conflict: SyncObj truncates, as Raft does
    return {**message, "prevLogIdx": last_idx, "prevLogTerm": last_term,
            "entries": [e for e in entries if e[1] > last_idx]}
