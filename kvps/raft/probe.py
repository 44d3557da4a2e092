"""Is a lost peer's process gone? One bare TCP connect to its Raft port tells.

A connection records whether the *peer's* kernel ended it (``PeerConnection.closedByPeer``: EOF,
reset, hang-up on an authenticated connection), which is what a peer process's death looks like;
connections we close ourselves (idle timeout, rejected frame, replaced by a reconnect) and
connections that just go silent (a partition) do not count. For such a member, when
``make_transport_class(on_peer_gone=...)`` is given, the transport then starts a ``PortProbe`` of
its Raft port: refused, or accepted and reset before the probe's window ends (a listener that
closed as its process exited), means nothing listens there any more and ``on_peer_gone(address)``
is called on the tick thread (``kvps.raft.failover`` acts on it). A live peer that closed the
connection (its idle timeout, a rejected frame, our removal from its member list) still listens:
no call.
"""
from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Callable
from typing import Any

from pysyncobj.monotonic import monotonic as _monotonic
from pysyncobj.poller import POLL_EVENT_TYPE

__all__ = ["PortProbe"]

logger = logging.getLogger("kvps.raft")

_PROBE_SETTLE = 0.05  # s a probe that connected waits for a reset before calling the peer alive


class PortProbe:
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
