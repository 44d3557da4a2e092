"""What one group's transport shares with every peer connection it makes: settings, counters,
and the socket options set from them.

``kvps.raft.transport.make_transport_class`` validates the settings and binds them, with one
``TransportStats``, to the transport class it returns; each ``PeerConnection`` reads them.
"""
from __future__ import annotations

import dataclasses
import socket
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["PeerSettings", "TransportStats", "set_buffers", "set_keepalive"]


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
    probes: int = 0  # ports of members that closed their connection probed (kvps.raft.probe)
    peers_gone: int = 0  # probes refused: the member's process was gone

    def snapshot(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class PeerSettings:
    """The cluster secret, the group's context and the limits every connection applies."""

    secret: bytes
    context: bytes
    max_frame_bytes: int
    socket_buffer_bytes: int  # 0: leave SO_SNDBUF/SO_RCVBUF (and Linux's autotuning) alone
    stats: TransportStats
    on_peer_gone: Callable[[str], None] | None = None
    on_send: Callable[[Any], None] | None = None  # sees (and may mark) every message sent


def set_buffers(sock: socket.socket, size: int) -> None:
    """SO_SNDBUF/SO_RCVBUF to ``size``; 0 leaves them (and Linux's autotuning) alone."""
    if size > 0:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)


def set_keepalive(sock: socket.socket, keepalive: tuple[int, int, int] | None) -> None:
    """TCP keepalive from pysyncobj's ``tcp_keepalive`` (idle, interval, count); None: OS default."""
    if keepalive is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if sys.platform.startswith("linux"):
        idle, interval, count = keepalive
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, count)
