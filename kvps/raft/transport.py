"""The Raft peer transport: authenticated, size-capped, protocol-5 pickles, no zlib.

pysyncobj's stock ``TcpConnection`` feeds every frame a peer sends to ``pickle.loads`` (anyone who
reaches a Raft port runs code on the node), trusts a 4-byte length of any size, pickles with
protocol 2 and zlib-compresses every message once per follower, and copies its whole read and
write buffers on every socket call (``buf += data``, ``buf = buf[n:]``), which is quadratic on
MB-sized frames. This module replaces the connection and the server while keeping pysyncobj's
``TCPTransport`` bookkeeping (node table, reconnects, readonly and utility messages):

* ``make_transport_class(...)`` returns a ``TCPTransport`` subclass (given to ``SyncObj`` as
  ``transportClass``) that overrides ``_createServer`` (the stock ``TcpServer`` hard-codes its
  connection class) and ``addNode`` (which hard-codes it for outgoing connections), and adds a
  timeout/keepalive sweep to ``_onTick``.
* Every connection first runs a mutual HMAC-SHA256 challenge-response on the cluster secret
  (below). Nothing is unpickled before it succeeds; handshake frames are raw bytes capped at
  1 KiB. Afterwards frames are capped at ``max_frame_bytes``; the cap is checked on the 4-byte
  length header before any buffer is allocated.
* Authenticated frames carry ``pickle.dumps(message, protocol=5)`` (never zlib: our payloads are
  already compressed or incompressible) and are read back with an ``Unpickler`` that refuses
  every global: pysyncobj's peer messages are dicts, lists and tuples of
  str/bytes/int/float/bool/None. (Membership commands pickle a ``TCPNode`` *inside* the command
  bytes; those are unpickled by pysyncobj only when the entry is applied from the log, which only
  authenticated peers can write.) Bytes values of 16 KiB or more (log entries, snapshot chunks)
  travel as protocol-5 out-of-band buffers, so the leader never copies an entry to send it:
  ``sendmsg`` gathers the small pickle and the entries' own bytes objects.

Handshake (``C`` = connecting side, ``S`` = accepting side, ``ctx`` = the group's context, e.g.
``b"kvps/shard=3"``, so a replica of another shard or cluster cannot connect)::

    C -> S   HELLO      b"KVPSRAFT" + version (1 byte) + client nonce (32 bytes)
    S -> C   CHALLENGE  server nonce (32) + HMAC(secret, "server" | ctx | Nc | Ns)
    C -> S   RESPONSE   HMAC(secret, "client" | ctx | Nc | Ns)

The role label stops reflection (S's MAC is never a valid C MAC), the fresh server nonce stops
replay of a recorded RESPONSE, and C reports the connection as connected only after checking S's
MAC. What this does not give: per-message integrity. An attacker who can rewrite TCP segments
between two replicas could inject frames after the handshake; run peer traffic on a private
network (or under WireGuard/TLS) if that is in your threat model.

Wire format after the handshake: ``<I`` body length, then the body: ``<IH`` pickle length and
number of out-of-band buffers, one ``<I`` length per buffer, the pickle, the buffers (which the
receiver passes to the Unpickler as ``buffers=``, as ``bytes``). A zero-length frame is a
keepalive (sent when a connection has been quiet for ``connectionTimeout / 4``), so the idle
timeout also works on follower-to-follower connections, which carry no Raft traffic between
elections; the stock transport only noticed a dead connection when it next tried to send (and
then dropped that message, often a vote request).

I/O runs on pysyncobj's poller in its tick thread, on non-blocking sockets: small frames are
parsed out of one reusable 256 KiB staging buffer; a frame larger than that gets one
preallocated ``bytearray`` filled with ``recv_into``; outgoing frames wait in a deque of
memoryviews sent with ``sendmsg`` (no re-slicing copies); at most 16 MiB are read per poll event
so the tick thread keeps heart-beating while a peer streams a large backlog.

Every rejection logs one line on logger ``kvps.raft`` (peer address and reason) and disconnects.

Is a lost peer's process gone? A connection records whether the *peer's* kernel ended it (EOF,
reset, hang-up on an authenticated connection), which is what a peer process's death looks like;
connections we close ourselves (idle timeout, rejected frame, replaced by a reconnect) and
connections that just go silent (a partition) do not count. For such a member, when
``make_transport_class(on_peer_gone=...)`` is given, the transport then makes one bare TCP connect
to its Raft port (``_Probe``): refused, or accepted and reset before the probe's window ends (a
listener that closed as its process exited), means nothing listens there any more and
``on_peer_gone(address)`` is called on the tick thread. A live peer that closed the connection
(its idle timeout, a rejected frame, our removal from its member list) still listens: no call.
"""
from __future__ import annotations

import collections
import dataclasses
import errno
import functools
import hashlib
import hmac
import io
import logging
import os
import pickle
import socket
import struct
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
from pysyncobj.monotonic import monotonic as _monotonic
from pysyncobj.poller import POLL_EVENT_TYPE
from pysyncobj.tcp_connection import CONNECTION_STATE
from pysyncobj.transport import TCPTransport

__all__ = [
    "HANDSHAKE_FRAME_CAP",
    "HELLO_MAGIC",
    "NONCE_BYTES",
    "PROTOCOL_VERSION",
    "AuthTransport",
    "TransportStats",
    "decode_message",
    "encode_message",
    "handshake_mac",
    "loads_restricted",
    "make_transport_class",
]

logger = logging.getLogger("kvps.raft")

HELLO_MAGIC = b"KVPSRAFT"
PROTOCOL_VERSION = 1
NONCE_BYTES = 32
_MAC_BYTES = 32
HANDSHAKE_FRAME_CAP = 1024  # bytes; every handshake frame is far smaller
_HELLO_BYTES = len(HELLO_MAGIC) + 1 + NONCE_BYTES
_CHALLENGE_BYTES = NONCE_BYTES + _MAC_BYTES

_HEADER = struct.Struct("<I")
_KEEPALIVE_FRAME = _HEADER.pack(0)
_STAGING_BYTES = 256 * 1024  # frames larger than this get their own buffer
_COMPACT_BELOW = 64 * 1024  # move a partial frame to the front when less room than this is left
_READ_BUDGET = 16 * 1024 * 1024  # bytes read per poll event before yielding to the tick loop
_SENDMSG_MAX_BUFFERS = 64
_OUT_OF_BAND_BYTES = 16 * 1024  # bytes values at least this large travel out of band
_BODY = struct.Struct("<IH")  # pickle length, number of out-of-band buffers
_U32 = struct.Struct("<I")
_MAX_BUFFERS = 4096
_MAX_PENDING_HANDSHAKES = 64  # unauthenticated incoming connections held at once
_SWEEP_PERIOD = 0.1  # seconds between timeout / keepalive sweeps
_PROBE_SETTLE = 0.05  # s a probe that connected waits for a reset before calling the peer alive

# Handshake phases.
_TCP_CONNECTING = 0  # outgoing: waiting for the TCP connect to complete
_AWAIT_HELLO = 1  # incoming: waiting for HELLO
_AWAIT_CHALLENGE = 2  # outgoing: HELLO sent, waiting for CHALLENGE
_AWAIT_RESPONSE = 3  # incoming: CHALLENGE sent, waiting for RESPONSE
_AUTHENTICATED = 4


def handshake_mac(secret: bytes, context: bytes, role: bytes, client_nonce: bytes,
                  server_nonce: bytes) -> bytes:
    """HMAC-SHA256 binding the secret to the protocol, the direction, the context and both nonces."""
    msg = b"".join((b"kvps-raft-auth/v1\0", role, b"\0", _HEADER.pack(len(context)), context,
                    client_nonce, server_nonce))
    return hmac.new(secret, msg, hashlib.sha256).digest()


class _NoGlobalsUnpickler(pickle.Unpickler):
    """Unpickles plain containers and scalars only: every global (class, function) is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"global {module}.{name} refused")


def loads_restricted(data: Any, buffers: Any = ()) -> Any:
    """Unpickle ``data`` (any buffer) refusing every global; raises on anything malformed."""
    return _NoGlobalsUnpickler(io.BytesIO(data), buffers=buffers).load()


def _outOfBand(obj: Any, depth: int = 0) -> Any:
    """``obj`` with every large bytes value (log entries, snapshot chunks) wrapped in a
    ``PickleBuffer``, so that protocol 5 hands it to ``buffer_callback`` instead of copying it."""
    if type(obj) is bytes:
        return pickle.PickleBuffer(obj) if len(obj) >= _OUT_OF_BAND_BYTES else obj
    if depth >= 4:
        return obj
    if type(obj) is dict:
        return {k: _outOfBand(v, depth + 1) for k, v in obj.items()}
    if type(obj) is list:
        return [_outOfBand(v, depth + 1) for v in obj]
    if type(obj) is tuple:
        return tuple(_outOfBand(v, depth + 1) for v in obj)
    return obj


def encode_message(message: Any) -> list[Any]:
    """The body of an authenticated frame for ``message``, as buffers to send in order."""
    buffers: list[pickle.PickleBuffer] = []
    payload = pickle.dumps(_outOfBand(message), protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    meta = _BODY.pack(len(payload), len(raws)) + b"".join(_U32.pack(len(r)) for r in raws)
    return [meta + payload, *raws]


def decode_message(body: memoryview) -> Any:
    """Inverse of ``encode_message``; refuses every global; raises on anything malformed."""
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
        buffers.append(bytes(body[start:start + size]))  # bytes: what pysyncobj's journal takes
        start += size
    return loads_restricted(body[offset:offset + npickle], buffers)


@dataclasses.dataclass
class TransportStats:
    """Counters shared by every connection of one transport class (i.e. one group)."""

    frames_sent: int = 0
    bytes_sent: int = 0  # payload bytes of authenticated frames (headers and handshakes excluded)
    frames_received: int = 0
    bytes_received: int = 0
    rejected: int = 0  # connections dropped for a handshake or framing violation
    appends_deferred: int = 0  # appends not sent because the peer's queue was full
    appends_rebased: int = 0  # stale appends a follower applied after its log, not truncating it
    probes: int = 0  # ports of members that closed their connection probed (module doc)
    peers_gone: int = 0  # probes refused: the member's process was gone

    def snapshot(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class _Settings:
    secret: bytes
    context: bytes
    max_frame_bytes: int
    socket_buffer_bytes: int
    stats: TransportStats
    on_peer_gone: Callable[[str], None] | None = None


def make_transport_class(*, secret: bytes, context: bytes, max_frame_bytes: int,
                         socket_buffer_bytes: int = 0,
                         on_peer_gone: Callable[[str], None] | None = None) -> type[TCPTransport]:
    """A ``TCPTransport`` subclass for ``SyncObj(transportClass=...)`` bound to these settings.

    ``socket_buffer_bytes == 0`` leaves SO_SNDBUF/SO_RCVBUF alone (setting them turns off Linux's
    buffer autotuning). ``on_peer_gone(address)`` is called on the tick thread when a member closed
    its connection and its Raft port then refused a probe (see the module doc).
    """
    if not isinstance(secret, bytes) or len(secret) < 16:
        raise ValueError("secret must be at least 16 bytes")
    if not isinstance(context, bytes) or not context:
        raise ValueError("context must be non-empty bytes")
    if max_frame_bytes < HANDSHAKE_FRAME_CAP:
        raise ValueError(f"max_frame_bytes must be >= {HANDSHAKE_FRAME_CAP}")
    if max_frame_bytes > 0xFFFFFFFF:
        raise ValueError("max_frame_bytes must fit the 4-byte frame header")
    if socket_buffer_bytes < 0:
        raise ValueError("socket_buffer_bytes must be >= 0")
    stats = TransportStats()
    settings = _Settings(secret, context, max_frame_bytes, socket_buffer_bytes, stats, on_peer_gone)
    return type("AuthTransport", (AuthTransport,), {"_settings": settings, "stats": stats})


class AuthTransport(TCPTransport):
    """pysyncobj's TCPTransport with our connection and server classes (see the module doc)."""

    _settings: _Settings | None = None
    stats: TransportStats | None = None  # set by make_transport_class

    def __init__(self, syncObj: Any, selfNode: Any, otherNodes: Any) -> None:
        if self._settings is None:
            raise TypeError("use make_transport_class() to build a configured AuthTransport")
        if syncObj.encryptor is not None:
            raise ValueError("AuthTransport authenticates peers itself: leave SyncObjConf.password unset")
        self._lastSweep = 0.0
        self._sentUpTo: dict[Any, tuple[int, int]] = {}  # node -> (term, last index sent)
        self._queueCap = 2 * self._settings.max_frame_bytes  # bytes queued per peer
        self._probes: dict[Any, _Probe] = {}  # node -> probe of its Raft port in flight
        super().__init__(syncObj, selfNode, otherNodes)

    # -- connection factory ---------------------------------------------------------------------

    def _newConnection(self, sock: socket.socket | None = None, peer: str = "") -> _PeerConnection:
        conf = self._syncObj.conf
        return _PeerConnection(self._settings, self._syncObj._poller, conf.connectionTimeout,
                               conf.tcp_keepalive, sock=sock, peer=peer)

    def _createServer(self) -> None:
        conf = self._syncObj.conf
        address = conf.bindAddress or self._selfNode.address
        host, port = address.rsplit(":", 1)
        self._server = _PeerServer(self, host.strip("[]"), int(port))

    def addNode(self, node: Any) -> None:
        # The stock addNode does the node bookkeeping and, for nodes this side dials, stores a
        # stock TcpConnection (its constructor touches no socket when given none); swap in ours.
        old = self._connections.get(node)
        super().addNode(node)
        stock = self._connections.get(node)
        if stock is None or isinstance(stock, _PeerConnection):
            return
        conn = self._newConnection(peer=getattr(node, "address", str(node)))
        conn.setOnConnectedCallback(functools.partial(self._onOutgoingConnected, conn))
        conn.setOnMessageReceivedCallback(functools.partial(self._onMessageReceived, node))
        conn.setOnDisconnectedCallback(functools.partial(self._onDisconnected, conn))
        self._connections[node] = conn
        if isinstance(old, _PeerConnection) and old is not conn:
            old.setOnDisconnectedCallback(None)
            old.disconnect()

    def _onIncomingMessageReceived(self, conn: Any, message: Any) -> None:
        # The first message on an authenticated incoming connection names the peer (its address,
        # "readonly") or is a utility command (a list). Anything else would make the stock handler
        # raise in the tick thread (an unhashable dict key), so drop the peer instead.
        if not isinstance(message, (str, list)):
            logger.warning("raft peer %s rejected: unexpected first message of type %s",
                           getattr(conn, "_peer", "?"), type(message).__name__)
            self._settings.stats.rejected += 1
            conn.disconnect()
            return
        node = self._nodeAddrToNode.get(message) if isinstance(message, str) else None
        old = self._connections.get(node) if node is not None else None
        super()._onIncomingMessageReceived(conn, message)
        if old is not None and old is not conn and self._connections.get(node) is conn:
            # The peer reconnected; the stock handler just forgets the old connection, which then
            # lingers until TCP keepalive notices. Close it now.
            old.setOnDisconnectedCallback(None)
            old.setOnMessageReceivedCallback(None)
            old.disconnect()

    def _onNewPeerSocket(self, sock: socket.socket, peer: str) -> None:
        pending = sum(1 for c in self._unknownConnections if not c.authenticated)
        if pending >= _MAX_PENDING_HANDSHAKES:
            logger.warning("raft peer %s rejected: %d handshakes already pending", peer, pending)
            self._settings.stats.rejected += 1
            sock.close()
            return
        self._onNewIncomingConnection(self._newConnection(sock=sock, peer=peer))

    # -- pipelined appends: keep nextIndex from moving backwards --------------------------------
    #
    # With appendEntriesUseBatch=False the leader sends every new entry at once and advances
    # nextIndex optimistically, so several append_entries are in flight per follower. But when a
    # success reply arrives, SyncObj sets nextIndex = the reply's next_node_idx, which is behind
    # the entries still in flight; the next send then re-sends them. Each follower gets most
    # entries several times (halving throughput with 4 commands in flight), and on receipt it
    # deletes its log from the resent prevLogIdx and re-adds the entries, logging "truncating
    # already-applied log entries ... may have diverged" (the entries are identical, so nothing
    # diverges, but a size-limited resend briefly leaves the follower's log shorter than its
    # commit index). The transport sees both sides, so it restores nextIndex right after such a
    # reply by delivering a synthetic "reset" reply (SyncObj's reset path sets nextIndex only;
    # matchIndex, which decides commits, is left to the real reply). Safety never depends on
    # nextIndex: a follower still checks prevLogIdx/prevLogTerm, and a lost in-flight append makes
    # it answer with a real reset, which wins. Forgotten on disconnect, on a real reset, on a
    # snapshot transfer and on a term change. tests/test_raft_pin.py guards the SyncObj code this
    # relies on; tests/test_raft_group.py checks that followers receive each entry once.
    #
    # Back-pressure: SyncObj sends every entry to every follower at once, so a slow follower's
    # queue would grow without bound. Above 2 x max_frame_bytes queued for a peer, appends that
    # carry entries are not sent (heartbeats still are); the follower then answers the next
    # heartbeat with a reset to its real log end, and SyncObj re-sends from there once the queue
    # has drained.

    def send(self, node: Any, message: Any) -> bool:
        appending = type(message) is dict and message.get("type") == "append_entries"
        if appending and message.get("entries"):
            conn = self._connections.get(node)
            if isinstance(conn, _PeerConnection) and conn.getSendBufferSize() > self._queueCap:
                self._sentUpTo.pop(node, None)
                self._settings.stats.appends_deferred += 1
                return False
        sent = super().send(node, message)
        if appending:
            if not sent or "serialized" in message or "transmission" in message:
                self._sentUpTo.pop(node, None)  # not sent, or a snapshot chunk: no pipelining
            elif message.get("entries"):
                self._sentUpTo[node] = (message["term"], message["entries"][-1][1])
        return sent

    # -- follower side: never truncate entries we already hold from this leader -----------------
    #
    # On any append_entries whose prevLogIdx is below its last index, SyncObj deletes its log from
    # prevLogIdx + 1 and re-adds the message's entries, whether or not they differ ("truncating
    # already-applied log entries ... may have diverged"). Raft deletes only from the first
    # *conflicting* entry. A stale or re-sent append (a reconnect, a reset, a stall) can then cut
    # entries this follower already acknowledged, so the leader counts it for entries it no
    # longer has. When our last entry carries the leader's current term, the leader wrote it and
    # still has it, so by Log Matching our log equals the leader's up to there: the message is
    # rewritten to append after our last entry (only its entries beyond it, none truncated), and
    # the reply (matching up to our last index) is true. Anything else goes to SyncObj as sent.

    def _rebase_append(self, message: dict) -> dict:
        if "prevLogIdx" not in message or "transmission" in message or "serialized" in message:
            return message
        log = self._syncObj._SyncObj__raftLog
        if len(log) == 0:
            return message
        first, (_, last_idx, last_term) = log[0][1], log[len(log) - 1]
        prev, term, entries = message["prevLogIdx"], message["term"], message.get("entries") or []
        if not (isinstance(prev, int) and first <= prev < last_idx and last_term == term):
            return message
        if log[prev - first][2] != message["prevLogTerm"]:
            return message  # SyncObj answers with a reset
        for entry in entries:
            idx = entry[1]
            if idx > last_idx:
                break
            if log[idx - first][2] != entry[2]:
                return message  # a real conflict: SyncObj truncates, as Raft does
        self._settings.stats.appends_rebased += 1
        return {**message, "prevLogIdx": last_idx, "prevLogTerm": last_term,
                "entries": [e for e in entries if e[1] > last_idx]}

    def _onMessageReceived(self, node: Any, message: Any) -> None:
        if type(message) is dict and message.get("type") == "append_entries" and not self._syncObj._isLeader():
            message = self._rebase_append(message)
        super()._onMessageReceived(node, message)
        if type(message) is not dict or message.get("type") != "next_node_idx":
            return
        if message.get("reset") or not message.get("success"):
            self._sentUpTo.pop(node, None)
            return
        sent = self._sentUpTo.get(node)
        if sent is None or not self._syncObj._isLeader() or sent[0] != self._syncObj._getTerm():
            return
        nextIdx = message.get("next_node_idx")
        if isinstance(nextIdx, int) and sent[1] + 1 > nextIdx:
            super()._onMessageReceived(node, {"type": "next_node_idx", "next_node_idx": sent[1] + 1,
                                              "reset": True, "success": False})

    def _onDisconnected(self, conn: Any) -> None:
        node = self._connToNode(conn)
        if node is not None:
            self._sentUpTo.pop(node, None)
        super()._onDisconnected(conn)
        if (node is not None and getattr(conn, "closedByPeer", False) and node in self._nodes
                and self._settings.on_peer_gone is not None and node not in self._probes):
            self._probe(node)

    # -- is a lost peer's process gone? (see the module doc) -------------------------------------

    def _probe(self, node: Any) -> None:
        ip = node.ip
        if ip is None:
            return
        settings = self._settings

        def gone(address: str) -> None:
            settings.stats.peers_gone += 1
            settings.on_peer_gone(address)

        settings.stats.probes += 1
        probe = _Probe(self._syncObj._poller, node.address, ip, node.port,
                       self._syncObj.conf.raftMinTimeout, gone, lambda: self._probes.pop(node, None))
        self._probes[node] = probe
        probe.start()

    def destroy(self) -> None:
        for probe in list(self._probes.values()):
            probe.close()
        super().destroy()

    # -- timeouts and keepalives ----------------------------------------------------------------

    def _onTick(self) -> None:
        super()._onTick()
        now = _monotonic()
        if now - self._lastSweep < _SWEEP_PERIOD:
            return
        self._lastSweep = now
        for conn in list(self._connections.values()) + list(self._unknownConnections):
            if isinstance(conn, _PeerConnection):
                conn.checkTimers(now)
        for probe in list(self._probes.values()):
            probe.checkTimers(now)


class _PeerServer:
    """Listening socket on the pysyncobj poller; hands accepted sockets to the transport."""

    def __init__(self, transport: AuthTransport, host: str, port: int) -> None:
        self._transport = transport
        self._host = host
        self._port = port
        self._sock: socket.socket | None = None
        self._fileno: int | None = None

    def bind(self) -> None:
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            _set_buffers(sock, self._transport._settings.socket_buffer_bytes)  # inherited by accepted sockets
            sock.setblocking(False)
            sock.bind((self._host, self._port))
            sock.listen(64)
        except OSError as exc:
            sock.close()
            logger.warning("raft listener %s:%d: cannot bind (%s); retrying", self._host, self._port, exc)
            raise
        self._sock, self._fileno = sock, sock.fileno()
        self._transport._syncObj._poller.subscribe(
            self._fileno, self._onEvent, POLL_EVENT_TYPE.READ | POLL_EVENT_TYPE.ERROR)

    def unbind(self) -> None:
        if self._fileno is not None:
            self._transport._syncObj._poller.unsubscribe(self._fileno)
            self._fileno = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _onEvent(self, descr: int, event: int) -> None:
        if descr != self._fileno or self._sock is None:
            return
        if event & POLL_EVENT_TYPE.ERROR:
            logger.error("raft listener %s:%d failed; rebinding", self._host, self._port)
            self.unbind()
            self._transport._ready = False  # TCPTransport._maybeBind rebinds on a later tick
            return
        for _ in range(16):  # accept a bounded batch per event
            try:
                sock, addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. EMFILE: leave it for the next event
                logger.warning("raft listener %s:%d accept failed: %s", self._host, self._port, exc)
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._transport._onNewPeerSocket(sock, f"{addr[0]}:{addr[1]}")


class _Probe:
    """One bare TCP connect to a lost member's Raft port, on the pysyncobj poller.

    Refused, or accepted and then reset or closed before ``_PROBE_SETTLE`` (a listener that closed
    while its process exited: the kernel resets connections still in its accept queue) -> nothing
    listens there: ``on_gone(address)``. Accepted and still open -> alive; no answer within
    ``window`` -> unknown; both close quietly. Sends nothing: a live peer sees a connection that
    closes before its HELLO.
    """

    def __init__(self, poller: Any, address: str, host: str, port: int, window: float,
                 on_gone: Callable[[str], None], on_done: Callable[[], None]) -> None:
        self._poller = poller
        self._address = address
        self._host = host
        self._port = port
        self._onGone = on_gone
        self._onDone = on_done
        self._sock: socket.socket | None = None
        self._fileno: int | None = None
        self._connected = False
        self._connectedAt = 0.0
        self._deadline = _monotonic() + window

    def start(self) -> None:
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            self.close()
            return
        self._sock, self._fileno = sock, sock.fileno()
        try:
            sock.setblocking(False)
            err = sock.connect_ex((self._host, self._port))
        except OSError as exc:
            err = exc.errno
        if err in (0, errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EAGAIN):
            self._poller.subscribe(self._fileno, self._onEvent,
                                   POLL_EVENT_TYPE.WRITE | POLL_EVENT_TYPE.ERROR)
        else:
            self._finish(gone=err == errno.ECONNREFUSED)

    def checkTimers(self, now: float) -> None:
        if self._connected and now >= self._connectedAt + _PROBE_SETTLE:
            self._finish(gone=False)  # a listener that stays: the peer is alive
        elif now >= self._deadline:
            self._finish(gone=False)  # no answer: unknown, the election timeout decides

    def close(self) -> None:
        if self._fileno is not None:
            self._poller.unsubscribe(self._fileno)
            self._fileno = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        done, self._onDone = self._onDone, None
        if done is not None:
            done()

    def _onEvent(self, descr: int, event: int) -> None:
        if descr != self._fileno or self._sock is None:
            return
        if not self._connected:
            err = self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err or event & POLL_EVENT_TYPE.ERROR:
                self._finish(gone=err in (0, errno.ECONNREFUSED, errno.ECONNRESET))
                return
            self._connected = True
            self._connectedAt = _monotonic()
            self._poller.subscribe(self._fileno, self._onEvent,
                                   POLL_EVENT_TYPE.READ | POLL_EVENT_TYPE.ERROR)
            return
        try:
            data = self._sock.recv(1)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        self._finish(gone=not data)  # reset or closed without a word; a byte: something alive

    def _finish(self, gone: bool) -> None:
        if self._onDone is None:
            return  # finished or closed already
        self.close()
        if gone:
            logger.info("raft peer %s closed its connection and its port refuses connections: "
                        "its process is gone", self._address)
            self._onGone(self._address)


def _set_buffers(sock: socket.socket, size: int) -> None:
    if size > 0:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)


def _set_keepalive(sock: socket.socket, keepalive: tuple[int, int, int] | None) -> None:
    if keepalive is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if sys.platform.startswith("linux"):
        idle, interval, count = keepalive
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, count)


class _PeerConnection:
    """One peer connection with the interface ``TCPTransport`` uses (camelCase is pysyncobj's).

    ``state`` follows pysyncobj's CONNECTION_STATE: an outgoing connection stays CONNECTING until
    the handshake succeeds; an incoming one is CONNECTED at once (as in the stock server), but
    delivers no message before the handshake succeeds.
    """

    def __init__(self, settings: _Settings, poller: Any, timeout: float,
                 keepalive: tuple[int, int, int] | None, *, sock: socket.socket | None = None,
                 peer: str = "") -> None:
        # Attributes TCPTransport reads or writes on connections (its password path is off).
        self.encryptor = None
        self.sendRandKey = None
        self.recvRandKey = None
        self.recvLastTimestamp = 0
        # Read by the transport in the disconnected callback (see _endConnection).
        self.closedByPeer = False

        self._settings = settings
        self._poller = poller
        self._timeout = timeout
        self._keepalive = keepalive
        self._peer = peer
        self._onConnected: Callable[[], None] | None = None
        self._onMessage: Callable[[Any], None] | None = None
        self._onDisconnected: Callable[[], None] | None = None

        self._stagingBuf = bytearray(_STAGING_BYTES)
        self._staging = memoryview(self._stagingBuf)
        self._reset()
        if sock is not None:  # accepted by our server
            self._sock = sock
            self._fileno = sock.fileno()
            self._incoming = True
            self._phase = _AWAIT_HELLO
            self._state = CONNECTION_STATE.CONNECTED
            _set_keepalive(sock, keepalive)
            self._handshakeDeadline = _monotonic() + timeout
            self._subscribe(POLL_EVENT_TYPE.READ | POLL_EVENT_TYPE.ERROR)

    def _reset(self) -> None:
        # Bumped on every reset: a callback may disconnect (and even reconnect) this connection
        # while we are still in a read loop over the old socket; the loop checks it and stops.
        self._gen = getattr(self, "_gen", 0) + 1
        self._sock: socket.socket | None = None
        self._fileno: int | None = None
        self._mask = 0
        self._state = CONNECTION_STATE.DISCONNECTED
        self._incoming = False
        self._phase = _TCP_CONNECTING
        self._clientNonce = b""
        self._serverNonce = b""
        self._out: collections.deque[memoryview] = collections.deque()
        self._outBytes = 0
        self._start = 0  # parsed-up-to offset in the staging buffer
        self._end = 0  # filled-up-to offset in the staging buffer
        self._big: np.ndarray | None = None  # frame too large for the staging buffer
        self._bigView: memoryview | None = None
        self._bigFilled = 0
        now = _monotonic()
        self._lastRead = now
        self._lastWrite = now
        self._handshakeDeadline = now + self._timeout

    # -- interface used by TCPTransport ----------------------------------------------------------

    @property
    def state(self) -> int:
        return self._state

    @property
    def authenticated(self) -> bool:
        return self._phase == _AUTHENTICATED

    def fileno(self) -> int | None:
        return self._fileno

    def setOnConnectedCallback(self, callback: Callable[[], None] | None) -> None:
        self._onConnected = callback

    def setOnMessageReceivedCallback(self, callback: Callable[[Any], None] | None) -> None:
        self._onMessage = callback

    def setOnDisconnectedCallback(self, callback: Callable[[], None] | None) -> None:
        self._onDisconnected = callback

    def getSendBufferSize(self) -> int:
        return self._outBytes

    def connect(self, host: str | None, port: int) -> bool:
        if host is None:
            return False
        if self._sock is not None:
            self._close()
        self._reset()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _set_buffers(sock, self._settings.socket_buffer_bytes)
            _set_keepalive(sock, self._keepalive)
            sock.setblocking(False)
            err = sock.connect_ex((host, port))
        except OSError:
            sock.close()
            return False
        if err not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EAGAIN):
            sock.close()
            return False
        self._sock, self._fileno = sock, sock.fileno()
        self._peer = f"{host}:{port}"
        self._state = CONNECTION_STATE.CONNECTING
        self._handshakeDeadline = _monotonic() + self._timeout
        self._subscribe(POLL_EVENT_TYPE.READ | POLL_EVENT_TYPE.WRITE | POLL_EVENT_TYPE.ERROR)
        return True

    def send(self, message: Any) -> None:
        if self._state == CONNECTION_STATE.DISCONNECTED:
            return
        if self._phase != _AUTHENTICATED:
            # TCPTransport only sends after the connected callback or an incoming message, both of
            # which need authentication; never let a pickle out before it.
            logger.debug("raft peer %s: dropped a message sent before authentication", self._peer)
            return
        body = encode_message(message)
        size = sum(len(part) for part in body)
        if size > self._settings.max_frame_bytes:
            logger.error("raft peer %s: outgoing message of %d bytes exceeds max_frame_bytes=%d; "
                         "disconnecting", self._peer, size, self._settings.max_frame_bytes)
            self.disconnect()
            return
        stats = self._settings.stats
        stats.frames_sent += 1
        stats.bytes_sent += size
        self._queue(_HEADER.pack(size), *body)
        self._flush()

    def disconnect(self) -> None:
        self._endConnection(byPeer=False)

    def _endConnection(self, byPeer: bool) -> None:
        notify = self._onDisconnected is not None and self._state != CONNECTION_STATE.DISCONNECTED
        # An authenticated connection the peer's kernel ended (EOF, reset, hang-up), as when its
        # process dies; never one we drop ourselves (timeouts, rejections, replacements).
        self.closedByPeer = byPeer and self._phase == _AUTHENTICATED
        self._close()
        self._reset()
        if notify:
            self._onDisconnected()

    # -- timers (called from the transport's tick sweep) ----------------------------------------

    def checkTimers(self, now: float) -> None:
        if self._state == CONNECTION_STATE.DISCONNECTED:
            return
        if self._phase != _AUTHENTICATED:
            if now > self._handshakeDeadline:
                if self._phase == _TCP_CONNECTING:
                    logger.debug("raft peer %s: connect timed out", self._peer)
                    self.disconnect()
                else:
                    self._reject("handshake timed out")
            return
        if now - self._lastRead > self._timeout:
            logger.info("raft peer %s: nothing received for %.1f s; disconnecting", self._peer,
                        now - self._lastRead)
            self.disconnect()
            return
        if now - self._lastWrite > self._timeout / 4 and not self._out:
            self._queue(_KEEPALIVE_FRAME)
            self._flush()

    # -- internals ------------------------------------------------------------------------------

    def _close(self) -> None:
        if self._fileno is not None:
            self._poller.unsubscribe(self._fileno)
        if self._sock is not None:
            self._sock.close()
        self._sock = None
        self._fileno = None

    def _subscribe(self, mask: int) -> None:
        if mask != self._mask and self._fileno is not None:
            self._mask = mask
            self._poller.subscribe(self._fileno, self._onEvent, mask)

    def _closedInHandshake(self) -> None:
        if self._phase == _AWAIT_HELLO and self._end == 0:
            # Not a byte said: a port probe (another replica asking whether we are alive, see
            # _Probe) or a health check. Nothing was violated; no warning.
            logger.debug("raft peer %s closed before its hello", self._peer)
            self.disconnect()
        else:
            self._reject("connection closed during the handshake")

    def _reject(self, reason: str) -> None:
        logger.warning("raft peer %s rejected: %s", self._peer, reason)
        self._settings.stats.rejected += 1
        self.disconnect()

    def _queue(self, *chunks: Any) -> None:
        for chunk in chunks:
            view = memoryview(chunk)
            self._out.append(view)
            self._outBytes += view.nbytes

    def _flush(self) -> None:
        out = self._out
        while out:
            try:
                if len(out) == 1:
                    sent = self._sock.send(out[0])
                else:
                    sent = self._sock.sendmsg([out[i] for i in range(min(len(out), _SENDMSG_MAX_BUFFERS))])
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                logger.debug("raft peer %s: send failed: %s", self._peer, exc)
                self._endConnection(byPeer=True)
                return
            self._lastWrite = _monotonic()
            self._outBytes -= sent
            while sent:
                head = out[0]
                if sent >= len(head):
                    sent -= len(head)
                    out.popleft()
                else:
                    out[0] = head[sent:]
                    sent = 0
        want = POLL_EVENT_TYPE.READ | POLL_EVENT_TYPE.ERROR
        if out or self._phase == _TCP_CONNECTING:
            want |= POLL_EVENT_TYPE.WRITE
        self._subscribe(want)

    def _onEvent(self, descr: int, event: int) -> None:
        if descr != self._fileno or self._sock is None:
            return  # a stale event for a socket we already closed
        if event & POLL_EVENT_TYPE.ERROR:
            if self._phase == _AWAIT_HELLO or self._phase == _AWAIT_RESPONSE:
                self._closedInHandshake()
            else:
                logger.debug("raft peer %s: socket error or hang-up", self._peer)
                self._endConnection(byPeer=True)
            return
        if self._phase == _TCP_CONNECTING:
            self._onTcpConnected()
            return
        if event & POLL_EVENT_TYPE.WRITE:
            gen = self._gen
            self._flush()
            if gen != self._gen:
                return
        if event & POLL_EVENT_TYPE.READ:
            self._read()

    def _onTcpConnected(self) -> None:
        err = self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            logger.debug("raft peer %s: connect failed: %s", self._peer, os.strerror(err))
            self.disconnect()
            return
        self._clientNonce = os.urandom(NONCE_BYTES)
        self._phase = _AWAIT_CHALLENGE
        hello = HELLO_MAGIC + bytes((PROTOCOL_VERSION,)) + self._clientNonce
        self._queue(_HEADER.pack(len(hello)), hello)
        self._flush()

    def _read(self) -> None:
        budget = _READ_BUDGET
        gen = self._gen
        while budget > 0 and gen == self._gen:
            if self._big is not None:
                n = self._recvInto(self._bigView[self._bigFilled:])
                if not n:
                    return
                budget -= n
                self._bigFilled += n
                if self._bigFilled == len(self._big):
                    frame, self._big, self._bigView = self._big, None, None
                    self._deliver(memoryview(frame))
                continue
            if len(self._stagingBuf) - self._end < _COMPACT_BELOW and self._start > 0:
                pending = self._end - self._start
                self._staging[:pending] = self._staging[self._start:self._end]
                self._start, self._end = 0, pending
            n = self._recvInto(self._staging[self._end:])
            if not n:
                return
            budget -= n
            self._end += n
            self._parse(gen)

    def _recvInto(self, view: memoryview) -> int:
        """Bytes read into ``view``; 0 when nothing is available or the connection ended."""
        try:
            n = self._sock.recv_into(view)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError as exc:
            logger.debug("raft peer %s: recv failed: %s", self._peer, exc)
            self._endConnection(byPeer=True)
            return 0
        if n == 0:
            if self._phase in (_AWAIT_HELLO, _AWAIT_RESPONSE, _AWAIT_CHALLENGE):
                self._closedInHandshake()
            else:
                self._endConnection(byPeer=True)
            return 0
        self._lastRead = _monotonic()
        return n

    def _parse(self, gen: int) -> None:
        """Deliver every complete frame in the staging buffer; move a large one to its own buffer."""
        buf = self._stagingBuf
        while gen == self._gen:
            avail = self._end - self._start
            if avail < _HEADER.size:
                break
            (length,) = _HEADER.unpack_from(buf, self._start)
            cap = self._settings.max_frame_bytes if self._phase == _AUTHENTICATED else HANDSHAKE_FRAME_CAP
            if length > cap:
                self._reject(f"frame of {length} bytes exceeds the {cap}-byte cap")
                return
            body = self._start + _HEADER.size
            if avail - _HEADER.size >= length:
                self._start = body + length
                self._deliver(self._staging[body:body + length])
                continue
            if _HEADER.size + length > len(buf):
                have = self._end - body
                # length <= cap, checked above; np.empty: every byte is received into it,
                # so zero-filling it first (bytearray(length)) was one more pass per entry
                self._big = np.empty(length, np.uint8)
                self._bigView = memoryview(self._big)
                self._bigView[:have] = self._staging[body:self._end]
                self._bigFilled = have
                self._start = self._end = 0
            break
        if gen == self._gen and self._start == self._end:
            self._start = self._end = 0

    def _deliver(self, frame: memoryview) -> None:
        if self._phase != _AUTHENTICATED:
            self._handshake(bytes(frame))
            return
        if not len(frame):
            return  # keepalive
        stats = self._settings.stats
        stats.frames_received += 1
        stats.bytes_received += len(frame)
        try:
            message = decode_message(frame)
        except Exception as exc:  # noqa: BLE001 - any malformed or hostile pickle: log, drop the peer
            self._reject(f"undecodable frame of {len(frame)} bytes ({type(exc).__name__}: {exc})")
            return
        if self._onMessage is not None:
            self._onMessage(message)

    def _handshake(self, frame: bytes) -> None:
        s = self._settings
        if self._phase == _AWAIT_HELLO:
            if (len(frame) != _HELLO_BYTES or not frame.startswith(HELLO_MAGIC)):
                self._reject(f"bad hello ({len(frame)} bytes)")
                return
            if frame[len(HELLO_MAGIC)] != PROTOCOL_VERSION:
                self._reject(f"unsupported protocol version {frame[len(HELLO_MAGIC)]}")
                return
            self._clientNonce = frame[len(HELLO_MAGIC) + 1:]
            self._serverNonce = os.urandom(NONCE_BYTES)
            mac = handshake_mac(s.secret, s.context, b"server", self._clientNonce, self._serverNonce)
            self._phase = _AWAIT_RESPONSE
            self._queue(_HEADER.pack(_CHALLENGE_BYTES), self._serverNonce + mac)
            self._flush()
        elif self._phase == _AWAIT_CHALLENGE:
            if len(frame) != _CHALLENGE_BYTES:
                self._reject(f"bad challenge ({len(frame)} bytes)")
                return
            self._serverNonce, mac = frame[:NONCE_BYTES], frame[NONCE_BYTES:]
            expected = handshake_mac(s.secret, s.context, b"server", self._clientNonce, self._serverNonce)
            if not hmac.compare_digest(mac, expected):
                self._reject("server failed authentication (wrong secret or context)")
                return
            response = handshake_mac(s.secret, s.context, b"client", self._clientNonce, self._serverNonce)
            self._queue(_HEADER.pack(len(response)), response)
            self._phase = _AUTHENTICATED
            self._state = CONNECTION_STATE.CONNECTED
            gen = self._gen
            self._flush()
            if gen == self._gen and self._onConnected is not None:
                self._onConnected()
        elif self._phase == _AWAIT_RESPONSE:
            expected = handshake_mac(s.secret, s.context, b"client", self._clientNonce, self._serverNonce)
            if len(frame) != _MAC_BYTES or not hmac.compare_digest(frame, expected):
                self._reject("client failed authentication (wrong secret or context, or a replay)")
                return
            self._phase = _AUTHENTICATED
            logger.debug("raft peer %s authenticated", self._peer)
        else:  # pragma: no cover - no frames are parsed while the TCP connect is pending
            self._reject("unexpected frame before the connection was established")
