"""``KvpsStore``: a ``torch.distributed.Store`` on kvps keys, so that ``init_process_group`` (and
torchrun's rendezvous, ``_torch_rdzv``) run on the same Raft-replicated cluster as the parameters
and survive a leader kill.

Each store key is one kvps dense key ``prefix + key``: a single block of float64 holding a
presence flag, the value's length and its bytes, six per element (48-bit integers are exact in
a float64, so any bytes survive and no value is NaN). Every write goes through the Raft log:
``set`` overwrites, ``add`` and ``compare_set`` are a read followed by a compare-and-set on the
block's version (``Client.set(expected_version=...)``), retried when another writer got in first.
Writes are deduplicated by push id, so a write retried across a failover applies once. Reads are
linearizable (a read barrier through the log), so a deposed leader cannot answer with an old
value. ``get`` and ``wait`` poll until the keys exist, up to the store's timeout.
"""
from __future__ import annotations

import time
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import numpy as np
import torch.distributed as dist

from kvps.errors import InvalidRequest, KeyNotFound, Timeout, VersionConflict
from kvps.optimizer import Add

from ._sync import SyncClient

__all__ = ["KvpsStore", "StoreTimeout"]

DEFAULT_MAX_VALUE_BYTES = 64 * 1024  # torchrun's rendezvous state for dozens of nodes fits
_PER_ELEMENT = 6                     # bytes per float64 element (48 bits: exact)
_HEADER = 2                          # [present (0 or 1), length]


class StoreTimeout(Timeout, dist.DistStoreError):
    """A store wait ran out of time: a kvps ``Timeout`` that torch's callers (which catch
    ``DistStoreError`` / ``RuntimeError``) recognise too."""


def _pack(value: bytes, capacity: int) -> np.ndarray:
    """(capacity,) float64: header then ``value``'s bytes, six per element."""
    out = np.zeros(capacity, np.float64)
    out[0], out[1] = 1.0, float(len(value))
    rows = -(-len(value) // _PER_ELEMENT)
    six = np.zeros(rows * _PER_ELEMENT, np.uint8)
    six[:len(value)] = np.frombuffer(value, np.uint8)
    padded = np.zeros((rows, 8), np.uint8)  # little-endian words whose top two bytes are zero
    padded[:, :_PER_ELEMENT] = six.reshape(rows, _PER_ELEMENT)
    words = padded.view("<u8").reshape(-1)
    out[_HEADER:_HEADER + len(words)] = words.astype(np.float64)
    return out


def _unpack(arr: np.ndarray) -> bytes | None:
    """The bytes ``_pack`` stored, or None for an absent key."""
    if arr[0] != 1.0:
        return None
    n = int(arr[1])
    words = arr[_HEADER:_HEADER + -(-n // _PER_ELEMENT)].astype("<u8")
    return words.view(np.uint8).reshape(-1, 8)[:, :_PER_ELEMENT].reshape(-1)[:n].tobytes()


def _bytes(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, (list, tuple)):  # torch's bindings also pass a value as a list of ints
        return bytes(value)
    raise InvalidRequest(f"store values are bytes or str, not {type(value).__name__}")


class KvpsStore(dist.Store):
    """``torch.distributed.Store`` semantics (set, get, add, compare_set, wait, check,
    delete_key, num_keys, timeouts) on kvps keys under ``prefix``.

    ``KvpsStore(endpoints, token=None, prefix="store/", timeout=timedelta(seconds=300))`` opens a
    ``SyncClient`` of its own (``close()`` closes it); ``client=`` shares an open one instead.
    Values are at most ``max_value_bytes`` (every write of a key carries that much)."""

    def __init__(self, endpoints: Any = None, *, token: str | None = None, prefix: str = "store/",
                 timeout: timedelta = timedelta(seconds=300), client: SyncClient | None = None,
                 max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES) -> None:
        super().__init__()
        if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
            raise InvalidRequest("timeout must be a positive timedelta", field="timeout")
        if not isinstance(max_value_bytes, int) or max_value_bytes < 1:
            raise InvalidRequest("max_value_bytes must be a positive int", field="max_value_bytes")
        self.set_timeout(timeout)
        self.prefix = prefix
        self.max_value_bytes = max_value_bytes
        self._capacity = _HEADER + -(-max_value_bytes // _PER_ELEMENT)
        self._owned = client is None
        self._client = client if client is not None else SyncClient(endpoints, token).open()
        self._created: set[str] = set()  # kvps keys this store knows exist

    def close(self) -> None:
        if self._owned:
            self._client.close()

    def __enter__(self) -> "KvpsStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- torch.distributed.Store ----------------------------------------------------------------

    def set(self, key: str, value: Any) -> None:
        self._client.set(self._slot(key), self._packed(value))

    def get(self, key: str) -> bytes:
        while True:
            self.wait([key])
            value, _ = self._read(key)
            if value is not None:  # else deleted between the wait and the read: wait again
                return value

    def add(self, key: str, value: int) -> int:
        while True:
            current, version = self._read(key)
            total = int(current or b"0") + int(value)
            if self._swap(key, version, str(total).encode()):
                return total

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        """Set ``desired_value`` if the key holds ``expected_value`` (or is missing and
        ``expected_value`` is empty); the value afterwards. A missing key with a non-empty
        expectation answers the expectation, as torch's TCPStore does."""
        expected, desired = _bytes(expected_value), _bytes(desired_value)
        while True:
            current, version = self._read(key)
            if current is None and expected:
                return expected
            if current is not None and current != expected:
                return current
            if self._swap(key, version, desired):
                return desired

    def wait(self, keys: Iterable[str], timeout: timedelta | None = None) -> None:
        keys = list(keys)
        limit = (timeout or self.timeout).total_seconds()
        deadline, pause = time.monotonic() + limit, 0.002
        while not self.check(keys):
            if time.monotonic() >= deadline:
                raise StoreTimeout(f"wait for {keys} timed out after {limit:g}s", keys=keys)
            time.sleep(pause)  # polling the cluster; backs off to 50 ms
            pause = min(2 * pause, 0.05)

    def check(self, keys: Iterable[str]) -> bool:
        return all(self._read(k)[0] is not None for k in keys)

    def delete_key(self, key: str) -> bool:
        while True:
            current, version = self._read(key)
            if current is None:
                return False
            if self._swap(key, version, None):
                return True

    def num_keys(self) -> int:
        slots = [i["key"] for i in self._client.keys() if i["key"].startswith(self.prefix)]
        values = self._client.pull(slots, consistency="linearizable") if slots else {}
        return sum(_unpack(v) is not None for v in values.values())

    # ---- kvps keys --------------------------------------------------------------------------------

    def _slot(self, key: str) -> str:
        slot = self.prefix + key
        if slot not in self._created:
            self._client.create(slot, np.zeros(self._capacity), optimizer=Add())  # no-op if present
            self._created.add(slot)
        return slot

    def _packed(self, value: Any) -> np.ndarray:
        data = _bytes(value)
        if len(data) > self.max_value_bytes:
            raise InvalidRequest(f"store value of {len(data)} bytes is over this store's "
                                 f"max_value_bytes={self.max_value_bytes}", size=len(data))
        return _pack(data, self._capacity)

    def _read(self, key: str) -> tuple[bytes | None, int | None]:
        """(value or None if absent, version or None if the slot does not exist yet)."""
        slot = self.prefix + key
        try:
            arr, version = self._client.get(slot, consistency="linearizable")
        except KeyNotFound:
            return None, None
        self._created.add(slot)
        return _unpack(arr), version

    def _swap(self, key: str, version: int | None, value: bytes | None) -> bool:
        """Compare-and-set the slot from ``version`` to ``value`` (None: absent). False when
        another write got in first."""
        slot = self._slot(key)
        if version is None:  # the slot did not exist when the caller read it: read it again
            return False
        packed = np.zeros(self._capacity) if value is None else self._packed(value)
        try:
            self._client.set(slot, packed, expected_version=version)
        except VersionConflict:
            return False
        return True
