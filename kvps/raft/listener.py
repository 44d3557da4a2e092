"""The Raft port's listening socket, on pysyncobj's poller (replaces the stock ``TcpServer``).

The stock server hard-codes its connection class; ``AuthTransport._createServer`` installs this
one instead, which hands every accepted socket to the transport (``on_socket``), where it becomes
a ``kvps.raft.connection.PeerConnection``. ``TCPTransport`` only calls ``bind`` (retrying after
any exception) and ``unbind``.
"""
from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from typing import Any

from pysyncobj.poller import POLL_EVENT_TYPE

from kvps.raft.peer_settings import set_buffers

__all__ = ["PeerListener"]

logger = logging.getLogger("kvps.raft")

_ACCEPT_BATCH = 16  # sockets accepted per poll event


class PeerListener:
    """Listening socket on the pysyncobj poller; hands accepted sockets to ``on_socket``."""

    def __init__(self, poller: Any, host: str, port: int, *, socket_buffer_bytes: int,
                 on_socket: Callable[[socket.socket, str], None],
                 on_failure: Callable[[], None]) -> None:
        self._poller = poller
        self._host = host
        self._port = port
        self._buffer_bytes = socket_buffer_bytes
        self._on_socket = on_socket
        self._on_failure = on_failure  # the transport binds again on a later tick
        self._sock: socket.socket | None = None
        self._fileno: int | None = None

    def bind(self) -> None:
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            set_buffers(sock, self._buffer_bytes)  # inherited by accepted sockets
            sock.setblocking(False)
            sock.bind((self._host, self._port))
            sock.listen(64)
        except OSError as exc:
            sock.close()
            logger.warning("raft listener %s:%d: cannot bind (%s); retrying", self._host, self._port, exc)
            raise
        self._sock, self._fileno = sock, sock.fileno()
        self._poller.subscribe(self._fileno, self._onEvent,
                               POLL_EVENT_TYPE.READ | POLL_EVENT_TYPE.ERROR)

    def unbind(self) -> None:
        if self._fileno is not None:
            self._poller.unsubscribe(self._fileno)
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
            self._on_failure()
            return
        for _ in range(_ACCEPT_BATCH):  # a bounded batch per event
            try:
                sock, addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. EMFILE: leave it for the next event
                logger.warning("raft listener %s:%d accept failed: %s", self._host, self._port, exc)
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._on_socket(sock, f"{addr[0]}:{addr[1]}")
