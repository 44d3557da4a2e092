"""The catalog of user snapshots a shard took part in: the replicated side of a snapshot.

``{id: {"id", "label", "created", "time", "state" (pending | sealed | complete), "keys", "names",
"digest", "size"}}``. The coordinator (``kvps.node.snapshots``) drives each snapshot through
``SnapshotStep`` commands; every step is idempotent (the coordinator retries). The files are the
replica's business: a cut asks for one (``WriteSnapshotFile``), and a restore is applied with the
state the file holds (``ShardState.apply_restore``). Part of the replicated state, in snapshots.
"""
from __future__ import annotations

from typing import Any

from kvps.command import SnapshotStep
from kvps.errors import InvalidRequest, KeyNotFound, KvpsError

__all__ = ["MAX_LISTED_KEYS", "SnapshotCatalog"]

MAX_LISTED_KEYS = 4096  # an entry names its keys up to this many (listings count keys once)


class SnapshotCatalog:
    def __init__(self, shard: int) -> None:
        self.shard = shard
        self.entries: dict[str, dict] = {}

    def step(self, cmd: SnapshotStep, keys: list[str]) -> tuple[dict, bool]:
        """Apply a cut, seal, commit or drop (``keys``: the shard's key names now); (the result,
        whether this step cut the snapshot: the first cut of an id is the snapshot, a retried cut
        changes nothing). Raises ``KvpsError`` before changing anything."""
        entry = self.entries.get(cmd.snap_id)
        if cmd.op == "cut":
            if entry is not None:
                return {"snapshot": dict(entry), "cut": False}, False
            entry = {"id": cmd.snap_id, "label": cmd.label, "created": cmd.at, "time": None,
                     "state": "pending", "keys": len(keys),
                     "names": sorted(keys) if len(keys) <= MAX_LISTED_KEYS else None,
                     "digest": "", "size": 0}
            self.entries[cmd.snap_id] = entry
            return {"snapshot": dict(entry), "cut": True}, True
        if cmd.op == "drop":
            return {"dropped": self.entries.pop(cmd.snap_id, None) is not None}, False
        if entry is None:
            raise KeyNotFound(f"no snapshot {cmd.snap_id!r} on shard {self.shard}", snapshot=cmd.snap_id)
        if cmd.op == "seal":
            if entry["state"] == "pending":
                entry.update(state="sealed", time=cmd.at)
            return {"snapshot": dict(entry)}, False
        if cmd.op == "commit":
            if entry["state"] == "pending":
                raise InvalidRequest(f"snapshot {cmd.snap_id!r} is not sealed", snapshot=cmd.snap_id)
            if entry["state"] == "sealed":
                entry.update(state="complete", digest=cmd.digest, size=cmd.size)
            return {"snapshot": dict(entry)}, False
        raise InvalidRequest("a restore is applied with the snapshot's state (apply_restore)",
                             snapshot=cmd.snap_id)

    def entry(self, snap_id: str) -> dict | None:
        found = self.entries.get(snap_id)
        return None if found is None else dict(found)

    def listing(self) -> list[dict]:
        return [dict(e) for _, e in sorted(self.entries.items())]

    def check_restore(self, cmd: SnapshotStep) -> KvpsError | None:
        entry = self.entries.get(cmd.snap_id)
        if cmd.op != "restore":
            return InvalidRequest("not a restore step")
        if entry is None or entry["state"] != "complete":
            return KeyNotFound(f"no complete snapshot {cmd.snap_id!r} on shard {self.shard}",
                               snapshot=cmd.snap_id)
        if entry["digest"] != cmd.digest:
            return InvalidRequest(f"snapshot {cmd.snap_id!r} of shard {self.shard} has digest "
                                  f"{entry['digest']}, the restore names {cmd.digest}",
                                  snapshot=cmd.snap_id)
        return None

    def load(self, entries: list[Any]) -> None:
        """Entries as ``listing`` gave them (a snapshot's meta)."""
        self.entries = {str(entry["id"]): dict(entry) for entry in entries}
