"""Commands: what the Raft log carries, one frame (kind 3) per entry.

Each command is a frozen dataclass with ``to_bytes()``; ``decode_command(data)`` is the inverse.
Meta holds ``"type"`` and the small fields; arrays travel as frame buffers, never in JSON. The frame
encoder sorts the meta's keys, so identical commands give identical bytes.

Commands are validated structurally when built (``InvalidRequest``), so a leader rejects malformed
input before proposing it, and a replica decoding a log entry applies the same checks. Whether the
command makes sense for the state (the key exists, the shapes match) is the shard's business.
Optimizer and initializer dicts are normalised (defaults filled in), so equal definitions are equal
dicts. Field checks are ``kvps.fields``.

Past the house's ~450 lines, on purpose: this is the one schema of the Raft log, every command and
its encoding side by side, so a change to the log format is one file to read.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any, Union

import numpy as np

from kvps.delta import frame
from kvps.delta import pack
from kvps.delta.pack import PACK_MAX_BYTES
from kvps import fields as F
from kvps.errors import InvalidRequest
from kvps.hyper import check_values
from kvps.initializer import initializer_from_dict, initializer_to_dict
from kvps.lifecycle import lifecycle_from_dict
from kvps.optimizer import normalized_optimizer
from kvps.placement import VALUE_DTYPES, DenseLayout

__all__ = [
    "Barrier",
    "ClockTick",
    "Command",
    "CreateKey",
    "CreateKeys",
    "CreateTable",
    "DeleteKey",
    "DenseDelta",
    "Hyperparams",
    "MERGE_MODES",
    "Push",
    "PushId",
    "RowDelta",
    "SNAPSHOT_OPS",
    "Set",
    "SetRows",
    "SnapshotStep",
    "decode_command",
]

MERGE_MODES = ("sum", "mean")
MAX_KEY_CHARS = 1024
MAX_CLIENT_CHARS = 128
MAX_LEASE_S = 86400.0  # a day: a longer lease would let a dead worker block its job indefinitely
DEFAULT_MAX_COMMAND_BYTES = 1 << 30  # raw-size cap when decoding; the leader bounds commands far lower


def _set_fields(obj: Any, **values: Any) -> None:
    for name, value in values.items():
        object.__setattr__(obj, name, value)  # frozen dataclasses: store normalised fields


def _same(a: Any, b: Any) -> bool:
    """Field equality where arrays compare by dtype, shape and bytes (bit-exact, NaN-safe)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and a.shape == b.shape and a.tobytes() == b.tobytes())
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, _Base) and isinstance(b, _Base):
        return a == b
    return type(a) is type(b) and a == b


class _Base:
    """Structural equality for dataclasses holding arrays (dataclass eq would compare arrays
    elementwise and fail)."""

    __hash__ = None  # type: ignore[assignment]

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        names = [f.name for f in fields(self)]  # type: ignore[arg-type]
        return all(_same(getattr(self, n), getattr(other, n)) for n in names)


# ---- commands -----------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class CreateKey(_Base):
    """Create dense ``key``; ``blocks`` are the (block, initial value) pairs this shard owns."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    block_rows: int
    optimizer: dict
    merge: str
    blocks: tuple[tuple[int, np.ndarray], ...]

    def __post_init__(self) -> None:
        F.string(self.key, "key", MAX_KEY_CHARS)
        layout = DenseLayout(self.shape, self.dtype, self.block_rows)  # validates all three
        if self.merge not in MERGE_MODES:
            raise F.bad("merge", f"one of {MERGE_MODES}")
        blocks = F.blocks(self.blocks)
        want = F.value_dtype(self.dtype)
        for b, arr in blocks:
            if not b < layout.n_blocks:
                raise InvalidRequest(f"block {b} out of range [0, {layout.n_blocks})", field="blocks")
            # (dtype.name takes ~9 us: asked only when the dtype is not the native one)
            if (arr.dtype != want and arr.dtype.name != self.dtype) or arr.shape != layout.block_shape(b):
                raise InvalidRequest(f"block {b} is {arr.dtype}{list(arr.shape)}, expected "
                                     f"{self.dtype}{list(layout.block_shape(b))}", field="blocks")
        _set_fields(self, shape=layout.shape, blocks=blocks,
                    optimizer=normalized_optimizer(self.optimizer), _layout=layout)

    @property
    def layout(self) -> DenseLayout:
        return self._layout  # type: ignore[attr-defined]  (set by __post_init__; layouts are frozen)

    def to_bytes(self) -> bytes:
        meta = {"type": "create_key", "key": self.key, "shape": list(self.shape), "dtype": self.dtype,
                "block_rows": self.block_rows, "optimizer": self.optimizer, "merge": self.merge,
                "blocks": [b for b, _ in self.blocks]}
        return _encode(meta, [arr for _, arr in self.blocks])


MAX_BATCH_KEYS = 4096  # keys in one CreateKeys: bounds one entry's apply time


@dataclass(frozen=True, eq=False)
class CreateKeys(_Base):
    """Many dense keys' creates in one entry (``Client.create_many``): one Raft round trip for
    thousands of small keys instead of one each. Applied in order, each exactly as its own
    ``CreateKey`` would be; one key's refusal (``KeyExists``) does not stop the others, and
    its result says so."""

    keys: tuple[CreateKey, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.keys, tuple) or not all(isinstance(k, CreateKey) for k in self.keys):
            raise F.bad("keys", "a tuple of CreateKey")
        if not 1 <= len(self.keys) <= MAX_BATCH_KEYS:
            raise InvalidRequest(f"a batch creates 1-{MAX_BATCH_KEYS} keys, not {len(self.keys)}",
                                 field="keys")
        if len({k.key for k in self.keys}) != len(self.keys):
            raise InvalidRequest("a key appears twice in one batch", field="keys")

    def to_bytes(self) -> bytes:
        """Blocks up to ``PACK_MAX_BYTES`` are packed, as a push's gradients are
        (``Push.to_parts``): ``"packed"`` holds one ``[pack, at, shape]`` per block of every key
        in order (null: an array of its own), the packs after the other arrays. Entries written
        before packing (no ``"packed"``) decode as they always did."""
        metas, arrays, small = [], [], []
        for k in self.keys:
            metas.append({"key": k.key, "shape": list(k.shape), "dtype": k.dtype,
                          "block_rows": k.block_rows, "optimizer": k.optimizer, "merge": k.merge,
                          "blocks": [b for b, _ in k.blocks]})
            for _, arr in k.blocks:
                if arr.nbytes <= PACK_MAX_BYTES:
                    small.append(arr)
                else:
                    arrays.append(arr)
        meta: dict[str, Any] = {"type": "create_keys", "keys": metas}
        if small:
            small_refs, packs = pack.pack(small)
            it = iter(small_refs)
            meta["packed"] = [None if arr.nbytes > PACK_MAX_BYTES else next(it)
                              for k in self.keys for _, arr in k.blocks]
            arrays += packs
        return _encode(meta, arrays)


@dataclass(frozen=True, eq=False)
class CreateTable(_Base):
    key: str
    dim: int
    dtype: str
    optimizer: dict
    init: dict
    merge: str
    lifecycle: dict | None = None  # kvps.lifecycle: cap, eviction, time-to-live, admission

    def __post_init__(self) -> None:
        F.string(self.key, "key", MAX_KEY_CHARS)
        F.integer(self.dim, "dim", 1)
        if self.dtype not in VALUE_DTYPES:
            raise F.bad("dtype", f"one of {VALUE_DTYPES}")
        if self.merge not in MERGE_MODES:
            raise F.bad("merge", f"one of {MERGE_MODES}")
        _set_fields(self, dim=int(self.dim),
                    optimizer=normalized_optimizer(self.optimizer),
                    init=initializer_to_dict(initializer_from_dict(self.init)))
        life = lifecycle_from_dict(self.lifecycle)
        _set_fields(self, lifecycle=None if life is None else life.to_dict())

    def to_bytes(self) -> bytes:
        life = {} if self.lifecycle is None else {"lifecycle": self.lifecycle}  # absent: old bytes
        return _encode({"type": "create_table", "key": self.key, "dim": self.dim, "dtype": self.dtype,
                        "optimizer": self.optimizer, "init": self.init, "merge": self.merge, **life})


@dataclass(frozen=True, eq=False)
class DeleteKey(_Base):
    key: str

    def __post_init__(self) -> None:
        F.string(self.key, "key", MAX_KEY_CHARS)

    def to_bytes(self) -> bytes:
        return _encode({"type": "delete_key", "key": self.key})


@dataclass(frozen=True, eq=False)
class PushId(_Base):
    """One client push merged into a ``Push``. ``floor``: the lowest seq the client still waits
    for (results below it may be forgotten); ``keys``: the keys it touched on this shard."""

    client: str
    seq: int
    floor: int
    keys: tuple[str, ...]
    # Checksum of the request's content (0: not given). Stored with the result, so an id that
    # comes back with different content is refused instead of answered as a duplicate.
    digest: int = 0

    def __post_init__(self) -> None:
        F.string(self.client, "client", MAX_CLIENT_CHARS)
        seq, floor = F.integer(self.seq, "seq"), F.integer(self.floor, "floor")
        if floor > seq:
            raise InvalidRequest("floor must be <= seq (the client still waits for seq)", field="floor")
        if not isinstance(self.keys, (tuple, list)):
            raise F.bad("keys", "a sequence of keys")
        digest = F.integer(self.digest, "digest")
        _set_fields(self, seq=seq, floor=floor, digest=digest,
                    keys=tuple(F.string(k, "keys", MAX_KEY_CHARS) for k in self.keys))

    def to_json(self) -> list:
        # the digest only when present, so commands without one encode exactly as before
        return [self.client, self.seq, self.floor, list(self.keys)] + ([self.digest] if self.digest else [])


@dataclass(frozen=True, eq=False)
class DenseDelta(_Base):
    key: str
    block: int
    grad: np.ndarray  # the block's shape and dtype
    count: int  # pushes summed into grad

    def __post_init__(self) -> None:
        key, block, count = self.key, self.block, self.count
        if (type(key) is str and 0 < len(key) <= MAX_KEY_CHARS and type(block) is int and block >= 0
                and type(count) is int and count >= 1 and F.is_value_array(self.grad)):
            return  # valid as given (a push of 10,000 small keys decodes this per key per replica)
        F.string(key, "key", MAX_KEY_CHARS)
        _set_fields(self, block=F.integer(block, "block"), count=F.integer(count, "count", 1),
                    grad=F.float_array(self.grad, "grad"))


@dataclass(frozen=True, eq=False)
class RowDelta(_Base):
    key: str
    ids: np.ndarray  # (n,) int64, sorted, unique
    grads: np.ndarray  # (n, dim)
    counts: np.ndarray  # (n,) int64 >= 1: pushes summed into each row

    def __post_init__(self) -> None:
        F.string(self.key, "key", MAX_KEY_CHARS)
        ids = F.int64_array(self.ids, "ids")
        counts = F.int64_array(self.counts, "counts")
        grads = F.float_array(self.grads, "grads")
        if grads.ndim != 2 or grads.shape[0] != len(ids) or len(counts) != len(ids):
            raise InvalidRequest("ids (n,), grads (n, dim) and counts (n,) disagree", field="grads")
        if len(ids) > 1 and not bool(np.all(ids[1:] > ids[:-1])):
            raise F.bad("ids", "sorted and unique")
        if len(counts) and int(counts.min()) < 1:
            raise F.bad("counts", ">= 1")


@dataclass(frozen=True, eq=False)
class Push(_Base):
    """Merged gradients of one or more client pushes; ``now`` is the leader's cluster time (kvps.clocks)."""

    now: float
    pushes: tuple[PushId, ...]
    dense: tuple[DenseDelta, ...]
    rows: tuple[RowDelta, ...]

    def __post_init__(self) -> None:
        for name, cls in (("pushes", PushId), ("dense", DenseDelta), ("rows", RowDelta)):
            items = getattr(self, name)
            if not isinstance(items, (tuple, list)) or not all(isinstance(x, cls) for x in items):
                raise F.bad(name, f"a sequence of {cls.__name__}")
            _set_fields(self, **{name: tuple(items)})
        _set_fields(self, now=F.time_stamp(self.now))
        if not self.pushes:
            raise InvalidRequest("a push entry names at least one push id", field="pushes")
        if len({(p.client, p.seq) for p in self.pushes}) != len(self.pushes):
            raise InvalidRequest("a push id appears twice in one entry", field="pushes")

    def to_bytes(self) -> bytes:
        return b"".join(self.to_parts())

    def to_parts(self, at: int = 0) -> list[bytes | memoryview]:
        """``to_bytes()`` as buffers to join (gradients as zero-copy views): the proposer joins
        them with its own prefix, one copy instead of two; ``at``: that prefix's length (the
        gradients are then aligned in the entry: ``frame.encode_parts``).

        Gradients up to ``PACK_MAX_BYTES`` are packed (``kvps.delta.pack``): one array per dtype
        after the rest, ``"packed"`` naming ``[pack, at, shape]`` per dense entry (null: an
        array of its own). Each frame array costs every replica ~20 us to decode; a push of
        1,250 small keys to a shard spent most of its apply there. Entries written before
        packing (no ``"packed"``) decode as they always did."""
        arrays: list[np.ndarray] = [d.grad for d in self.dense if d.grad.nbytes > PACK_MAX_BYTES]
        for r in self.rows:
            arrays += [r.ids, r.grads, r.counts]
        meta = {"type": "push", "now": self.now,
                "pushes": [p.to_json() for p in self.pushes],
                "dense": [[d.key, d.block, d.count] for d in self.dense],
                "rows": [r.key for r in self.rows]}
        if len(arrays) < len(self.dense) + 3 * len(self.rows):  # some were small
            small = [d.grad for d in self.dense if d.grad.nbytes <= PACK_MAX_BYTES]
            refs, packs = pack.pack(small)
            it = iter(refs)
            meta["packed"] = [None if d.grad.nbytes > PACK_MAX_BYTES else next(it) for d in self.dense]
            arrays += packs
        return frame.encode_parts(frame.KIND_COMMAND, meta, arrays, at=at)


@dataclass(frozen=True, eq=False)
class Set(_Base):
    """Compare-and-set of the blocks this shard owns; deduplicated by (client, seq) like a push."""

    now: float
    client: str
    seq: int
    floor: int
    key: str
    blocks: tuple[tuple[int, np.ndarray], ...]
    expected_version: int | None

    def __post_init__(self) -> None:
        pid = PushId(self.client, self.seq, self.floor, (self.key,))  # same id rules as a push
        ev = self.expected_version
        _set_fields(self, now=F.time_stamp(self.now), seq=pid.seq, floor=pid.floor,
                    key=F.string(self.key, "key", MAX_KEY_CHARS), blocks=F.blocks(self.blocks),
                    expected_version=None if ev is None else F.integer(ev, "expected_version"))

    @property
    def push_id(self) -> PushId:
        return PushId(self.client, self.seq, self.floor, (self.key,))

    def to_bytes(self) -> bytes:
        meta = {"type": "set", "now": self.now, "client": self.client, "seq": self.seq,
                "floor": self.floor, "key": self.key, "blocks": [b for b, _ in self.blocks],
                "expected_version": self.expected_version}
        return _encode(meta, [arr for _, arr in self.blocks])


@dataclass(frozen=True, eq=False)
class Barrier(_Base):
    """No state change: a new leader's first entry, and the linearizable-read barrier."""

    term: int
    replica: str

    def __post_init__(self) -> None:
        _set_fields(self, term=F.integer(self.term, "term"))
        if not isinstance(self.replica, str):
            raise F.bad("replica", "a string")

    def to_bytes(self) -> bytes:
        return _encode({"type": "barrier", "term": self.term, "replica": self.replica})


@dataclass(frozen=True, eq=False)
class ClockTick(_Base):
    """Worker ``worker`` of training job ``job`` has completed ``step`` steps; its clock lives until
    ``now + lease_s`` (leader time) unless renewed. ``lease_s == 0`` removes the worker (it left)."""

    now: float
    job: str
    worker: str
    step: int
    lease_s: float

    def __post_init__(self) -> None:
        lease = self.lease_s
        if isinstance(lease, bool) or not isinstance(lease, (int, float)) or not 0 <= lease <= MAX_LEASE_S:
            raise F.bad("lease_s", f"a number in [0, {MAX_LEASE_S}]")
        _set_fields(self, now=F.time_stamp(self.now), job=F.string(self.job, "job", MAX_KEY_CHARS),
                    worker=F.string(self.worker, "worker", MAX_CLIENT_CHARS), step=F.integer(self.step, "step"),
                    lease_s=float(lease))

    def to_bytes(self) -> bytes:
        return _encode({"type": "clock_tick", "now": self.now, "job": self.job, "worker": self.worker,
                        "step": self.step, "lease_s": self.lease_s})


@dataclass(frozen=True, eq=False)
class Hyperparams(_Base):
    """Change schedulable optimizer fields of ``key`` (a learning-rate schedule) as of worker step
    ``step``: the shard ignores an update stamped with an older step than the key's last one, so
    a slow worker cannot move the schedule back (see ``kvps.hyper``)."""

    key: str
    step: int
    values: dict

    def __post_init__(self) -> None:
        _set_fields(self, key=F.string(self.key, "key", MAX_KEY_CHARS), step=F.integer(self.step, "step"),
                    values=check_values(self.values))

    def to_bytes(self) -> bytes:
        return _encode({"type": "hyperparams", "key": self.key, "step": self.step, "values": self.values})


@dataclass(frozen=True, eq=False)
class SetRows(_Base):
    """Overwrite rows ``ids`` (sorted, unique) of table ``key`` with ``values`` (import): rows are
    created if missing, their optimizer state and step count are kept, versions grow by one."""

    key: str
    ids: np.ndarray     # (n,) int64
    values: np.ndarray  # (n, dim)

    def __post_init__(self) -> None:
        F.string(self.key, "key", MAX_KEY_CHARS)
        if not isinstance(self.ids, np.ndarray) or self.ids.dtype != np.int64 or self.ids.ndim != 1:
            raise F.bad("ids", "a 1-d int64 array")
        if len(self.ids) > 1 and not bool(np.all(np.diff(self.ids) > 0)):
            raise F.bad("ids", "sorted and unique")
        if not isinstance(self.values, np.ndarray) or self.values.ndim != 2 or len(self.values) != len(self.ids):
            raise F.bad("values", "a (len(ids), dim) array")

    def to_bytes(self) -> bytes:
        return _encode({"type": "set_rows", "key": self.key}, [self.ids, self.values])


SNAPSHOT_OPS = ("cut", "seal", "commit", "drop", "restore")
SNAPSHOT_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
MAX_LABEL_CHARS = 256


@dataclass(frozen=True, eq=False)
class SnapshotStep(_Base):
    """One step of a cluster-wide user snapshot, proposed on every shard by the coordinator
    (``kvps.snapshots``): ``cut`` (this log index is the snapshot; ``at`` = when it was asked for),
    ``seal`` (``at`` = the snapshot's timestamp, fixed once every shard has cut), ``commit`` (every
    shard's file is written; ``digest`` and ``size`` of this shard's file), ``drop``, and ``restore``
    (replace the keys with the snapshot's; ``digest`` must match the committed one)."""

    op: str
    snap_id: str
    at: float = 0.0
    label: str = ""
    digest: str = ""
    size: int = 0

    def __post_init__(self) -> None:
        if self.op not in SNAPSHOT_OPS:
            raise F.bad("op", f"one of {SNAPSHOT_OPS}")
        if not isinstance(self.snap_id, str) or not SNAPSHOT_ID.match(self.snap_id):
            raise F.bad("snap_id", "1-64 characters of [A-Za-z0-9._-]")
        if not isinstance(self.label, str) or len(self.label) > MAX_LABEL_CHARS:
            raise F.bad("label", f"a string of at most {MAX_LABEL_CHARS} characters")
        if not isinstance(self.digest, str) or len(self.digest) > 128:
            raise F.bad("digest", "a string of at most 128 characters")
        _set_fields(self, at=F.time_stamp(self.at), size=F.integer(self.size, "size"))

    def to_bytes(self) -> bytes:
        return _encode({"type": "snapshot", "op": self.op, "snap_id": self.snap_id, "at": self.at,
                        "label": self.label, "digest": self.digest, "size": self.size})


Command = Union[CreateKey, CreateKeys, CreateTable, DeleteKey, Push, Set, Barrier, ClockTick, SetRows, SnapshotStep,
                Hyperparams]


# ---- encoding -----------------------------------------------------------------------------------

def _encode(meta: dict, arrays: list[np.ndarray] = ()) -> bytes:  # type: ignore[assignment]
    return frame.encode(frame.KIND_COMMAND, meta, arrays)


def _take(arrays: tuple[np.ndarray, ...], n: int, at: list[int]) -> list[np.ndarray]:
    """The next ``n`` arrays (``at`` is a one-element cursor)."""
    start = at[0]
    if start + n > len(arrays):
        raise InvalidRequest("command names more arrays than it carries")
    at[0] = start + n
    return list(arrays[start:start + n])


def _raise_bad_push_id():
    raise InvalidRequest("malformed push id in command")


def _resolve_packed(arrays: tuple, at: list[int], refs: list, own: list, what: str) -> list:
    """One value per reference in ``refs``: the next of ``own`` (arrays of their own) for a null
    one, else a view of the packs, which are every array from ``at[0]`` on (all consumed)."""
    packs, given = arrays[at[0]:], iter(own)
    try:
        values = [next(given) if r is None else pack.view(packs, r) for r in refs]
    except ValueError as exc:
        raise InvalidRequest(f"malformed packed {what}: {exc}") from None
    if {r[0] for r in refs if r is not None} != set(range(len(packs))):
        raise InvalidRequest("command carries unnamed arrays")
    at[0] = len(arrays)
    return values


def _decode_push(m: dict, arrays: tuple) -> Push:
    at = [0]
    pushes = tuple(PushId(p[0], p[1], p[2], tuple(p[3]), *p[4:5]) if isinstance(p, list) and 4 <= len(p) <= 5
                   else _raise_bad_push_id() for p in m["pushes"])
    refs = m.get("packed")  # absent: every gradient an array of its own (entries before packing)
    if refs is None:
        grads = _take(arrays, len(m["dense"]), at)
    elif not isinstance(refs, list) or len(refs) != len(m["dense"]):
        raise InvalidRequest("'packed' names one reference per dense entry")
    else:
        grads = _take(arrays, sum(r is None for r in refs), at)
    rows = tuple(RowDelta(k, *_take(arrays, 3, at)) for k in m["rows"])
    if refs is not None:
        grads = _resolve_packed(arrays, at, refs, grads, "gradient")
    dense = tuple(DenseDelta(k, b, g, c) for (k, b, c), g in zip(m["dense"], grads))
    if at[0] != len(arrays):
        raise InvalidRequest("command carries unnamed arrays")
    return Push(m["now"], pushes, dense, rows)


def _decode_blocks(m: dict, arrays: tuple) -> tuple[tuple[int, np.ndarray], ...]:
    ids = m["blocks"]
    if not isinstance(ids, list) or len(ids) != len(arrays):
        raise InvalidRequest("block ids and arrays disagree")
    return tuple(zip(ids, arrays))


def _decode_create_keys(m: dict, arrays: tuple) -> CreateKeys:
    at, keys = [0], []
    if not isinstance(m["keys"], list):
        raise InvalidRequest("create_keys: 'keys' must be a list")
    ids_of = [k["blocks"] if isinstance(k, dict) else None for k in m["keys"]]
    if not all(isinstance(ids, list) for ids in ids_of):
        raise InvalidRequest("block ids and arrays disagree")
    refs = m.get("packed")  # absent: every block an array of its own (entries before packing)
    total = sum(len(ids) for ids in ids_of)
    if refs is None:
        values = _take(arrays, total, at)
    elif not isinstance(refs, list) or len(refs) != total:
        raise InvalidRequest("'packed' names one reference per block")
    else:
        values = _resolve_packed(arrays, at, refs, _take(arrays, sum(r is None for r in refs), at), "block")
    if at[0] != len(arrays):
        raise InvalidRequest("command carries unnamed arrays")
    given = iter(values)
    for k, ids in zip(m["keys"], ids_of):
        keys.append(CreateKey(k["key"], tuple(k["shape"]), k["dtype"], k["block_rows"], k["optimizer"],
                              k["merge"], tuple((b, next(given)) for b in ids)))
    return CreateKeys(tuple(keys))


def _decode(m: dict, arrays: tuple) -> Any:
    kind = m["type"]
    if kind == "push":
        return _decode_push(m, arrays)
    if kind == "create_key":
        return CreateKey(m["key"], tuple(m["shape"]), m["dtype"], m["block_rows"], m["optimizer"],
                         m["merge"], _decode_blocks(m, arrays))
    if kind == "create_keys":
        return _decode_create_keys(m, arrays)
    if kind == "set":
        return Set(m["now"], m["client"], m["seq"], m["floor"], m["key"], _decode_blocks(m, arrays),
                   m["expected_version"])
    if kind == "set_rows":
        if len(arrays) != 2:
            raise InvalidRequest("set_rows carries ids and values")
        return SetRows(m["key"], arrays[0], arrays[1])
    if arrays:
        raise InvalidRequest(f"a {kind!r} command carries no arrays")
    if kind == "create_table":
        return CreateTable(m["key"], m["dim"], m["dtype"], m["optimizer"], m["init"], m["merge"],
                           m.get("lifecycle"))
    if kind == "delete_key":
        return DeleteKey(m["key"])
    if kind == "barrier":
        return Barrier(m["term"], m["replica"])
    if kind == "clock_tick":
        return ClockTick(m["now"], m["job"], m["worker"], m["step"], m["lease_s"])
    if kind == "hyperparams":
        return Hyperparams(m["key"], m["step"], m["values"])
    if kind == "snapshot":
        return SnapshotStep(m["op"], m["snap_id"], m["at"], m["label"], m["digest"], m["size"])
    raise InvalidRequest(f"unknown command type {kind!r}")


def decode_command(data: bytes, *, max_raw_bytes: int = DEFAULT_MAX_COMMAND_BYTES,
                   verify: bool = True) -> Command:
    """The command in ``data``: ``CodecError`` for a bad frame, ``InvalidRequest`` for bad content.

    Arrays in the result are read-only views of ``data``. ``verify=False``: the arrays'
    checksums are not checked again (a Raft entry: the journal checked them, see
    ``frame.verified_digest``).
    """
    f = frame.decode(data, max_raw_bytes=max_raw_bytes, kinds=(frame.KIND_COMMAND,), verify=verify)
    try:
        return _decode(f.meta, f.arrays)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # missing fields, wrong shapes of meta
        raise InvalidRequest(f"malformed command: {exc!r}") from exc
