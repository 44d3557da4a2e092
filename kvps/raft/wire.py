"""The Raft peer wire format: frames, message bodies, the no-globals unpickler, the handshake MAC.

Pure: no socket, no thread, no clock, no pysyncobj (tests/raft/test_raft_transport.py imports it in a
fresh interpreter and checks). ``kvps.raft.connection`` moves these bytes over sockets.

Every frame is ``<I`` body length, then the body. Before authentication a body is a raw
handshake message of at most ``HANDSHAKE_FRAME_CAP`` bytes (``C`` = connecting side, ``S`` =
accepting side, ``ctx`` = the group's context, e.g. ``b"kvps/shard=3"``, so a replica of another
shard or cluster cannot connect)::

    C -> S   HELLO      b"KVPSRAFT" + version (1 byte) + client nonce (32 bytes)
    S -> C   CHALLENGE  server nonce (32) + HMAC(secret, "server" | ctx | Nc | Ns)
    C -> S   RESPONSE   HMAC(secret, "client" | ctx | Nc | Ns)

The role label stops reflection (S's MAC is never a valid C MAC), the fresh server nonce stops
replay of a recorded RESPONSE, and C reports the connection as connected only after checking S's
MAC. What this does not give: per-message integrity. An attacker who can rewrite TCP segments
between two replicas could inject frames after the handshake; run peer traffic on a private
network (or under WireGuard/TLS) if that is in your threat model.

After the handshake a body is one pysyncobj message: ``<IH`` pickle length and number of
out-of-band buffers, one ``<I`` length per buffer, the pickle, the buffers (which the receiver
passes to the Unpickler as ``buffers=``: read-only views of the frame when the frame has a buffer
of its own, which is reused only once nothing refers to it; ``bytes`` copies when it was parsed
out of the connection's reused staging buffer). The pickle is protocol 5, never zlib (our
payloads are already compressed or incompressible), and is read back with an ``Unpickler`` that
refuses every global: pysyncobj's peer messages are dicts, lists and tuples of
str/bytes/int/float/bool/None. (Membership commands pickle a ``TCPNode`` *inside* the command
bytes; those are unpickled by pysyncobj only when the entry is applied from the log, which only
authenticated peers can write.) Bytes values of 16 KiB or more (log entries, snapshot chunks)
travel as protocol-5 out-of-band buffers, so the leader never copies an entry to send it: the
connection gathers the small pickle and the entries' own bytes objects with ``sendmsg``; and a
follower keeps the entries of a large frame as views of it instead of copying each one out (a
replica that becomes leader sends such views out of band too). An entry the journal released
from memory (``kvps.raft.released``) is read back as it is encoded, for a follower that lags
behind it. A zero-length body is a keepalive.
"""
from __future__ import annotations

import hashlib
import hmac
import io
import pickle
import struct
from typing import Any

from kvps.raft.released import Released

__all__ = [
    "CHALLENGE_BYTES",
    "FRAME_HEADER",
    "HANDSHAKE_FRAME_CAP",
    "HELLO_BYTES",
    "HELLO_MAGIC",
    "KEEPALIVE_FRAME",
    "MAC_BYTES",
    "NONCE_BYTES",
    "PROTOCOL_VERSION",
    "decode_message",
    "encode_message",
    "handshake_mac",
    "loads_restricted",
]

HELLO_MAGIC = b"KVPSRAFT"
PROTOCOL_VERSION = 1
NONCE_BYTES = 32
MAC_BYTES = 32
HANDSHAKE_FRAME_CAP = 1024  # bytes; every handshake frame is far smaller
HELLO_BYTES = len(HELLO_MAGIC) + 1 + NONCE_BYTES
CHALLENGE_BYTES = NONCE_BYTES + MAC_BYTES

FRAME_HEADER = struct.Struct("<I")  # body length; the cap is checked on it before any allocation
KEEPALIVE_FRAME = FRAME_HEADER.pack(0)

_OUT_OF_BAND_BYTES = 16 * 1024  # bytes values at least this large travel out of band
_BODY = struct.Struct("<IH")  # pickle length, number of out-of-band buffers
_U32 = struct.Struct("<I")
_MAX_BUFFERS = 4096


def handshake_mac(secret: bytes, context: bytes, role: bytes, client_nonce: bytes,
                  server_nonce: bytes) -> bytes:
    """HMAC-SHA256 binding the secret to the protocol, the direction, the context and both nonces."""
    msg = b"".join((b"kvps-raft-auth/v1\0", role, b"\0", FRAME_HEADER.pack(len(context)), context,
                    client_nonce, server_nonce))
    return hmac.new(secret, msg, hashlib.sha256).digest()


class _NoGlobalsUnpickler(pickle.Unpickler):
    """Unpickles plain containers and scalars only: every global (class, function) is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"global {module}.{name} refused")


def loads_restricted(data: Any, buffers: Any = ()) -> Any:
    """Unpickle ``data`` (any buffer) refusing every global; raises on anything malformed."""
    return _NoGlobalsUnpickler(io.BytesIO(data), buffers=buffers).load()


def _out_of_band(obj: Any, depth: int = 0) -> Any:
    """``obj`` with every large bytes value (log entries, snapshot chunks) wrapped in a
    ``PickleBuffer``, so that protocol 5 hands it to ``buffer_callback`` instead of copying it."""
    if type(obj) is bytes:
        return pickle.PickleBuffer(obj) if len(obj) >= _OUT_OF_BAND_BYTES else obj
    if type(obj) is memoryview:  # an entry received as a view of its frame (decode_message)
        return pickle.PickleBuffer(obj)
    if type(obj) is Released:  # a command the journal no longer holds in memory: read it back
        return _out_of_band(obj.materialize(), depth)
    if depth >= 4:
        return obj
    if type(obj) is dict:
        return {k: _out_of_band(v, depth + 1) for k, v in obj.items()}
    if type(obj) is list:
        return [_out_of_band(v, depth + 1) for v in obj]
    if type(obj) is tuple:
        return tuple(_out_of_band(v, depth + 1) for v in obj)
    return obj


def encode_message(message: Any) -> list[Any]:
    """The body of an authenticated frame for ``message``, as buffers to send in order."""
    buffers: list[pickle.PickleBuffer] = []
    payload = pickle.dumps(_out_of_band(message), protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    meta = _BODY.pack(len(payload), len(raws)) + b"".join(_U32.pack(len(r)) for r in raws)
    return [meta + payload, *raws]


def decode_message(body: memoryview, *, owned: bool = False) -> Any:
    """Inverse of ``encode_message``; refuses every global; raises on anything malformed.

    ``owned``: ``body`` lies in a buffer of its own that is reused only once nothing refers to
    it: its out-of-band values come back as read-only views of it (each keeps the whole frame
    alive) instead of ``bytes`` copies. A body in a buffer reused regardless (the staging
    buffer) must not be ``owned``."""
    npickle, nbuffers = _BODY.unpack_from(body)
    offset = _BODY.size + _U32.size * nbuffers
    if nbuffers > _MAX_BUFFERS or offset + npickle > len(body):
        raise ValueError("inconsistent frame layout")
    sizes = struct.unpack_from(f"<{nbuffers}I", body, _BODY.size)
    start = offset + npickle
    if start + sum(sizes) != len(body):
        raise ValueError("frame buffer sizes do not add up to the frame length")
    buffers = []
    for size in sizes:
        value = body[start:start + size]
        buffers.append(value.toreadonly() if owned else bytes(value))
        start += size
    return loads_restricted(body[offset:offset + npickle], buffers)
