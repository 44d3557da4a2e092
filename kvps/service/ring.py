"""The node's side of workers' push rings (layout: ``kvps.delta.ring``).

``Rings`` belongs to one wire connection: it maps the rings that connection's descriptors name
(read-only, at most ``MAX_RINGS``, unmapped when the connection closes) and ``copy`` returns a
request body copied out of one into a buffer of the node's own, before anything reads it. A ring
is mapped only when it is a sealed ``memfd`` (its size cannot shrink under the mapping, so a copy
never faults past its end), no larger than ``MAX_RING_BYTES``, and its header holds the nonce the
descriptor repeats. Anything else is ``RingUnavailable``, after which the client sends that node
its bodies inline.
"""
from __future__ import annotations

import fcntl
import hmac
import mmap
import os
import stat
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter

from kvps.delta import ring
from kvps.errors import InvalidRequest, RingUnavailable

__all__ = ["MAX_RINGS", "MAX_RING_BYTES", "Rings", "ring_series"]

MAX_RINGS = 4  # per connection: a client has one ring, a new one after it gave one up
MAX_RING_BYTES = 4 << 30
RING_LINK = f"/memfd:{ring.MEMFD_NAME} "  # what /proc/<pid>/fd/<fd> of a ring reads as


_SERIES: "weakref.WeakKeyDictionary[CollectorRegistry, tuple]" = weakref.WeakKeyDictionary()


def ring_series(registry: CollectorRegistry, node: int) -> tuple[Any, Any, Any]:
    """A node's ``kvps_ring_bodies_total``, ``kvps_ring_bytes_total`` (request bodies copied out
    of workers' push rings) and ``kvps_ring_refused_total`` (descriptors answered
    ``RingUnavailable``), labelled ``node``."""
    families = _SERIES.get(registry)
    if families is None:
        families = _SERIES[registry] = (
            Counter("kvps_ring_bodies", "Request bodies copied out of workers' push rings", ("node",),
                    registry=registry),
            Counter("kvps_ring_bytes", "Bytes of request bodies copied out of workers' push rings",
                    ("node",), registry=registry),
            Counter("kvps_ring_refused", "Ring descriptors refused (the node cannot read the ring)",
                    ("node",), registry=registry))
    return tuple(f.labels(node=str(node)) for f in families)  # type: ignore[return-value]


class _Mapped:
    __slots__ = ("map", "nonce", "size")

    def __init__(self, mapped: mmap.mmap, nonce: bytes, size: int) -> None:
        self.map, self.nonce, self.size = mapped, nonce, size


class Rings:
    def __init__(self) -> None:
        self._maps: OrderedDict[tuple[int, int], _Mapped] = OrderedDict()
        self.copied = 0  # bodies copied out of rings
        self.copied_bytes = 0

    def body(self, raw: np.ndarray | bytes, *, peer: str, max_body: int,
             take: Callable[[int], np.ndarray]) -> np.ndarray:
        """The request body the descriptor ``raw`` stands for, copied (``copy``), for a
        connection from ``peer``: rings are read for clients on this host only."""
        desc = ring.parse_descriptor(raw, max_body)
        if not (peer.startswith("127.") or peer in ("::1", "::ffff:127.0.0.1")):
            raise RingUnavailable("push rings are read for clients on this host only", field="ring")
        return self.copy(desc, take)

    def copy(self, desc: ring.Descriptor, take: Callable[[int], np.ndarray]) -> np.ndarray:
        """The ``desc.length`` bytes at ``desc.offset`` of the ring ``desc`` names, copied into
        ``take(length)``."""
        mapped = self._mapped(desc)
        if desc.offset + desc.length > mapped.size:
            raise InvalidRequest(f"ring descriptor past the ring's end ({desc.offset} + "
                                 f"{desc.length} > {mapped.size})", field="ring")
        out = take(desc.length)
        out[:] = np.frombuffer(mapped.map, np.uint8, desc.length, desc.offset)
        self.copied += 1
        self.copied_bytes += desc.length
        return out

    def close(self) -> None:
        for mapped in self._maps.values():
            mapped.map.close()
        self._maps.clear()

    def _mapped(self, desc: ring.Descriptor) -> _Mapped:
        where = (desc.pid, desc.fd)
        mapped = self._maps.get(where)
        if mapped is not None and hmac.compare_digest(mapped.nonce, desc.nonce):
            self._maps.move_to_end(where)
            return mapped
        if mapped is not None:  # the client gave that ring up and the descriptor number was reused
            del self._maps[where]
            mapped.map.close()
        mapped = _open(desc)
        self._maps[where] = mapped
        while len(self._maps) > MAX_RINGS:
            self._maps.popitem(last=False)[1].map.close()
        return mapped


def _open(desc: ring.Descriptor) -> _Mapped:
    path = f"/proc/{desc.pid}/fd/{desc.fd}"
    try:  # a ring's name, before anything is opened (another PID namespace: some other file)
        if not os.readlink(path).startswith(RING_LINK):
            raise RingUnavailable("the ring descriptor names no ring", field="ring")
    except OSError as exc:
        raise RingUnavailable(f"cannot find the sender's ring: {exc.strerror}", field="ring") from None
    try:
        # non-blocking and no controlling terminal: whatever the path turns out to be, opening it
        # neither waits nor has side effects before it is refused below
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise RingUnavailable(f"cannot open the sender's ring: {exc.strerror}", field="ring") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise RingUnavailable("the ring descriptor names no ring", field="ring")
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            raise RingUnavailable("the ring descriptor names no ring", field="ring") from None
        if not seals & fcntl.F_SEAL_SHRINK:
            raise RingUnavailable("the sender's ring can shrink (not sealed)", field="ring")
        if not ring.HEADER <= info.st_size <= MAX_RING_BYTES:
            raise RingUnavailable(f"ring of {info.st_size} bytes", field="ring")
        mapped = mmap.mmap(fd, info.st_size, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
    header = mapped[:len(ring.MAGIC) + ring.NONCE_BYTES]
    if header[:len(ring.MAGIC)] != ring.MAGIC \
            or not hmac.compare_digest(header[len(ring.MAGIC):], desc.nonce):
        mapped.close()
        raise RingUnavailable("the ring's nonce does not match the descriptor's", field="ring")
    return _Mapped(mapped, desc.nonce, info.st_size)
