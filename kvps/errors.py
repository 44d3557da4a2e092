"""The error tree shared by the server and the client.

    KvpsError
    ├── RetryableError        no definitive answer; safe to retry because pushes are deduplicated
    │   ├── Unavailable       no replica answered, or the outcome is unknown (connection lost, leader changed)
    │   │   └── ConnectError  no answer at all: the connection was refused, reset or timed out
    │   ├── Timeout           the caller's deadline passed
    │   ├── NotLeader         this replica is not the leader; ``leader_hint`` names the one it believes in
    │   ├── NoQuorum          the leader cannot reach a majority
    │   └── Overloaded        the leader's in-flight budget is full; back off and retry
    ├── RejectedError         a definitive "no": nothing was changed
    │   ├── VersionConflict   compare-and-set saw another version (``expected``, ``actual``)
    │   ├── KeyNotFound       (alias ``NotFound``)
    │   ├── KeyExists         create of an existing key with a different definition
    │   ├── ShapeMismatch     wrong shape or dtype for the key (``expected``, ``actual``)
    │   ├── Unauthorized      missing or wrong token
    │   ├── InvalidRequest    malformed request, bad argument, NaN/Inf gradient, ...
    │   │   ├── RequestTooLarge  body over the server's cap (HTTP 413)
    │   │   └── NotDrainable     a metadata node, and no node outside the group to take over (HTTP 409)
    │   └── PushExpired       a retried push id older than the server's window (it *was* applied)
    ├── CodecError            corrupt or unknown-format payload
    └── ConfigError           invalid configuration (one message per field)

Retryability comes from the class, never from message text. Every error carries structured
fields and converts to / from a small JSON dict (``to_dict`` / ``from_dict``) so that the
server and the client share one vocabulary over HTTP. This module is pure: no I/O.
"""
from __future__ import annotations

from typing import Any

__all__ = [
    "CodecError",
    "ConfigError",
    "ConnectError",
    "InvalidRequest",
    "KeyExists",
    "KeyNotFound",
    "KvpsError",
    "NoQuorum",
    "NotDrainable",
    "NotFound",
    "NotLeader",
    "Overloaded",
    "PushExpired",
    "RejectedError",
    "RequestTooLarge",
    "RetryableError",
    "ShapeMismatch",
    "Timeout",
    "Unauthorized",
    "Unavailable",
    "VersionConflict",
    "error_from_dict",
]


class KvpsError(Exception):
    """Base of every kvps error. ``fields`` holds structured details (JSON-safe)."""

    http_status = 500

    def __init__(self, message: str = "", **fields: Any) -> None:
        super().__init__(message or type(self).__name__)
        self.message = message or type(self).__name__
        self.fields = fields

    def __getattr__(self, name: str) -> Any:
        # Structured fields read as attributes: err.leader_hint, err.expected, ...
        fields = self.__dict__.get("fields", {})
        if name in fields:
            return fields[name]
        raise AttributeError(name)

    def to_dict(self) -> dict[str, Any]:
        return {"error": type(self).__name__, "message": self.message, "fields": self.fields}

    def __reduce__(self):  # keeps errors picklable across multiprocessing boundaries
        return (_rebuild, (type(self).__name__, self.message, self.fields))


class RetryableError(KvpsError):
    http_status = 503


class Unavailable(RetryableError):
    http_status = 503


class ConnectError(Unavailable):
    """No answer at all from ``fields['url']``: refused, reset, timed out, not resolvable. (A
    request that reached a server and failed there is another error.)"""

    http_status = 503


class Timeout(RetryableError):
    http_status = 504


class NotLeader(RetryableError):
    """``fields['leader_hint']``: the data URL of the believed leader, or None."""

    http_status = 421


class NoQuorum(RetryableError):
    http_status = 503


class Overloaded(RetryableError):
    http_status = 429


class RejectedError(KvpsError):
    http_status = 400


class VersionConflict(RejectedError):
    http_status = 409


class KeyNotFound(RejectedError):
    http_status = 404


NotFound = KeyNotFound


class KeyExists(RejectedError):
    http_status = 409


class ShapeMismatch(RejectedError):
    http_status = 400


class Unauthorized(RejectedError):
    http_status = 401


class InvalidRequest(RejectedError):
    http_status = 400


class RequestTooLarge(InvalidRequest):
    http_status = 413


class NotDrainable(InvalidRequest):
    """``fields['node']`` runs a replica of the metadata group (``fields['meta_nodes']``) and no
    active node outside that group could take the replica over: the drain could never finish."""

    http_status = 409


class PushExpired(RejectedError):
    http_status = 410


class CodecError(KvpsError):
    http_status = 400


class ConfigError(KvpsError):
    http_status = 400


_BY_NAME: dict[str, type[KvpsError]] = {
    cls.__name__: cls
    for cls in (
        KvpsError, RetryableError, Unavailable, ConnectError, Timeout, NotLeader, NoQuorum, Overloaded,
        RejectedError, VersionConflict, KeyNotFound, KeyExists, ShapeMismatch, Unauthorized,
        InvalidRequest, RequestTooLarge, NotDrainable, PushExpired, CodecError, ConfigError,
    )
}


def error_from_dict(data: Any) -> KvpsError:
    """Rebuild an error sent by ``to_dict``. Unknown or malformed input becomes ``Unavailable``."""
    if not isinstance(data, dict):
        return Unavailable(f"malformed error body: {data!r:.200}")
    cls = _BY_NAME.get(str(data.get("error")), Unavailable)
    fields = data.get("fields")
    return cls(str(data.get("message", "")), **(fields if isinstance(fields, dict) else {}))


def _rebuild(name: str, message: str, fields: dict) -> KvpsError:
    return _BY_NAME.get(name, KvpsError)(message, **fields)
