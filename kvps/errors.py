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
    │   ├── VersionNotIssued  a follower read's ``min_version`` that no shard of the key has issued
    │   ├── KeyNotFound       (alias ``NotFound``)
    │   ├── KeyExists         create of an existing key with a different definition
    │   ├── ShapeMismatch     wrong shape or dtype for the key (``expected``, ``actual``)
    │   ├── Unauthorized      missing or wrong token
    │   ├── Forbidden         a valid token whose role is too small (``role``, ``needs``)
    │   ├── InvalidRequest    malformed request, bad argument, NaN/Inf gradient, ...
    │   │   ├── RequestTooLarge  body over the server's cap (HTTP 413)
    │   │   ├── NotDrainable     a metadata node, and no node outside the group to take over (HTTP 409)
    │   │   └── RingUnavailable  the node cannot read the sender's push ring; send the body inline
    │   ├── PushExpired       a retried push id older than the server's window (it *was* applied)
    │   └── CapacityExceeded  a push would take a replica's rows past its memory_limit
    ├── CodecError            corrupt or unknown-format payload
    └── ConfigError           invalid configuration (one message per field)

Retryability comes from the class, never from message text. Every error carries structured
fields and converts to / from a small JSON dict (``to_dict`` / ``error_from_dict``) so that the
server and the client share one vocabulary over HTTP. Errors whose situation is fully described
by their fields take those fields in the constructor and derive the message from them
(``VersionConflict(key, expected, actual)``); the others take a message. ``restore`` rebuilds any
error from its message and fields as sent. This module is pure: no I/O.
"""
from __future__ import annotations

from typing import Any

__all__ = [
    "CapacityExceeded",
    "CodecError",
    "ConfigError",
    "ConnectError",
    "Forbidden",
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
    "RingUnavailable",
    "ShapeMismatch",
    "Timeout",
    "Unauthorized",
    "Unavailable",
    "VersionConflict",
    "VersionNotIssued",
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

    @classmethod
    def restore(cls, message: str, fields: dict[str, Any]) -> "KvpsError":
        """The error as sent (``to_dict``): its message kept, whatever its constructor takes."""
        err = cls.__new__(cls)
        KvpsError.__init__(err, message, **fields)
        return err

    def __reduce__(self):  # keeps errors picklable across multiprocessing boundaries
        return (_rebuild, (type(self).__name__, self.message, self.fields))


class RetryableError(KvpsError):
    http_status = 503


class Unavailable(RetryableError):
    http_status = 503


class ConnectError(Unavailable):
    """No answer at all from ``url``: refused, reset, timed out, not resolvable. (A request that
    reached a server and failed there is another error.)"""

    http_status = 503

    def __init__(self, url: str, reason: str, **fields: Any) -> None:
        super().__init__(f"cannot reach {url}: {reason}", url=url, reason=reason, **fields)


class Timeout(RetryableError):
    http_status = 504


class NotLeader(RetryableError):
    """``leader_hint``: the data URL of the leader ``replica`` believes in, or None."""

    http_status = 421

    def __init__(self, shard: int | None, leader_hint: str | None, replica: str = "", **fields: Any) -> None:
        who = f"replica {replica} of shard {shard}" if replica else f"this replica of shard {shard}"
        super().__init__(f"{who} is not the leader" + (f"; try {leader_hint}" if leader_hint else ""),
                         shard=shard, leader_hint=leader_hint, replica=replica, **fields)


class NoQuorum(RetryableError):
    """The leader of ``shard`` is connected to ``connected`` of its ``members`` (itself
    included), fewer than a majority: nothing it proposes can commit until that heals or a new
    leader is elected elsewhere."""

    http_status = 503

    def __init__(self, shard: int | None, connected: int, members: int, **fields: Any) -> None:
        super().__init__(f"the leader of shard {shard} reaches {connected} of its {members} members, "
                         f"not a majority", shard=shard, connected=connected, members=members, **fields)


class Overloaded(RetryableError):
    http_status = 429


class RejectedError(KvpsError):
    http_status = 400


class VersionConflict(RejectedError):
    """A compare-and-set found ``key`` (``block``, if one) at version ``actual``, not ``expected``."""

    http_status = 409

    def __init__(self, key: str, expected: int | None, actual: int | None, *,
                 block: int | None = None, **fields: Any) -> None:
        where = f"{key!r}" + (f" block {block}" if block is not None else "")
        super().__init__(f"{where} is at version {actual}, expected {expected}", key=key,
                         block=block, expected=expected, actual=actual, **fields)


class VersionNotIssued(RejectedError):
    """A follower read of ``key`` asked for ``min_version``, which no shard of the key has issued
    (the highest any shard's leader holds is ``latest``): a replica would wait for it forever."""

    http_status = 409

    def __init__(self, key: str, min_version: int, latest: int, **fields: Any) -> None:
        super().__init__(f"{key!r} has no version {min_version} on any shard (the latest is {latest}); "
                         f"min_version must be a version a push or set returned", key=key,
                         min_version=min_version, latest=latest, **fields)


class KeyNotFound(RejectedError):
    http_status = 404


NotFound = KeyNotFound


class KeyExists(RejectedError):
    http_status = 409


class ShapeMismatch(RejectedError):
    """A value or gradient for ``key`` (``block``, if one) is ``actual`` ({"shape", "dtype"}),
    not ``expected``."""

    http_status = 400

    def __init__(self, key: str, expected: dict, actual: dict, *, block: int | None = None,
                 **fields: Any) -> None:
        def spec(d: dict) -> str:
            return f"{d.get('dtype')}{list(d.get('shape', []))}"
        where = f"{key!r}" + (f" block {block}" if block is not None else "")
        super().__init__(f"{where} is {spec(expected)}, got {spec(actual)}", key=key, block=block,
                         expected=expected, actual=actual, **fields)


class Unauthorized(RejectedError):
    http_status = 401


class Forbidden(RejectedError):
    """A valid token of role ``role`` asked for something that needs role ``needs`` (roles:
    ``read`` < ``write`` < ``admin``, ``kvps.service.auth``); ``what`` names the route or op."""

    http_status = 403

    def __init__(self, role: str, needs: str, what: str = "", **fields: Any) -> None:
        super().__init__(f"a {role!r} token may not {what or 'do this'}: it needs the {needs!r} role",
                         role=role, needs=needs, what=what, **fields)


class InvalidRequest(RejectedError):
    http_status = 400


class RequestTooLarge(InvalidRequest):
    http_status = 413


class NotDrainable(InvalidRequest):
    """``fields['node']`` runs a replica of the metadata group (``fields['meta_nodes']``) and no
    active node outside that group could take the replica over: the drain could never finish."""

    http_status = 409


class RingUnavailable(InvalidRequest):
    """The node cannot read the shared-memory ring a request's descriptor names (another host,
    PID namespace or user, or a ring that is not the sender's: ``kvps.delta.ring``). Nothing was
    read or changed; the client sends that node its bodies inline from then on."""


class PushExpired(RejectedError):
    """Push ``seq`` of ``client`` is below the shard's applied window (``floor``): it *was*
    applied, and its result is no longer kept."""

    http_status = 410

    def __init__(self, client: str, seq: int, floor: int, **fields: Any) -> None:
        super().__init__(f"push {seq} of client {client!r} is below the applied window (floor "
                         f"{floor}); it was applied", client=client, seq=seq, floor=floor, **fields)


class CapacityExceeded(RejectedError):
    """A push to ``key`` would take the shard's rows to ``needed`` bytes, past ``limit`` (the
    server's ``memory_limit``); nothing was changed."""

    http_status = 507

    def __init__(self, key: str, limit: int, needed: int, **fields: Any) -> None:
        super().__init__(f"a push to {key!r} needs {needed} bytes of rows, past the memory limit "
                         f"of {limit}", key=key, limit=limit, needed=needed, **fields)


class CodecError(KvpsError):
    http_status = 400


class ConfigError(KvpsError):
    http_status = 400


_BY_NAME: dict[str, type[KvpsError]] = {
    cls.__name__: cls
    for cls in (
        KvpsError, RetryableError, Unavailable, ConnectError, Timeout, NotLeader, NoQuorum, Overloaded,
        RejectedError, VersionConflict, VersionNotIssued, KeyNotFound, KeyExists, ShapeMismatch,
        Unauthorized, Forbidden, InvalidRequest, RequestTooLarge, NotDrainable, RingUnavailable, PushExpired,
        CapacityExceeded, CodecError, ConfigError,
    )
}


def error_from_dict(data: Any) -> KvpsError:
    """Rebuild an error sent by ``to_dict``. Unknown or malformed input becomes ``Unavailable``."""
    if not isinstance(data, dict):
        return Unavailable(f"malformed error body: {data!r:.200}")
    cls = _BY_NAME.get(str(data.get("error")), Unavailable)
    fields = data.get("fields")
    return cls.restore(str(data.get("message", "")), fields if isinstance(fields, dict) else {})


def _rebuild(name: str, message: str, fields: dict) -> KvpsError:
    return _BY_NAME.get(name, KvpsError).restore(message, fields)
