"""A worker's push ring (layout: ``kvps.delta.ring``; the node's side: ``kvps.service.ring``).

``PushRing.place(parts)`` copies a request body into the ring and returns the descriptor to send
in its place and a ``Place`` to give back with ``release`` once the node has answered that
request: the node copies the body out when it reads the descriptor, before it answers, so an
answer (of any status) frees the place. A request that ends without an answer (a timeout, a lost
connection, a cancelled call) leaves its place in doubt: the node may still read it. The caller
then gives the whole ring up (``abandon``) and takes a fresh one; the node's own mapping keeps
the old one's bytes as they were until it lets go.

Places are handed out in order around the ring and freed in any order (the oldest place still
held bounds the free space); a body that does not fit now is sent inline instead of waiting.
The ring's pages are touched once and then reused: no fresh memory per push. Not thread-safe:
one event loop's client uses it.
"""
from __future__ import annotations

import fcntl
import mmap
import os
from collections import deque
from collections.abc import Sequence

import numpy as np

from kvps.delta import ring

__all__ = ["DEFAULT_RING_BYTES", "Place", "PushRing", "supported"]

DEFAULT_RING_BYTES = 128 << 20  # B1's 64 MiB step of pushes in flight at once, twice over


def supported() -> bool:
    return hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS")


class Place:
    __slots__ = ("offset", "end", "held")

    def __init__(self, offset: int, end: int) -> None:
        self.offset, self.end, self.held = offset, end, True


class PushRing:
    def __init__(self, size: int = DEFAULT_RING_BYTES) -> None:
        self.size = size
        self.pid = os.getpid()
        self.nonce = os.urandom(ring.NONCE_BYTES)
        self.fd = os.memfd_create(ring.MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self._map = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        self._bytes = np.frombuffer(self._map, np.uint8)
        self._bytes[:len(ring.MAGIC)] = np.frombuffer(ring.MAGIC, np.uint8)
        self._bytes[len(ring.MAGIC):len(ring.MAGIC) + ring.NONCE_BYTES] = np.frombuffer(self.nonce, np.uint8)
        self._held: deque[Place] = deque()  # in the order they were handed out
        self.closed = False

    def place(self, parts: Sequence) -> tuple[bytes, Place] | None:
        """``parts`` (bytes-like) copied into the ring, or None when they do not fit now."""
        length = sum(len(p) for p in parts)
        start = self._room(length)
        if start is None:
            return None
        pos = start
        for part in parts:
            data = np.frombuffer(part, np.uint8)
            self._bytes[pos:pos + len(data)] = data
            pos += len(data)
        place = Place(start, start + -(-length // ring.ALIGN) * ring.ALIGN)
        self._held.append(place)
        return ring.encode_descriptor(self.pid, self.fd, self.nonce, start, length), place

    def release(self, place: Place) -> None:
        place.held = False
        while self._held and not self._held[0].held:
            self._held.popleft()

    @property
    def in_use(self) -> int:
        return len(self._held)

    def _room(self, length: int) -> int | None:
        need = -(-length // ring.ALIGN) * ring.ALIGN
        if not self._held:
            return ring.HEADER if ring.HEADER + need <= self.size else None
        tail, head = self._held[0].offset, self._held[-1].end  # the oldest and newest held
        if self._held[-1].offset >= tail:  # not wrapped: free are [head, size) and [HEADER, tail)
            if head + need <= self.size:
                return head
            return ring.HEADER if ring.HEADER + need <= tail else None
        return head if head + need <= tail else None  # wrapped: free is [head, tail)

    def close(self) -> None:
        """Unmap and close (a node that mapped the ring keeps its own mapping)."""
        if self.closed:
            return
        self.closed = True
        self._held.clear()
        del self._bytes
        try:
            self._map.close()
        except BufferError:  # a view of it is still alive somewhere: unmapped when that goes
            pass
        os.close(self.fd)
