"""A worker's push ring: the layout both ends agree on (writer: ``clients._ring``; reader:
``kvps.service.ring``).

A client on a node's host writes a request body it would send on the wire connection into a ring
of its own instead, and sends a small descriptor in the body's place; the node copies the bytes
out of the ring into a buffer of its own *before* anything reads them (the frame decoder verifies
that copy's checksums), so a worker that changes its ring after sending the descriptor changes
nothing the node checked or applied.

The ring is a sealed ``memfd``: a file in no directory, gone with the last process that maps it
(a worker killed while writing leaves nothing behind), whose size cannot shrink
(``F_SEAL_SHRINK``, so a reader's mapping never faults past its end) or grow. The node opens it
through ``/proc/<pid>/fd/<fd>``, which works for processes of the same user in the same PID
namespace; where it does not, the node answers ``RingUnavailable`` and the client sends bodies
inline from then on. The ring's first ``HEADER`` bytes are ``MAGIC`` and a 16-byte random nonce
that every descriptor repeats: a descriptor names a ring its sender can read, or the node refuses
it. All little-endian::

    ring header  MAGIC (8) ; nonce (16) ; zeros to HEADER bytes
    descriptor   '<4sB3xIi16sQQ'  DESCRIPTOR_MAGIC b'KVPR', version (1), pid (u32), fd (i32),
                                  nonce (16), offset (u64, >= HEADER), length (u64, >= 1)

A wire request whose body is exactly ``DESCRIPTOR.size`` bytes and begins with
``DESCRIPTOR_MAGIC`` stands for the ``length`` body bytes at ``offset`` in that ring (a request
frame begins ``KVPF``, so the two cannot be confused).

Pure core: no I/O.
"""
from __future__ import annotations

import struct

from kvps.errors import InvalidRequest, RequestTooLarge

__all__ = ["ALIGN", "DESCRIPTOR", "DESCRIPTOR_MAGIC", "Descriptor", "HEADER", "MAGIC", "MEMFD_NAME",
           "MIN_BODY", "NONCE_BYTES", "encode_descriptor", "is_descriptor", "parse_descriptor"]

MAGIC = b"KVPRING1"
MEMFD_NAME = "kvps-push-ring"
NONCE_BYTES = 16
HEADER = 64
ALIGN = 64  # places in the ring start on cache lines
VERSION = 1
DESCRIPTOR_MAGIC = b"KVPR"
DESCRIPTOR = struct.Struct("<4sB3xIi16sQQ")
# bodies smaller than this go inline: below it a descriptor saves nothing measurable
MIN_BODY = 64 * 1024


class Descriptor(tuple):
    """``(pid, fd, nonce, offset, length)``."""
    __slots__ = ()

    pid = property(lambda self: self[0])
    fd = property(lambda self: self[1])
    nonce = property(lambda self: self[2])
    offset = property(lambda self: self[3])
    length = property(lambda self: self[4])


def encode_descriptor(pid: int, fd: int, nonce: bytes, offset: int, length: int) -> bytes:
    return DESCRIPTOR.pack(DESCRIPTOR_MAGIC, VERSION, pid, fd, nonce, offset, length)


def is_descriptor(body: bytes | memoryview) -> bool:
    return len(body) == DESCRIPTOR.size and bytes(body[:4]) == DESCRIPTOR_MAGIC


def parse_descriptor(body: bytes | memoryview, max_body: int) -> Descriptor:
    """The descriptor in ``body``, checked; ``InvalidRequest`` / ``RequestTooLarge`` otherwise."""
    magic, version, pid, fd, nonce, offset, length = DESCRIPTOR.unpack(body)
    if magic != DESCRIPTOR_MAGIC or version != VERSION:
        raise InvalidRequest(f"ring descriptor version {version} is not supported", field="ring")
    if pid <= 0 or fd < 0 or offset < HEADER or length < 1:
        raise InvalidRequest("malformed ring descriptor", field="ring")
    if length > max_body:
        raise RequestTooLarge("request body too large", limit=max_body, size=length)
    return Descriptor((pid, fd, nonce, offset, length))
