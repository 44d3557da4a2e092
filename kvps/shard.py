"""The shard state machine: the versioned keys of one shard, the applied table, the worker
clocks and the user-snapshot catalog.

``apply(command) -> Applied`` (``kvps.machine``) is deterministic and never raises (pysyncobj
re-applies a raising entry forever): domain errors come back as ``KvpsError`` values, and every
handler validates everything before it mutates anything, so a rejected command leaves the state —
and ``state_hash()`` — as it was. What the replica must do because of a command comes back as
effects (new block versions to remember, a snapshot file to write, acknowledgements to hold).
Reads (``describe``, ``read_blocks``, ``read_rows``, ...) and the leader's pre-checks
(``check_push``, ``check_set``) are not part of apply and raise or return errors as documented.

Dense keys are ``kvps.dense``; table rows are updated in place (see ``kvps.table``); the rules a
push or a set must meet are ``kvps.validation``; the user-snapshot catalog is ``kvps.catalog``.

Past the house's ~450 lines, on purpose: this is the one state machine of a shard, and its apply
handlers, the reads of what they wrote and the snapshot format of all of it are kept in one place
(h11's "everything that affects the state machine lives in this file").
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np

from kvps.applied import AppliedTable, Result
from kvps.catalog import SnapshotCatalog
from kvps.clocks import ClockTable
from kvps.command import (
    Barrier, ClockTick, Command, CreateKey, CreateKeys, CreateTable, DeleteKey, Hyperparams, Push, Set,
    SetRows, SnapshotStep,
)
from kvps.delta import frame
from kvps.dense import Block, DenseKey, Slots, frozen
from kvps.errors import (
    CodecError, InvalidRequest, KeyExists, KeyNotFound, KvpsError, ShapeMismatch, Unavailable,
    VersionConflict,
)
from kvps.machine import (
    Applied, CompactLog, DropSnapshotFile, ForgetKey, ForgetVersions, HoldAcknowledgements,
    ReleaseAcknowledgements, RememberBlocks, RowsChurned, WriteSnapshotFile,
)
from kvps.hyper import HyperTable
from kvps.merge import PushRequest
from kvps import validation
from kvps.table import Table
from kvps.capacity import capacity_errors, table_lifecycle_info

__all__ = ["ShardState"]

SNAPSHOT_FORMAT = 1
DEFAULT_MAX_SNAPSHOT_BYTES = 1 << 40  # a snapshot is our own (checksummed) data; only sanity-capped

Entry = DenseKey | Table


class ShardState:
    def __init__(self, shard: int, *, session_ttl: float = 3600.0, dedup: bool = True,
                 memory_limit: int | None = None) -> None:
        self.shard = shard
        # bytes of table rows this replica may hold (None: unbounded); the same on every replica
        self.memory_limit = memory_limit
        self.session_ttl = float(session_ttl)
        # False is a debug switch (the chaos harness proves it catches double applies): no
        # duplicate check and no results recorded.
        self.dedup = dedup
        self._keys: dict[str, Entry] = {}
        self._slots: Slots | None = Slots()  # replaced block values, reused once unreferenced
        self._applied = AppliedTable(self.session_ttl)
        self._clocks = ClockTable()
        self._catalog = SnapshotCatalog(shard)
        self._hyper = HyperTable()  # learning-rate schedules: overrides of the keys' optimizers
        # cluster time: the largest time stamped into a command applied so far (kvps.clocks); the
        # time sessions and leases are judged by, never moving back
        self.time = 0.0

    # ---- apply ------------------------------------------------------------------------------

    def apply(self, cmd: Command) -> Applied:
        """Apply one committed command: its result (or a ``KvpsError`` value) and the effects it
        asks for; never an exception. A handler returns a result, or an ``Applied``."""
        handler = _HANDLERS.get(type(cmd))
        if handler is None:
            return Applied(InvalidRequest(f"not a command: {type(cmd).__name__}"))
        try:
            with np.errstate(all="ignore"):  # overflow in a user's gradient is their business
                out = handler(self, cmd)
        except KvpsError as exc:  # handlers raise only before they mutate
            return Applied(exc)
        except Exception as exc:  # noqa: BLE001 - a raising apply would be re-applied forever
            return Applied(InvalidRequest(f"could not apply {type(cmd).__name__}: {exc!r}"))
        return out if isinstance(out, Applied) else Applied(out)

    def _create_key(self, cmd: CreateKey) -> Applied:
        """Create the key, or add blocks it lacks: a client may split one key's create into several
        commands per shard. Blocks already here keep their value (a retried create is a no-op).
        ``created``: whether this command created the key or any block."""
        entry = DenseKey(cmd.key, cmd.layout, cmd.optimizer, cmd.merge)
        existing = self._keys.get(cmd.key)
        if existing is not None:
            if existing.definition() != entry.definition():
                raise KeyExists(f"key {cmd.key!r} exists with another definition", key=cmd.key)
            entry = existing  # type: ignore[assignment]
        for b, arr in cmd.blocks:
            if not 0 <= b < cmd.layout.n_blocks or arr.shape != cmd.layout.block_shape(b):
                raise InvalidRequest(f"block {b} does not fit key {cmd.key!r}", key=cmd.key, block=b)
        new = {b: entry.new_block(arr) for b, arr in cmd.blocks if b not in entry.blocks}
        if existing is None or new:
            entry.blocks = dict(sorted({**entry.blocks, **new}.items()))
            self._keys[cmd.key] = entry
        return Applied({"created": existing is None or bool(new)},
                       _remember(cmd.key, [(b, blk) for b, blk in sorted(new.items())]))

    def _create_keys(self, cmd: CreateKeys) -> Applied:
        """Each key as its own ``CreateKey``, in order; a refused one (its error in its place of
        ``results``) changes nothing and does not stop the rest."""
        results: list[dict] = []
        effects: list = []
        for one in cmd.keys:
            try:
                out = self._create_key(one)
            except KvpsError as exc:
                results.append(exc.to_dict())  # {"error": class name, ...}
                continue
            results.append(out.result)
            effects.extend(out.effects)
        return Applied({"results": results}, tuple(effects))

    def _create_table(self, cmd: CreateTable) -> dict:
        entry = Table(cmd.key, cmd.dim, cmd.dtype, cmd.optimizer, cmd.init, cmd.merge, cmd.lifecycle)
        if cmd.key not in self._keys:
            self._keys[cmd.key] = entry
            return {"created": True}
        if self._keys[cmd.key].definition() == entry.definition():
            return {"created": False}
        raise KeyExists(f"key {cmd.key!r} exists with another definition", key=cmd.key)

    def _delete_key(self, cmd: DeleteKey) -> Applied:
        self._hyper.drop(cmd.key)
        return Applied({"deleted": self._keys.pop(cmd.key, None) is not None}, (ForgetKey(cmd.key),))

    def _hyperparams(self, cmd: Hyperparams) -> dict:
        return self._hyper.update(cmd.key, self._entry(cmd.key), cmd.step, cmd.values)

    def check_hyperparams(self, cmd: Hyperparams) -> KvpsError | None:
        """The leader's pre-check (apply re-checks and returns the same error)."""
        try:
            self._hyper.check(cmd.key, self._entry(cmd.key), cmd.values)
        except KvpsError as exc:
            return exc
        return None

    def _barrier(self, cmd: Barrier) -> dict:
        return {"barrier": cmd.term}

    def _set_rows(self, cmd: SetRows) -> Applied:
        table = self._entry(cmd.key, "table")
        if cmd.values.shape[1] != table.dim or cmd.values.dtype != table.dtype:  # type: ignore[union-attr]
            raise ShapeMismatch(cmd.key, {"shape": ["n", table.dim], "dtype": table.dtype.name},  # type: ignore[union-attr]
                                {"shape": list(cmd.values.shape), "dtype": cmd.values.dtype.name})
        if not bool(np.isfinite(cmd.values).all()):
            raise InvalidRequest("row values contain NaN or Inf", key=cmd.key)
        churned = table.churned  # type: ignore[union-attr]
        table.commit(table.plan_set(cmd.ids, cmd.values, self.time))  # type: ignore[union-attr]
        churned = table.churned - churned  # type: ignore[union-attr]
        return Applied({"rows": len(cmd.ids)}, (RowsChurned(churned),) if churned else ())

    def _snapshot_step(self, cmd: SnapshotStep) -> Applied:
        """The catalog side of a user snapshot (``kvps.catalog``). The first cut of a snapshot
        asks for its file (the state as of this entry) and holds later acknowledgements until the
        seal fixes its time; seal and drop release them."""
        result, cut = self._catalog.step(cmd, list(self._keys))
        effects: tuple = ()
        if cut:
            meta, arrays = self.snapshot_parts()
            effects = (WriteSnapshotFile(cmd.snap_id, meta, tuple(arrays)),
                       HoldAcknowledgements(cmd.snap_id))
        elif cmd.op in ("seal", "drop"):
            effects = (ReleaseAcknowledgements(cmd.snap_id),)
        if cmd.op == "drop":
            effects += (DropSnapshotFile(cmd.snap_id),)
        return Applied(result, effects)

    def snapshot_entry(self, snap_id: str) -> dict | None:
        return self._catalog.entry(snap_id)

    def snapshot_catalog(self) -> list[dict]:
        return self._catalog.listing()

    def check_restore(self, cmd: SnapshotStep) -> KvpsError | None:
        return self._catalog.check_restore(cmd)

    def apply_restore(self, cmd: SnapshotStep, snap: "ShardState | None") -> Applied:
        """Replace the keys with ``snap``'s (the state the snapshot's file holds, checked against
        the committed digest by the caller; ``None`` if the caller could not load it, which is an
        error value and changes nothing).

        Versions only move forward: every restored block and row gets ``floor`` added, ``floor``
        being one more than any version on this shard now, so a client holding any cached version
        sees a change and pulls the value again. The applied table (exactly-once), the worker
        clocks and the snapshot catalog stay as they are: a push acknowledged before the restore
        and retried after it is still not applied twice. Never raises."""
        err = self.check_restore(cmd)
        if err is None and snap is None:
            err = Unavailable(f"snapshot {cmd.snap_id!r} of shard {self.shard} could not be loaded",
                              snapshot=cmd.snap_id)
        if err is not None or snap is None:
            return Applied(err)
        floor = 1 + max((self._version(k) for k in self._keys), default=0)
        keys: dict[str, Entry] = {}
        for key in sorted(snap._keys):
            entry = snap._keys[key]
            if isinstance(entry, DenseKey):
                entry.blocks = {b: Block(blk.value, blk.version + floor, blk.step, blk.state)
                                for b, blk in entry.blocks.items()}
            else:
                entry.bump_versions(floor)
            keys[key] = entry
        self._keys = keys
        self._hyper = snap._hyper  # the snapshot's entries carry its schedule overrides already
        return Applied({"restored": cmd.snap_id, "keys": len(keys), "version_floor": floor},
                       (ForgetVersions(), CompactLog()))

    def _clock_tick(self, cmd: ClockTick) -> dict:
        return {"clocks": self._clocks.tick(self._advance(cmd.now), cmd.job, cmd.worker, cmd.step,
                                            cmd.lease_s)}

    def _push(self, cmd: Push) -> Any:
        if self.dedup:
            found = {(p.client, p.seq): self._applied.lookup(p.client, p.seq) for p in cmd.pushes}
            if any(r is not None for r in found.values()):
                # Impossible after the new-leader barrier; checked anyway. Applying part of a
                # merged entry is impossible, so the honest ids are asked to retry.
                return {"results": {pid: r if r is not None else
                                    Unavailable("duplicate in merged entry; retry", client=pid[0], seq=pid[1])
                                    for pid, r in found.items()}}
        bad = validation.push_errors(self._keys, self.shard, cmd)
        if bad:  # below: the planned rows past the memory limit are refused the same way
            return {"results": validation.rejected(cmd.pushes, bad)}
        dense = [(self._keys[d.key], d.block,
                  self._keys[d.key].step_block(d.block, d.grad, d.count, self._slots))
                 for d in cmd.dense]  # type: ignore[union-attr]
        now = max(self.time, cmd.now)
        rows = [(self._keys[r.key], self._keys[r.key].plan(r.ids, r.grads, r.counts, now))  # type: ignore[union-attr]
                for r in cmd.rows]
        if bad := capacity_errors(self._keys, rows, self.memory_limit):
            return {"results": validation.rejected(cmd.pushes, bad)}
        for entry, b, block in dense:  # commit: nothing below can fail on bad input
            entry.replace_block(b, block, self._slots)
        churned = sum(table.churned for table, _ in rows)
        for table, update in rows:
            table.commit(update)
        churned = sum(table.churned for table, _ in rows) - churned
        results: dict[tuple[str, int], Result] = {}
        for p in cmd.pushes:
            results[(p.client, p.seq)] = {"versions": {k: self._version(k) for k in p.keys},
                                          **({"digest": p.digest} if p.digest else {})}
        now = self._advance(cmd.now)
        if self.dedup:
            self._applied.record([(p.client, p.seq, p.floor, results[(p.client, p.seq)])
                                  for p in cmd.pushes], now)
        effects = tuple(e for k, b, blk in dense for e in _remember(k.key, [(b, blk)]))
        return Applied({"results": results}, effects + ((RowsChurned(churned),) if churned else ()))

    def check_push(self, req: PushRequest, nonfinite: str = "reject") -> KvpsError | None:
        """The leader's pre-check of a push (``kvps.validation``)."""
        return validation.check_push(self._keys, self.shard, req, nonfinite)

    def check_set(self, cmd: Set, nonfinite: str = "reject") -> KvpsError | None:
        return validation.check_set(self._keys, self.shard, cmd, nonfinite)

    def _set(self, cmd: Set) -> Any:
        if self.dedup:
            done = self._applied.lookup(cmd.client, cmd.seq)
            if done is not None:
                return done
        err = self.check_set(cmd, nonfinite="allow")
        if err is not None:
            return err
        entry: DenseKey = self._keys[cmd.key]  # type: ignore[assignment]
        if cmd.expected_version is not None:
            for b, _ in cmd.blocks:
                actual = entry.blocks[b].version
                if actual != cmd.expected_version:
                    return VersionConflict(cmd.key, cmd.expected_version, actual, block=b)
        new = {}
        for b, arr in cmd.blocks:
            old = entry.blocks[b]  # the optimizer state carries over, as in torch after a copy_
            new[b] = Block(frozen(np.array(arr, copy=True)), old.version + 1, old.step, old.state)
        entry.blocks.update(new)
        result = {"versions": {cmd.key: entry.version()}}
        now = self._advance(cmd.now)
        if self.dedup:
            self._applied.record([(cmd.client, cmd.seq, cmd.floor, result)], now)
        return Applied(result, _remember(cmd.key, sorted(new.items())))

    def _advance(self, stamp: float) -> float:
        """A command stamped ``stamp`` has changed the state: the cluster time it happened at. A
        leader's stamp behind an earlier leader's does not move time back (kvps.clocks)."""
        self.time = max(self.time, stamp)
        return self.time

    def _version(self, key: str) -> int:
        entry = self._keys[key]
        return entry.version() if isinstance(entry, DenseKey) else entry.max_version

    # ---- reads --------------------------------------------------------------------------------

    def _entry(self, key: str, kind: str | None = None) -> Entry:
        entry = self._keys.get(key)
        if entry is None:
            raise KeyNotFound(f"no key {key!r} on shard {self.shard}", key=key)
        if kind is not None and entry.kind != kind:
            raise InvalidRequest(f"{key!r} is a {entry.kind} key, not a {kind} one", key=key)
        return entry

    def describe(self, key: str) -> dict | None:
        entry = self._keys.get(key)
        if entry is None:
            return None
        info = {"key": key, "kind": entry.kind, "dtype": entry.definition()["dtype"],
                "optimizer": entry.optimizer_dict, "merge": entry.merge, "version": self._version(key)}
        if self._hyper.info(key) is not None:  # schedule overrides on top of that optimizer
            info["hyperparams"] = self._hyper.info(key)
        if isinstance(entry, DenseKey):
            return {**info, "shape": list(entry.layout.shape), "block_rows": entry.layout.block_rows,
                    "blocks": sorted(entry.blocks)}
        return {**info, "dim": entry.dim, "init": entry.init_dict, "rows": entry.n,
                "bytes": entry.nbytes(), **table_lifecycle_info(entry)}

    def keys(self) -> list[dict]:
        return [self.describe(k) for k in sorted(self._keys)]  # type: ignore[misc]

    def merge_mode(self, key: str) -> str:
        return self._entry(key).merge

    def read_blocks(self, key: str, blocks: list[int]) -> list[tuple[int, np.ndarray]]:
        """(version, value) per block; values are read-only and never change (safe to keep)."""
        entry: DenseKey = self._entry(key, "dense")  # type: ignore[assignment]
        out = []
        for b in blocks:
            block = entry.blocks.get(b)
            if block is None:
                raise InvalidRequest(f"block {b!r} of {key!r} is not on shard {self.shard}", key=key)
            out.append((block.version, block.value))
        return out

    def block_versions(self, key: str, blocks: list[int]) -> list[int]:
        return [v for v, _ in self.read_blocks(key, blocks)]

    def read_rows(self, key: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        table: Table = self._entry(key, "table")  # type: ignore[assignment]
        if not isinstance(ids, np.ndarray) or ids.dtype.kind not in "iu" or ids.ndim != 1:
            raise InvalidRequest("row ids must be a 1-d integer array", key=key)
        return table.read(ids.astype(np.int64))

    def stored_rows(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids sorted, values) of every row of table ``key`` that is stored (copies)."""
        return self._entry(key, "table").stored()  # type: ignore[union-attr]

    def changed_rows(self, key: str, ids: np.ndarray, have: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the current version of every row in ``ids``, the values of those whose version differs
        from ``have``), from one lookup of the ids."""
        if not isinstance(ids, np.ndarray) or ids.dtype.kind not in "iu" or ids.ndim != 1:
            raise InvalidRequest("row ids must be a 1-d integer array", key=key)
        return self._entry(key, "table").changed(ids.astype(np.int64), have)  # type: ignore[union-attr]

    def clocks(self, job: str, now: float) -> dict[str, int]:
        """The live worker clocks of ``job`` at ``now`` (the reader's time)."""
        return self._clocks.live(job, now)

    def key_version_or_absent(self, key: str) -> int:
        """This shard's version of ``key``, exactly what a push or set on this shard returns for it
        (the highest block or row version here); -1 for a key this replica has not seen created."""
        return self._version(key) if key in self._keys else -1

    def current_versions(self, req: PushRequest) -> dict[str, int]:
        """The versions a push of ``req``'s keys would report now (one dropped on purpose)."""
        out: dict[str, int] = {}
        for key, block, _ in req.dense:
            out[key] = max(out.get(key, 0), self.block_versions(key, [block])[0])
        for key, ids, _ in req.rows:
            out[key] = max([out.get(key, 0), *map(int, self.read_rows(key, ids)[1])])
        return out

    def lookup_push(self, client: str, seq: int) -> Result | None:
        return self._applied.lookup(client, seq) if self.dedup else None

    # ---- leader pre-checks (the same rules apply re-checks) ------------------------------------

    def admit_push(self, req: PushRequest, nonfinite: str = "reject") -> tuple[
            KvpsError | None, Result | None, dict[str, str]]:
        """What the leader needs before it batches ``req``: the error that refuses it (or None),
        the stored result if the push id was applied already (or None), and the merge mode of
        each key it names (for the batcher)."""
        err = self.check_push(req, nonfinite)
        modes = {} if err is not None else {k: self._keys[k].merge for k in req.keys()}
        return err, self.lookup_push(req.client, req.seq), modes

    # ---- snapshot -------------------------------------------------------------------------------

    def snapshot(self) -> bytes:
        """Deterministic bytes: keys sorted, blocks and rows in order, the applied table included."""
        return frame.encode(frame.KIND_SNAPSHOT, *self.snapshot_parts())

    def snapshot_parts(self) -> tuple[dict, list[np.ndarray]]:
        """``snapshot()`` before encoding: the meta and the arrays, which stay valid while the state
        moves on (dense blocks are immutable and referenced; table rows are copied). Taking it is
        cheap for dense keys, so a writer thread can encode and write a consistent snapshot while
        the state machine keeps applying entries."""
        metas, arrays = [], []
        for key in sorted(self._keys):
            meta, arrs = self._keys[key].snapshot_parts()
            metas.append(meta)
            arrays += arrs
        sessions = json.dumps(self._applied.to_json(), sort_keys=True, separators=(",", ":"))
        # The applied table can be large: it travels as a buffer, not in the (capped) meta.
        arrays.append(np.frombuffer(sessions.encode("utf-8"), dtype=np.uint8))
        meta = {"format": SNAPSHOT_FORMAT, "shard": self.shard, "session_ttl": self.session_ttl,
                "dedup": self.dedup, "keys": metas}
        if self.time:  # only once stamped: older snapshots keep their bytes
            meta["time"] = self.time
        if self._clocks.jobs:  # only when present: snapshots without clocks keep their old bytes
            meta["clocks"] = self._clocks.to_json()
        if self._catalog.entries:  # likewise
            meta["snapshots"] = self._catalog.listing()
        if self._hyper.keys:  # likewise
            meta["hyper"] = self._hyper.to_json()
        return meta, arrays

    @classmethod
    def restore(cls, data: bytes, *, session_ttl: float | None = None, dedup: bool | None = None,
                max_raw_bytes: int = DEFAULT_MAX_SNAPSHOT_BYTES, memory_limit: int | None = None) -> "ShardState":
        """The state ``snapshot()`` wrote (``CodecError`` on anything else). ``session_ttl`` and
        ``dedup`` default to the snapshot's."""
        f = frame.decode(data, max_raw_bytes=max_raw_bytes, kinds=(frame.KIND_SNAPSHOT,))
        try:  # memory_limit is configuration, not state: never in the snapshot
            return cls._from_frame(f, session_ttl, dedup, memory_limit)
        except (KvpsError, KeyError, TypeError, ValueError, IndexError) as exc:
            raise CodecError(f"corrupt snapshot: {exc!r}") from exc

    @classmethod
    def _from_frame(cls, f: frame.Frame, session_ttl: float | None, dedup: bool | None,
                    memory_limit: int | None = None) -> "ShardState":
        m = f.meta
        if m["format"] != SNAPSHOT_FORMAT:
            raise ValueError(f"unknown snapshot format {m['format']!r}")
        state = cls(int(m["shard"]), session_ttl=m["session_ttl"] if session_ttl is None else session_ttl,
                    dedup=bool(m["dedup"]) if dedup is None else dedup, memory_limit=memory_limit)
        arrays = list(f.arrays)
        at = 0
        for meta in m["keys"]:
            entry, used = _entry_from_parts(meta, arrays[at:])
            state._keys[meta["key"]] = entry
            at += used
        if at != len(arrays) - 1:
            raise ValueError("snapshot carries unnamed arrays")
        state._applied.load_json(json.loads(arrays[-1].tobytes().decode("utf-8")))
        state._clocks.load_json(m.get("clocks", []))
        state.time = float(m.get("time", 0.0))  # older snapshots: the next stamp sets it
        state._catalog.load(m.get("snapshots", []))
        state._hyper.load_json(m.get("hyper", {}), state._keys)
        return state

    def state_hash(self) -> str:
        return hashlib.blake2b(self.snapshot(), digest_size=32).hexdigest()


def _remember(key: str, blocks: list[tuple[int, Block]]) -> tuple[RememberBlocks, ...]:
    """The effect that keeps new block versions for deltas (nothing when no block changed)."""
    if not blocks:
        return ()
    return (RememberBlocks(tuple((key, b, blk.version, blk.value) for b, blk in blocks)),)


def _entry_from_parts(meta: dict, arrays: list[np.ndarray]) -> tuple[Entry, int]:
    if meta["kind"] == "table":
        return Table.from_snapshot(meta, arrays)
    if meta["kind"] == "dense":
        return DenseKey.from_snapshot(meta, arrays)
    raise ValueError(f"unknown key kind {meta['kind']!r}")


_HANDLERS = {
    CreateKey: ShardState._create_key,
    CreateKeys: ShardState._create_keys,
    CreateTable: ShardState._create_table,
    DeleteKey: ShardState._delete_key,
    Push: ShardState._push,
    Set: ShardState._set,
    Barrier: ShardState._barrier,
    ClockTick: ShardState._clock_tick,
    SetRows: ShardState._set_rows,
    SnapshotStep: ShardState._snapshot_step,
    Hyperparams: ShardState._hyperparams,
}
