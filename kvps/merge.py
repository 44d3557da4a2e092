"""Merging concurrent client pushes into one ``Push`` command (the leader's batching step).

Sums are deterministic: dense gradients are added in request order; row gradients are accumulated
with ``np.add.at``, which adds in index order (no threaded or pairwise reductions). Followers never
merge: they apply the merged bytes, so only the leader's choice of order matters, and it is fixed.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from kvps.command import DenseDelta, Push, PushId, RowDelta
from kvps.delta import frame

__all__ = ["PushRequest", "comparable_digests", "content_digest", "is_finite", "merge", "request_bytes"]

_OVERHEAD = 64  # bytes per request/entry of framing, keys and ids: a rough but positive charge


@dataclass(frozen=True, eq=False)
class PushRequest:
    """One client push to one shard: dense ``(key, block, grad)`` and rows ``(key, ids, grads)``.

    ``floor`` is the lowest seq the client still waits for. Contents are checked by
    ``ShardState.check_push`` before merging.
    """

    client: str
    seq: int
    floor: int
    dense: tuple[tuple[str, int, np.ndarray], ...] = ()
    rows: tuple[tuple[str, np.ndarray, np.ndarray], ...] = ()
    digest: int = 0  # checksum of the content (see content_digest); 0: not computed

    def keys(self) -> tuple[str, ...]:
        """The keys this push touches, sorted."""
        return tuple(sorted({k for k, _, _ in self.dense} | {k for k, _, _ in self.rows}))


def request_bytes(req: PushRequest) -> int:
    """Approximate size of ``req`` (array bytes plus a fixed overhead per part)."""
    total = _OVERHEAD + len(req.client)
    total += sum(_OVERHEAD + len(k) + np.asarray(g).nbytes for k, _, g in req.dense)
    total += sum(_OVERHEAD + len(k) + np.asarray(i).nbytes + np.asarray(g).nbytes
                 for k, i, g in req.rows)
    return total


# A digest's tag says how it was computed, so digests computed differently are never compared (an
# applied table written by an older kvps): CRC-32 + 1 in [1, 2**32]; XXH3-64 over the gradient
# bytes in [2**33, 2**33 + 2**32); XXH3-64 over the arrays' XXH3 sums in [3 * 2**32, 4 * 2**32).
_XXH3_TAG = 2 << 32
_SUMS_TAG = 3 << 32


def content_digest(dense: Sequence[tuple[str, int, np.ndarray]],
                   rows: Sequence[tuple[str, np.ndarray, np.ndarray]]) -> int:
    """Checksum of what a push changes (keys, blocks, ids, gradient bytes): XXH3-64 of the keys and
    blocks and of each array's XXH3 sum (``frame.array_checksum``: for a raw gradient of 64 KiB
    or more, the sum its request frame was checked against on receipt, so the bytes are not
    read again), its low 32 bits tagged so that it is never 0 ("none"). It guards against a
    reused push id, not an adversary."""
    sums = [frame.array_checksum(g) for _, _, g in dense]
    for _, ids, g in rows:
        sums += (frame.array_checksum(ids), frame.array_checksum(g))
    h = xxhash.xxh3_64(repr([(k, int(b)) for k, b, _ in dense] + [k for k, _, _ in rows]).encode())
    h.update(np.array(sums, dtype="<u4").tobytes())
    return _SUMS_TAG | (h.intdigest() & 0xFFFFFFFF)


def comparable_digests(a: int, b: int) -> bool:
    """Whether two non-zero digests were computed the same way (an applied-table entry written
    before an upgrade holds a digest computed another way, which says nothing about this one)."""
    return bool(a) and bool(b) and max(1, a >> 32) == max(1, b >> 32)


def is_finite(req: PushRequest) -> bool:
    """Whether every gradient in ``req`` is free of NaN and Inf."""
    return (all(bool(np.isfinite(g).all()) for _, _, g in req.dense)
            and all(bool(np.isfinite(g).all()) for _, _, g in req.rows))


def merge(requests: Sequence[PushRequest], modes: Mapping[str, str], now: float) -> Push:
    """One ``Push`` for ``requests`` (a repeated (client, seq) is merged once: first wins).

    Per (key, block) and per row: the sum of the gradients, and ``count`` = the number of requests
    that touched it; ``modes[key] == "mean"`` divides the sum by that count.
    """
    unique: list[PushRequest] = []
    seen: set[tuple[str, int]] = set()
    for req in requests:
        if (req.client, req.seq) not in seen:
            seen.add((req.client, req.seq))
            unique.append(req)
    pushes = tuple(PushId(r.client, r.seq, r.floor, r.keys(), r.digest) for r in unique)
    return Push(now=now, pushes=pushes, dense=_merge_dense(unique, modes),
                rows=_merge_rows(unique, modes))


def _merge_dense(requests: Sequence[PushRequest], modes: Mapping[str, str]) -> tuple[DenseDelta, ...]:
    sums: dict[tuple[str, int], np.ndarray] = {}
    counts: dict[tuple[str, int], int] = {}
    for req in requests:
        touched = set()
        for key, block, grad in req.dense:
            kb = (key, int(block))
            # ``+`` makes a new array, so the request's (read-only) buffer is never written to and
            # a block pushed by one request alone needs no copy.
            sums[kb] = grad if kb not in sums else sums[kb] + grad
            if kb not in touched:
                touched.add(kb)
                counts[kb] = counts.get(kb, 0) + 1
    out = []
    for kb in sorted(sums):
        grad, count = sums[kb], counts[kb]
        if modes.get(kb[0], "sum") == "mean":
            grad = grad / grad.dtype.type(count)  # (block shape) same dtype
        out.append(DenseDelta(kb[0], kb[1], grad, count))
    return tuple(out)


def _merge_rows(requests: Sequence[PushRequest], modes: Mapping[str, str]) -> tuple[RowDelta, ...]:
    parts: dict[str, list[tuple[np.ndarray, np.ndarray, int]]] = {}
    for index, req in enumerate(requests):
        for key, ids, grads in req.rows:
            parts.setdefault(key, []).append((np.asarray(ids, dtype=np.int64).reshape(-1),
                                              np.asarray(grads), index))
    return tuple(_merge_table(key, parts[key], modes.get(key, "sum") == "mean")
                 for key in sorted(parts))


def _merge_table(key: str, parts: list[tuple[np.ndarray, np.ndarray, int]], mean: bool) -> RowDelta:
    all_ids = np.concatenate([ids for ids, _, _ in parts])  # (total,) int64
    all_grads = np.concatenate([g for _, g, _ in parts], axis=0)  # (total, dim)
    owner = np.concatenate([np.full(len(ids), i, dtype=np.int64) for ids, _, i in parts])  # (total,)
    uniq, inverse = np.unique(all_ids, return_inverse=True)  # (n,), (total,)
    inverse = inverse.reshape(-1)
    sums = np.zeros((len(uniq), all_grads.shape[1]), dtype=all_grads.dtype)  # (n, dim)
    np.add.at(sums, inverse, all_grads)  # adds in index order: deterministic
    # Rows touched by several ids of one request count that request once.
    n_req = int(owner.max()) + 1 if len(owner) else 1
    pairs = np.unique(inverse * n_req + owner)  # (row, request) pairs
    counts = np.bincount(pairs // n_req, minlength=len(uniq)).astype(np.int64)  # (n,)
    if mean and len(uniq):
        sums = sums / counts.astype(sums.dtype)[:, None]  # (n, dim)
    return RowDelta(key, uniq.astype(np.int64), sums, counts)
