"""The data plane's binary connection: the framing around ``frame`` bodies on a node's wire port.

One TCP (or TLS) connection per client and node carries requests to every replica the node hosts,
pipelined: a client writes requests without waiting, each with an id, and the node answers each
as soon as it is done, in any order. All little-endian::

    hello     '<4sBH'  magic b'KVPW', version (1), token_len (u16) ; token (UTF-8)   once, first
    request   '<IQHBB' body_len (u32), request id (u64, > 0), shard (u16), op_len (u8),
                       tag_len (u8) ; op (ASCII: a-z and _) ; tag ; body (a request frame,
                       body_len bytes). The tag is the caller's name for the request (what HTTP
                       sends as X-Request-Id: up to 64 of A-Z a-z 0-9 . _ -), which the node
                       logs with a refusal and the client's error carries; may be empty.
    response  '<IQH'   body_len (u32), request id (u64), status (u16) ;
                       body (a response frame when status is 200, else the error as JSON:
                       {"error": ClassName, "message", "fields"}, as the HTTP data plane answers)

A request body may instead be a push-ring descriptor (``kvps.delta.ring``: 48 bytes beginning
``KVPR``) from a client on the node's host: the node copies the body it names out of the client's
ring and serves that as the request's body; ``RingUnavailable`` when it cannot read the ring.

The node answers the hello with response id 0: status 200 and ``{}``, or the error (401 for an
unknown token) after which it closes the connection. It also closes a connection after a request
it cannot skip (a body longer than its limit, a malformed header), having answered it when it
could. Nothing here is ever unpickled; the token is checked again for every request's role.

Pure core: no I/O.
"""
from __future__ import annotations

import struct

from kvps.errors import InvalidRequest, RequestTooLarge

__all__ = ["HELLO", "MAGIC", "MAX_OP", "MAX_TAG", "MAX_TOKEN", "REQUEST", "RESPONSE", "VERSION",
           "encode_hello", "parse_hello", "parse_request", "request_head", "response_head", "split_names"]

MAGIC = b"KVPW"
VERSION = 1
HELLO = struct.Struct("<4sBH")
REQUEST = struct.Struct("<IQHBB")
RESPONSE = struct.Struct("<IQH")
MAX_TOKEN = 4096
MAX_OP = 32
MAX_TAG = 64
_OP_BYTES = frozenset(b"abcdefghijklmnopqrstuvwxyz_")
_TAG_BYTES = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")


def encode_hello(token: str) -> bytes:
    raw = token.encode()
    if len(raw) > MAX_TOKEN:
        raise InvalidRequest(f"token longer than {MAX_TOKEN} bytes")
    return HELLO.pack(MAGIC, VERSION, len(raw)) + raw


def parse_hello(head: bytes | memoryview) -> int:
    """The token's length after a hello's fixed part; ``InvalidRequest`` for anything else."""
    magic, version, token_len = HELLO.unpack(head)
    if magic != MAGIC:
        raise InvalidRequest("not a kvps wire connection (bad magic)")
    if version != VERSION:
        raise InvalidRequest(f"wire version {version} is not supported (this node speaks {VERSION})",
                             version=version)
    if token_len > MAX_TOKEN:
        raise InvalidRequest(f"token longer than {MAX_TOKEN} bytes")
    return token_len


def request_head(body_len: int, request_id: int, shard: int, op: str, tag: str = "") -> bytes:
    """A request's head; a ``tag`` that is not a sane name is left out (sent empty)."""
    raw_op = op.encode("ascii")
    raw_tag = tag.encode("ascii", "replace")
    if len(raw_tag) > MAX_TAG or not all(b in _TAG_BYTES for b in raw_tag):
        raw_tag = b""
    return REQUEST.pack(body_len, request_id, shard, len(raw_op), len(raw_tag)) + raw_op + raw_tag


def parse_request(head: bytes | memoryview, max_body: int) -> tuple[int, int, int, int, int]:
    """``(body_len, request_id, shard, op_len, tag_len)`` of a request's fixed part, checked."""
    body_len, request_id, shard, op_len, tag_len = REQUEST.unpack(head)
    if request_id == 0 or not 1 <= op_len <= MAX_OP or tag_len > MAX_TAG:
        raise InvalidRequest("malformed wire request header")
    if body_len > max_body:
        raise RequestTooLarge("request body too large", limit=max_body, size=body_len)
    return body_len, request_id, shard, op_len, tag_len


def split_names(raw: bytes | memoryview, op_len: int) -> tuple[str, str]:
    """``(op, tag)`` from the bytes after a request's fixed part; ``InvalidRequest`` unless the
    op is a-z and _ and the tag (possibly empty) A-Z a-z 0-9 . _ -."""
    raw = bytes(raw)
    op, tag = raw[:op_len], raw[op_len:]
    if not all(b in _OP_BYTES for b in op) or not all(b in _TAG_BYTES for b in tag):
        raise InvalidRequest("malformed operation name or request tag")
    return op.decode("ascii"), tag.decode("ascii")


def response_head(body_len: int, request_id: int, status: int) -> bytes:
    return RESPONSE.pack(body_len, request_id, status)
