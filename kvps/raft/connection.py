"""One authenticated, size-capped peer connection on pysyncobj's poller (replaces ``TcpConnection``).

pysyncobj's stock ``TcpConnection`` feeds every frame a peer sends to ``pickle.loads``, trusts a
4-byte length of any size, and copies its whole read and write buffers on every socket call
(``buf += data``, ``buf = buf[n:]``), which is quadratic on MB-sized frames. ``PeerConnection``
offers the interface ``TCPTransport`` uses, speaks ``kvps.raft.wire`` and runs the
``kvps.raft.handshake`` state machine first: nothing is unpickled before it succeeds. Handshake
frames are capped at 1 KiB, later ones at ``max_frame_bytes``, checked on the length header
before any buffer is allocated.

I/O runs on pysyncobj's poller in its tick thread, on non-blocking sockets: small frames are
parsed out of one reusable 256 KiB staging buffer (and the entries in them copied out: the
buffer is reused); a frame larger than that is received with ``recv_into`` into a buffer of its
own, whose entries stay views of it: taken from the tick thread's ``kvps.buffers`` pool, so a
buffer is reused (its pages already faulted in) once nothing refers to it any more -- its
entries applied and released from the log (``kvps.raft.log_memory``); outgoing frames wait in a deque of
memoryviews sent with ``sendmsg`` (no re-slicing copies); at most 16 MiB are read per poll event
so the tick thread keeps heart-beating while a peer streams a large backlog.

A keepalive (an empty frame) goes out after ``connectionTimeout / 4`` of quiet, so the idle
timeout also works on follower-to-follower connections (no Raft traffic between elections); the
stock transport noticed a dead connection only when it next sent (and dropped that message,
often a vote request).

Every rejection logs one line on logger ``kvps.raft`` (peer address and reason) and disconnects.
``closedByPeer`` says whether the peer's kernel ended an authenticated connection (what a peer
process's death looks like: ``kvps.raft.probe``).
"""
from __future__ import annotations

import collections
import errno
import logging
import os
import socket
from collections.abc import Callable
from typing import Any

import numpy as np
from pysyncobj.monotonic import monotonic as _monotonic
from pysyncobj.poller import POLL_EVENT_TYPE
from pysyncobj.tcp_connection import CONNECTION_STATE

from kvps.raft.frame_buffers import STAGING_BYTES, frame_buffers
from kvps.raft.handshake import (AWAIT_CHALLENGE, AWAIT_HELLO, AWAIT_RESPONSE, TCP_CONNECTING,
                                 Handshake, HandshakeRejected)
from kvps.raft.peer_settings import PeerSettings, set_buffers, set_keepalive
from kvps.raft.wire import (FRAME_HEADER, HANDSHAKE_FRAME_CAP, KEEPALIVE_FRAME, decode_message,
                            encode_message)

__all__ = ["PeerConnection"]

logger = logging.getLogger("kvps.raft")

_COMPACT_BELOW = 64 * 1024  # move a partial frame to the front when less room than this is left
_READ_BUDGET = 16 * 1024 * 1024  # bytes read per poll event before yielding to the tick loop
_SENDMSG_MAX_BUFFERS = 64


class PeerConnection:
    """One peer connection with the interface ``TCPTransport`` uses (camelCase is pysyncobj's).

    ``state`` follows pysyncobj's CONNECTION_STATE: an outgoing connection stays CONNECTING until
    the handshake succeeds; an incoming one is CONNECTED at once (as in the stock server), but
    delivers no message before the handshake succeeds.
    """

    def __init__(self, settings: PeerSettings, poller: Any, timeout: float,
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

        self._stagingBuf = bytearray(STAGING_BYTES)  # larger frames: a pooled buffer of their own
        self._staging = memoryview(self._stagingBuf)
        self._reset()
        if sock is not None:  # accepted by our server
            self._sock = sock
            self._fileno = sock.fileno()
            self._handshake = Handshake(settings.secret, settings.context, incoming=True)
            self._state = CONNECTION_STATE.CONNECTED
            set_keepalive(sock, keepalive)
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
        self._handshake = Handshake(self._settings.secret, self._settings.context, incoming=False)
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
        return self._handshake.authenticated

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
            set_buffers(sock, self._settings.socket_buffer_bytes)
            set_keepalive(sock, self._keepalive)
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
        if not self._handshake.authenticated:
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
        self._queue(FRAME_HEADER.pack(size), *body)
        self._flush()

    def disconnect(self) -> None:
        self._endConnection(byPeer=False)

    def _endConnection(self, byPeer: bool) -> None:
        notify = self._onDisconnected is not None and self._state != CONNECTION_STATE.DISCONNECTED
        # An authenticated connection the peer's kernel ended (EOF, reset, hang-up), as when its
        # process dies; never one we drop ourselves (timeouts, rejections, replacements).
        self.closedByPeer = byPeer and self._handshake.authenticated
        self._close()
        self._reset()
        if notify:
            self._onDisconnected()

    # -- timers (called from the transport's tick sweep) ----------------------------------------

    def checkTimers(self, now: float) -> None:
        if self._state == CONNECTION_STATE.DISCONNECTED:
            return
        if not self._handshake.authenticated:
            if now > self._handshakeDeadline:
                if self._handshake.phase == TCP_CONNECTING:
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
            self._queue(KEEPALIVE_FRAME)
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
        if self._handshake.phase == AWAIT_HELLO and self._end == 0:
            # Not a byte said: a port probe (another replica asking whether we are alive,
            # kvps.raft.probe) or a health check. Nothing was violated; no warning.
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
        if out or self._handshake.phase == TCP_CONNECTING:
            want |= POLL_EVENT_TYPE.WRITE
        self._subscribe(want)

    def _onEvent(self, descr: int, event: int) -> None:
        if descr != self._fileno or self._sock is None:
            return  # a stale event for a socket we already closed
        phase = self._handshake.phase
        if event & POLL_EVENT_TYPE.ERROR:
            if phase == AWAIT_HELLO or phase == AWAIT_RESPONSE:
                self._closedInHandshake()
            else:
                logger.debug("raft peer %s: socket error or hang-up", self._peer)
                self._endConnection(byPeer=True)
            return
        if phase == TCP_CONNECTING:
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
        hello = self._handshake.hello()
        self._queue(FRAME_HEADER.pack(len(hello)), hello)
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
                    self._deliver(memoryview(frame), owned=True)  # reused only once unreferenced
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
            if self._handshake.phase in (AWAIT_HELLO, AWAIT_RESPONSE, AWAIT_CHALLENGE):
                self._closedInHandshake()
            else:
                self._endConnection(byPeer=True)
            return 0
        self._lastRead = _monotonic()
        return n

    def _parse(self, gen: int) -> None:
        """Deliver every complete frame in the staging buffer; move a large one to its own buffer."""
        buf = self._stagingBuf
        header = FRAME_HEADER.size
        while gen == self._gen:
            avail = self._end - self._start
            if avail < header:
                break
            (length,) = FRAME_HEADER.unpack_from(buf, self._start)
            authenticated = self._handshake.authenticated
            cap = self._settings.max_frame_bytes if authenticated else HANDSHAKE_FRAME_CAP
            if length > cap:
                self._reject(f"frame of {length} bytes exceeds the {cap}-byte cap")
                return
            body = self._start + header
            if avail - header >= length:
                self._start = body + length
                self._deliver(self._staging[body:body + length])
                continue
            if header + length > len(buf):
                have = self._end - body
                # length <= cap, checked above; not zero-filled: every byte is received into
                # it; a recycled buffer once nothing refers to it (module docstring)
                self._big = frame_buffers().take(length)
                self._bigView = memoryview(self._big)
                self._bigView[:have] = self._staging[body:self._end]
                self._bigFilled = have
                self._start = self._end = 0
            break
        if gen == self._gen and self._start == self._end:
            self._start = self._end = 0

    def _deliver(self, frame: memoryview, owned: bool = False) -> None:
        """Hand one frame's message on; ``owned``: the frame has a buffer of its own (a large
        frame), so the entries in it may stay views of it (``wire.decode_message``); a frame
        in the reused staging buffer is copied out."""
        if not self._handshake.authenticated:
            self._onHandshakeFrame(bytes(frame))
            return
        if not len(frame):
            return  # keepalive
        stats = self._settings.stats
        stats.frames_received += 1
        stats.bytes_received += len(frame)
        try:
            message = decode_message(frame, owned=owned)
        except Exception as exc:  # noqa: BLE001 - any malformed or hostile pickle: log, drop the peer
            self._reject(f"undecodable frame of {len(frame)} bytes ({type(exc).__name__}: {exc})")
            return
        if self._onMessage is not None:
            self._onMessage(message)

    def _onHandshakeFrame(self, frame: bytes) -> None:
        outgoing = self._handshake.phase == AWAIT_CHALLENGE
        try:
            answer = self._handshake.receive(frame)
        except HandshakeRejected as exc:
            self._reject(str(exc))
            return
        if answer:
            self._queue(FRAME_HEADER.pack(len(answer)), answer)
        if not self._handshake.authenticated:  # the accepting side sent its challenge
            self._flush()
        elif not outgoing:  # the accepting side checked the response
            logger.debug("raft peer %s authenticated", self._peer)
        else:  # the connecting side checked the challenge and answers it
            self._state = CONNECTION_STATE.CONNECTED
            gen = self._gen
            self._flush()
            if gen == self._gen and self._onConnected is not None:
                self._onConnected()
