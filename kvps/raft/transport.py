"""The Raft peer transport: authenticated, size-capped, protocol-5 pickles, no zlib.

pysyncobj's stock transport feeds every frame a peer sends to ``pickle.loads`` (anyone who reaches
a Raft port runs code on the node), trusts a 4-byte length of any size, pickles with protocol 2
and zlib-compresses every message once per follower. ``make_transport_class(...)`` returns a
``TCPTransport`` subclass (given to ``SyncObj`` as ``transportClass``) that keeps pysyncobj's
bookkeeping (node table, reconnects, readonly and utility messages) and replaces the rest:

* ``kvps.raft.wire`` -- the bytes: frames, message bodies, the no-globals unpickler, the MAC;
* ``kvps.raft.handshake`` -- the mutual HMAC challenge-response on the cluster secret;
* ``kvps.raft.connection`` -- ``PeerConnection``, in place of the stock ``TcpConnection``, which
  ``addNode`` hard-codes for outgoing connections (overridden here);
* ``kvps.raft.listener`` -- ``PeerListener``, in place of the stock ``TcpServer``, which hard-codes
  its connection class (``_createServer`` is overridden here);
* ``kvps.raft.probe`` -- does a member that closed its connection still listen?
* ``kvps.raft.replication`` -- the nextIndex and follower-rebase patches, and back-pressure.

It also adds a timeout/keepalive sweep to ``_onTick``. The pysyncobj names it overrides or calls
are listed, and reached, through ``kvps.raft.internals``.
"""
from __future__ import annotations

import functools
import logging
import socket
from collections.abc import Callable
from typing import Any

from pysyncobj.monotonic import monotonic as _monotonic
from pysyncobj.transport import TCPTransport

from kvps.raft import internals
from kvps.raft.connection import PeerConnection
from kvps.raft.listener import PeerListener
from kvps.raft.peer_settings import PeerSettings, TransportStats
from kvps.raft.probe import PortProbe
from kvps.raft.replication import AppendPipeline, is_append, rebase_append
from kvps.raft.wire import HANDSHAKE_FRAME_CAP

__all__ = ["AuthTransport", "TransportStats", "make_transport_class"]

logger = logging.getLogger("kvps.raft")

_MAX_PENDING_HANDSHAKES = 64  # unauthenticated incoming connections held at once
_SWEEP_PERIOD = 0.1  # seconds between timeout / keepalive sweeps


def make_transport_class(*, secret: bytes, context: bytes, max_frame_bytes: int,
                         socket_buffer_bytes: int = 0,
                         on_peer_gone: Callable[[str], None] | None = None,
                         on_send: Callable[[Any], None] | None = None,
                         defer_bind: bool = False) -> type[TCPTransport]:
    """A ``TCPTransport`` subclass for ``SyncObj(transportClass=...)`` bound to these settings.

    ``socket_buffer_bytes == 0`` leaves SO_SNDBUF/SO_RCVBUF alone (setting them turns off Linux's
    buffer autotuning). ``on_peer_gone(address)`` is called on the tick thread when a member closed
    its connection and its Raft port then refused a probe (``kvps.raft.probe``).
    ``on_send(message)`` sees every message the group sends, before it is encoded (the quiet
    heartbeats' mark, ``kvps.raft.quiet``).
    ``defer_bind``: report ready while the group is being built, and bind on its ticks (a group
    built on ``kvps.raft.ticker``'s thread; the class's ``deferring_bind`` is cleared once it is).
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
    settings = PeerSettings(secret, context, max_frame_bytes, socket_buffer_bytes, stats, on_peer_gone,
                            on_send)
    return type("AuthTransport", (AuthTransport,), {"_settings": settings, "stats": stats,
                                                    "deferring_bind": defer_bind})


class AuthTransport(TCPTransport):
    """pysyncobj's TCPTransport with our connection and server classes (see the module doc)."""

    _settings: PeerSettings | None = None
    stats: TransportStats | None = None  # set by make_transport_class
    # Without autoTick, SyncObj.__init__ spins on ``tryGetReady`` until the port binds, which on
    # the ticker's thread would stall every other group while a dead process's port lingers:
    # while this is set the transport reports ready and binds from its first ticks instead
    # (TCPTransport._onTick binds whenever it is not bound, as after a listener failure).
    deferring_bind: bool = False

    def __init__(self, syncObj: Any, selfNode: Any, otherNodes: Any) -> None:
        if self._settings is None:
            raise TypeError("use make_transport_class() to build a configured AuthTransport")
        if syncObj.encryptor is not None:
            raise ValueError("AuthTransport authenticates peers itself: leave SyncObjConf.password unset")
        self._lastSweep = 0.0
        self._appends = AppendPipeline(queue_cap=2 * self._settings.max_frame_bytes)
        self._probes: dict[Any, PortProbe] = {}  # node -> probe of its Raft port in flight
        super().__init__(syncObj, selfNode, otherNodes)

    @property
    def ready(self) -> bool:
        return self.deferring_bind or internals.transport_ready(self)

    # -- connections and the listener -----------------------------------------------------------

    def _newConnection(self, sock: socket.socket | None = None, peer: str = "") -> PeerConnection:
        sync = internals.sync_obj(self)
        conf = sync.conf
        return PeerConnection(self._settings, internals.poller(sync), conf.connectionTimeout,
                              conf.tcp_keepalive, sock=sock, peer=peer)

    def _createServer(self) -> None:
        sync = internals.sync_obj(self)
        address = sync.conf.bindAddress or internals.self_node(self).address
        host, port = address.rsplit(":", 1)
        internals.set_server(self, PeerListener(
            internals.poller(sync), host.strip("[]"), int(port),
            socket_buffer_bytes=self._settings.socket_buffer_bytes, on_socket=self._onNewPeerSocket,
            on_failure=functools.partial(internals.mark_unbound, self)))

    def addNode(self, node: Any) -> None:
        # The stock addNode does the node bookkeeping and, for nodes this side dials, stores a
        # stock TcpConnection (its constructor touches no socket when given none); swap in ours.
        conns = internals.connections(self)
        old = conns.get(node)
        super().addNode(node)
        stock = conns.get(node)
        if stock is None or isinstance(stock, PeerConnection):
            return
        conn = self._newConnection(peer=getattr(node, "address", str(node)))
        conn.setOnConnectedCallback(functools.partial(internals.outgoing_connected, self, conn))
        conn.setOnMessageReceivedCallback(functools.partial(self._onMessageReceived, node))
        conn.setOnDisconnectedCallback(functools.partial(self._onDisconnected, conn))
        conns[node] = conn
        if isinstance(old, PeerConnection) and old is not conn:
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
        conns = internals.connections(self)
        node = internals.node_at(self, message) if isinstance(message, str) else None
        old = conns.get(node) if node is not None else None
        super()._onIncomingMessageReceived(conn, message)
        if old is not None and old is not conn and conns.get(node) is conn:
            # The peer reconnected; the stock handler just forgets the old connection, which then
            # lingers until TCP keepalive notices. Close it now.
            old.setOnDisconnectedCallback(None)
            old.setOnMessageReceivedCallback(None)
            old.disconnect()

    def _onNewPeerSocket(self, sock: socket.socket, peer: str) -> None:
        pending = sum(1 for c in internals.unknown_connections(self) if not c.authenticated)
        if pending >= _MAX_PENDING_HANDSHAKES:
            logger.warning("raft peer %s rejected: %d handshakes already pending", peer, pending)
            self._settings.stats.rejected += 1
            sock.close()
            return
        internals.add_incoming(self, self._newConnection(sock=sock, peer=peer))

    # -- replication patches (kvps.raft.replication) --------------------------------------------

    def send(self, node: Any, message: Any) -> bool:
        if self._settings.on_send is not None:
            self._settings.on_send(message)
        if self._appends.must_defer(node, message, functools.partial(self._queuedBytes, node)):
            self._settings.stats.appends_deferred += 1
            return False
        sent = super().send(node, message)
        self._appends.after_send(node, message, sent)
        return sent

    def _queuedBytes(self, node: Any) -> int:
        conn = internals.connections(self).get(node)
        return conn.getSendBufferSize() if isinstance(conn, PeerConnection) else 0

    def _onMessageReceived(self, node: Any, message: Any) -> None:
        sync = internals.sync_obj(self)
        if is_append(message) and not internals.is_leader(sync):
            rebased = rebase_append(internals.raft_log(sync), message)
            if rebased is not message:
                self._settings.stats.appends_rebased += 1
            message = rebased
        super()._onMessageReceived(node, message)
        reset = self._appends.after_reply(node, message, internals.is_leader(sync),
                                          internals.term(sync))
        if reset is not None:
            super()._onMessageReceived(node, reset)

    def _onDisconnected(self, conn: Any) -> None:
        node = internals.node_of(self, conn)
        if node is not None:
            self._appends.forget(node)
        super()._onDisconnected(conn)
        if (node is not None and getattr(conn, "closedByPeer", False)
                and internals.is_member(self, node) and self._settings.on_peer_gone is not None
                and node not in self._probes):
            self._probe(node)

    # -- is a lost peer's process gone? (kvps.raft.probe) ---------------------------------------

    def _probe(self, node: Any) -> None:
        ip = node.ip
        if ip is None:
            return
        settings = self._settings
        sync = internals.sync_obj(self)

        def gone(address: str) -> None:
            settings.stats.peers_gone += 1
            settings.on_peer_gone(address)

        settings.stats.probes += 1
        probe = PortProbe(internals.poller(sync), node.address, ip, node.port,
                          sync.conf.raftMinTimeout, gone, lambda: self._probes.pop(node, None))
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
        conns = list(internals.connections(self).values()) + list(internals.unknown_connections(self))
        for conn in conns:
            if isinstance(conn, PeerConnection):
                conn.checkTimers(now)
        for probe in list(self._probes.values()):
            probe.checkTimers(now)
