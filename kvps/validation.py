"""The rules a push or a set must meet on a shard: one set of checks for the leader, before it
proposes (``check_push``, ``check_set``), and for apply, which checks again on every replica and
returns the same errors as values. Pure: ``keys`` is the shard's ``{key: DenseKey | Table}``."""
from __future__ import annotations

from typing import Any

import numpy as np

from kvps.command import Push, PushId, Set
from kvps.dense import DenseKey
from kvps.errors import InvalidRequest, KeyNotFound, KvpsError, Unavailable
from kvps.merge import PushRequest, is_finite

__all__ = ["check_push", "check_set", "dense_error", "kind_error", "push_errors", "rejected",
           "rows_error"]


def push_errors(keys: dict[str, Any], shard: int, cmd: Push) -> dict[str, KvpsError]:
    """The first error per bad key of ``cmd`` (empty: everything fits)."""
    bad: dict[str, KvpsError] = {}
    seen: set = set()
    for d in cmd.dense:
        err = dense_error(keys, shard, d.key, d.block, d.grad, seen)
        if err is not None:
            bad.setdefault(d.key, err)
    for r in cmd.rows:
        err = rows_error(keys, shard, r.key, r.ids, r.grads, seen)
        if err is not None:
            bad.setdefault(r.key, err)
    for key in sorted({k for p in cmd.pushes for k in p.keys} - set(keys)):
        bad.setdefault(key, KeyNotFound(f"no key {key!r} on shard {shard}", key=key))
    return bad

def dense_error(keys: dict[str, Any], shard: int, key: str, block: Any, grad: Any, seen: set) -> KvpsError | None:
    err = kind_error(keys, shard, key, "dense")
    if err is None and (key, block) in seen:
        err = InvalidRequest(f"block {block} of {key!r} appears twice", key=key)
    seen.add((key, block))
    return err or keys[key].check_block(block, grad)  # type: ignore[union-attr]

def rows_error(keys: dict[str, Any], shard: int, key: str, ids: Any, grads: Any, seen: set | None) -> KvpsError | None:
    """``seen`` None: the table may appear more than once (a client push; merge sums them)."""
    err = kind_error(keys, shard, key, "table")
    if err is None and seen is not None and key in seen:
        err = InvalidRequest(f"table {key!r} appears twice", key=key)
    if err is None and (not isinstance(ids, np.ndarray) or ids.dtype != np.int64 or ids.ndim != 1):
        err = InvalidRequest("row ids must be a 1-d int64 array", key=key)
    if seen is not None:
        seen.add(key)
    return err or keys[key].check_rows(ids, grads)  # type: ignore[union-attr]

def kind_error(keys: dict[str, Any], shard: int, key: str, kind: str) -> KvpsError | None:
    entry = keys.get(key)
    if entry is None:
        return KeyNotFound(f"no key {key!r} on shard {shard}", key=key)
    if entry.kind != kind:
        return InvalidRequest(f"{key!r} is a {entry.kind} key, not a {kind} one", key=key)
    return None


def check_push(keys: dict[str, Any], shard: int, req: PushRequest, nonfinite: str = "reject") -> KvpsError | None:
    try:
        PushId(req.client, req.seq, req.floor, req.keys())
    except InvalidRequest as exc:
        return exc
    if not req.dense and not req.rows:
        return InvalidRequest("empty push")
    seen: set = set()
    for key, block, grad in req.dense:
        err = dense_error(keys, shard, key, block, grad, seen)
        if err is not None:
            return err
    for key, ids, grads in req.rows:
        err = rows_error(keys, shard, key, ids, grads, None)
        if err is not None:
            return err
    if nonfinite == "reject" and not is_finite(req):
        return InvalidRequest("gradient contains NaN or Inf", client=req.client, seq=req.seq)
    return None

def check_set(keys: dict[str, Any], shard: int, cmd: Set, nonfinite: str = "reject") -> KvpsError | None:
    err = kind_error(keys, shard, cmd.key, "dense")
    if err is not None:
        return err
    if not cmd.blocks:
        return InvalidRequest("a set names at least one block", key=cmd.key)
    entry: DenseKey = keys[cmd.key]  # type: ignore[assignment]
    for b, arr in cmd.blocks:
        err = entry.check_block(b, arr)
        if err is not None:
            return err
        if nonfinite == "reject" and not bool(np.isfinite(arr).all()):
            return InvalidRequest("value contains NaN or Inf", key=cmd.key, block=b)
    return None


def rejected(pushes: tuple[PushId, ...], bad: dict[str, KvpsError]) -> dict:
    """Results for an entry that applies nothing: ids naming a bad key get its error, the others
    (innocent, merged with them) a retryable error. Nothing is recorded."""
    culprits = {(p.client, p.seq): next((bad[k] for k in p.keys if k in bad), None) for p in pushes}
    if all(e is None for e in culprits.values()):  # no id names the bad key: blame the entry
        first = next(iter(bad.values()))
        return {pid: first for pid in culprits}
    return {pid: err if err is not None else
            Unavailable("merged entry rejected because of another push; retry", client=pid[0], seq=pid[1])
            for pid, err in culprits.items()}
