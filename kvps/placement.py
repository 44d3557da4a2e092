"""Which shard holds what, and how a dense key splits into blocks.

``shard = mix(hash(key), block | row) mod shards`` with a stable hash (blake2b, not Python's
salted ``hash()``) so that every process, on every host and every run, routes alike. Blocks and rows
are separate spaces (different salts): ``row_shards(k, [i])`` need not equal ``block_shard(k, i)``.
Replica placement (shard -> nodes) lives with the cluster config (``ClusterConfig.replica_nodes``).
"""
from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass

import numpy as np

from kvps.errors import InvalidRequest
from kvps.initializer import splitmix64

__all__ = ["DenseLayout", "block_shard", "dtype_name", "key_hash", "layout_for", "row_shards"]

_BLOCK_SALT = np.uint64(0x626C6F636B000000)  # "block"
_ROW_SALT = np.uint64(0x726F770000000000)  # "row"
# Dtypes a key may hold: the ones optimizers can do arithmetic on (numpy has no bfloat16).
VALUE_DTYPES = ("float16", "float32", "float64")


def key_hash(key: str) -> int:
    """First 8 bytes of blake2b(key, digest_size=8), little-endian."""
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest(), "little")


def _shards(key: str, index: np.ndarray, salt: np.uint64, shards: int) -> np.ndarray:
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise InvalidRequest(f"shards must be a positive int, got {shards!r}", field="shards")
    kh = splitmix64(np.array([key_hash(key)], dtype=np.uint64) ^ salt)  # (1,)
    with np.errstate(over="ignore"):
        mixed = splitmix64(kh + index.astype(np.int64).view(np.uint64))  # (n,) uint64
    return (mixed % np.uint64(shards)).astype(np.int64)  # (n,)


_MASK = (1 << 64) - 1


def _splitmix64_int(x: int) -> int:
    """``splitmix64`` of one value in Python ints (numpy's per-call overhead is ~40x this)."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


@functools.lru_cache(maxsize=1 << 16)
def _block_seed(key: str) -> int:
    return _splitmix64_int(key_hash(key) ^ int(_BLOCK_SALT))


def block_shard(key: str, block: int, shards: int) -> int:
    """The shard that holds block ``block`` of dense key ``key`` (``_shards``'s rule, in scalar
    arithmetic: a client routing 10,000 small keys calls this 10,000 times per step)."""
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise InvalidRequest(f"shards must be a positive int, got {shards!r}", field="shards")
    return _splitmix64_int((_block_seed(key) + (int(block) & _MASK)) & _MASK) % shards


def row_shards(key: str, ids: np.ndarray, shards: int) -> np.ndarray:
    """(n,) int64: the shard of each row id of table ``key`` (vectorised)."""
    ids = np.asarray(ids)
    if ids.dtype.kind not in "iu":
        raise InvalidRequest(f"row ids must be integers, got {ids.dtype}", field="ids")
    return _shards(key, ids.reshape(-1), _ROW_SALT, shards)


@dataclass(frozen=True)
class DenseLayout:
    """How a dense key of ``shape`` splits into blocks of ``block_rows`` rows along dim 0.

    A 0-d key is one block holding the scalar (``block_shape(0) == ()``); a key with
    ``shape[0] == 0`` is one empty block.
    """

    shape: tuple[int, ...]
    dtype: str
    block_rows: int

    def __post_init__(self) -> None:
        shape = self.shape
        if not isinstance(shape, (tuple, list)) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise InvalidRequest(f"shape must be a tuple of non-negative ints, got {shape!r}", field="shape")
        if len(shape) > 32:
            raise InvalidRequest("shape has more than 32 dims", field="shape")
        object.__setattr__(self, "shape", tuple(shape))
        if not isinstance(self.dtype, str) or self.dtype not in VALUE_DTYPES:
            raise InvalidRequest(f"dtype must be one of {VALUE_DTYPES}, got {self.dtype!r}", field="dtype")
        br = self.block_rows
        if isinstance(br, bool) or not isinstance(br, int) or br < 1:
            raise InvalidRequest(f"block_rows must be an int >= 1, got {br!r}", field="block_rows")

    @property
    def n_blocks(self) -> int:
        if not self.shape or self.shape[0] == 0:
            return 1
        return -(-self.shape[0] // self.block_rows)

    def _check(self, i: int) -> None:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.n_blocks:
            raise InvalidRequest(f"block {i!r} out of range [0, {self.n_blocks})", field="block")

    def block_slice(self, i: int) -> slice:
        """Rows of block ``i`` along dim 0 (a 0-d key's single block is ``slice(0, 1)``)."""
        self._check(i)
        if not self.shape:
            return slice(0, 1)
        start = i * self.block_rows
        return slice(start, min(start + self.block_rows, self.shape[0]))

    def block_shape(self, i: int) -> tuple[int, ...]:
        if not self.shape:
            self._check(i)
            return ()
        s = self.block_slice(i)
        return (s.stop - s.start, *self.shape[1:])

    def block(self, value: np.ndarray, i: int) -> np.ndarray:
        """Block ``i`` of a full value (a view; the value itself for a 0-d key)."""
        return value if not self.shape else value[self.block_slice(i)]

    def assemble(self, blocks: list[np.ndarray]) -> np.ndarray:
        """The full value from all its blocks, in block order."""
        if len(blocks) != self.n_blocks:
            raise InvalidRequest(f"need {self.n_blocks} blocks, got {len(blocks)}", field="blocks")
        if not self.shape:
            return np.array(blocks[0], dtype=self.dtype)
        return np.concatenate([np.asarray(b, dtype=self.dtype).reshape(self.block_shape(i))
                               for i, b in enumerate(blocks)], axis=0)


def dtype_name(dtype: np.dtype) -> str:
    """``dtype.name``, which numpy computes in Python (~9 us) on every access."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = dtype.name  # dtypes are few: the dict stays small
    return name


_DTYPE_NAMES: dict[np.dtype, str] = {}


def layout_for(shape: tuple[int, ...], dtype: str, block_bytes: int) -> DenseLayout:
    """Blocks of at most ``block_bytes`` (at least one row each)."""
    shape = tuple(shape)
    # cached only for exact ints and a str: a cache key equates 1, 1.0 and True
    if type(dtype) is str and type(block_bytes) is int and all(type(d) is int for d in shape):
        return _layout_for(shape, dtype, block_bytes)
    return _layout_for.__wrapped__(shape, dtype, block_bytes)


@functools.lru_cache(maxsize=4096)  # a layout is frozen; many keys share a shape (10,000 in B7)
def _layout_for(shape: tuple[int, ...], dtype: str, block_bytes: int) -> DenseLayout:
    try:
        dtype = dtype_name(np.dtype(dtype))
    except TypeError as exc:
        raise InvalidRequest(f"unknown dtype {dtype!r}", field="dtype") from exc
    if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes < 1:
        raise InvalidRequest(f"block_bytes must be an int >= 1, got {block_bytes!r}", field="block_bytes")
    if not shape:
        return DenseLayout((), dtype, 1)
    DenseLayout(shape, dtype, 1)  # validates shape and dtype before they are used below
    row_bytes = np.dtype(dtype).itemsize * math.prod(shape[1:])
    if row_bytes == 0:  # rows of zero bytes: everything fits in one block
        return DenseLayout(shape, dtype, max(1, shape[0]))
    return DenseLayout(shape, dtype, max(1, block_bytes // row_bytes))
