"""The peer handshake as a state machine over frames: which frame comes next, what to answer.

Pure: no socket, no thread, no clock, no pysyncobj; the nonce source is injected (``os.urandom``
by default). ``kvps.raft.connection`` feeds it the handshake frames it reads and sends what it
answers; the messages and their MACs are described in ``kvps.raft.wire``.

Phases of one connection::

    outgoing  TCP_CONNECTING --hello()--> AWAIT_CHALLENGE --receive(CHALLENGE)--> AUTHENTICATED
    incoming  AWAIT_HELLO --receive(HELLO)--> AWAIT_RESPONSE --receive(RESPONSE)--> AUTHENTICATED

Any other frame, or a MAC that does not check, raises ``HandshakeRejected`` naming the reason
(the connection logs it and drops the peer).
"""
from __future__ import annotations

import hmac
import os
from collections.abc import Callable

from kvps.raft.wire import (
    CHALLENGE_BYTES,
    HELLO_BYTES,
    HELLO_MAGIC,
    MAC_BYTES,
    NONCE_BYTES,
    PROTOCOL_VERSION,
    handshake_mac,
)

__all__ = [
    "AUTHENTICATED", "AWAIT_CHALLENGE", "AWAIT_HELLO", "AWAIT_RESPONSE", "Handshake",
    "HandshakeRejected", "TCP_CONNECTING",
]

TCP_CONNECTING = 0  # outgoing: waiting for the TCP connect to complete
AWAIT_HELLO = 1  # incoming: waiting for HELLO
AWAIT_CHALLENGE = 2  # outgoing: HELLO sent, waiting for CHALLENGE
AWAIT_RESPONSE = 3  # incoming: CHALLENGE sent, waiting for RESPONSE
AUTHENTICATED = 4


class HandshakeRejected(Exception):
    """The peer broke the handshake; the message is the reason logged for it."""


class Handshake:
    """One side of one connection's handshake (see the module doc)."""

    def __init__(self, secret: bytes, context: bytes, *, incoming: bool,
                 nonce: Callable[[int], bytes] = os.urandom) -> None:
        self._secret = secret
        self._context = context
        self._nonce = nonce
        self.phase = AWAIT_HELLO if incoming else TCP_CONNECTING
        self._client_nonce = b""
        self._server_nonce = b""

    @property
    def authenticated(self) -> bool:
        return self.phase == AUTHENTICATED

    def hello(self) -> bytes:
        """The outgoing side's first frame, once its TCP connect has completed."""
        self._client_nonce = self._nonce(NONCE_BYTES)
        self.phase = AWAIT_CHALLENGE
        return HELLO_MAGIC + bytes((PROTOCOL_VERSION,)) + self._client_nonce

    def receive(self, frame: bytes) -> bytes:
        """Take the peer's next handshake frame; the frame to answer with (b"": none)."""
        if self.phase == AWAIT_HELLO:
            return self._on_hello(frame)
        if self.phase == AWAIT_CHALLENGE:
            return self._on_challenge(frame)
        if self.phase == AWAIT_RESPONSE:
            self._on_response(frame)
            return b""
        raise HandshakeRejected("unexpected frame before the connection was established")

    def _mac(self, role: bytes) -> bytes:
        return handshake_mac(self._secret, self._context, role, self._client_nonce,
                             self._server_nonce)

    def _on_hello(self, frame: bytes) -> bytes:
        if len(frame) != HELLO_BYTES or not frame.startswith(HELLO_MAGIC):
            raise HandshakeRejected(f"bad hello ({len(frame)} bytes)")
        if frame[len(HELLO_MAGIC)] != PROTOCOL_VERSION:
            raise HandshakeRejected(f"unsupported protocol version {frame[len(HELLO_MAGIC)]}")
        self._client_nonce = frame[len(HELLO_MAGIC) + 1:]
        self._server_nonce = self._nonce(NONCE_BYTES)
        self.phase = AWAIT_RESPONSE
        return self._server_nonce + self._mac(b"server")

    def _on_challenge(self, frame: bytes) -> bytes:
        if len(frame) != CHALLENGE_BYTES:
            raise HandshakeRejected(f"bad challenge ({len(frame)} bytes)")
        self._server_nonce, mac = frame[:NONCE_BYTES], frame[NONCE_BYTES:]
        if not hmac.compare_digest(mac, self._mac(b"server")):
            raise HandshakeRejected("server failed authentication (wrong secret or context)")
        self.phase = AUTHENTICATED
        return self._mac(b"client")

    def _on_response(self, frame: bytes) -> None:
        if len(frame) != MAC_BYTES or not hmac.compare_digest(frame, self._mac(b"client")):
            raise HandshakeRejected("client failed authentication (wrong secret or context, "
                                    "or a replay)")
        self.phase = AUTHENTICATED
