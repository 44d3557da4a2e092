"""The applied table: which push ids a shard has applied, and what it answered (exactly-once).

``{client: Session(floor, results: {seq: result}, seen)}``. A push id found here is a duplicate
and gets its stored result; one below its client's ``floor`` was applied long ago and gets
``PushExpired``. ``floor`` only grows (the client promises it no longer waits for anything below),
results are capped per client, and sessions idle longer than ``ttl`` — by the cluster time
carried in the commands, never a local clock — are forgotten. Part of the replicated state: it is
in every snapshot, in a deterministic order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

from kvps.errors import KvpsError, PushExpired, error_from_dict

__all__ = ["AppliedTable", "MAX_RESULTS_PER_CLIENT", "Result", "Session"]

MAX_RESULTS_PER_CLIENT = 10000  # bounds memory per client; beyond it the floor is raised
Result = Union[dict, KvpsError]  # {"versions": {key: int}} or the error the push got


@dataclass
class Session:
    floor: int
    seen: float
    results: dict[int, Result] = field(default_factory=dict)


class AppliedTable:
    def __init__(self, ttl: float, cap: int = MAX_RESULTS_PER_CLIENT) -> None:
        self.ttl = ttl
        self.cap = cap
        self.sessions: dict[str, Session] = {}

    def lookup(self, client: str, seq: int) -> Result | None:
        """The stored result of (client, seq), ``PushExpired`` below the floor, else None."""
        session = self.sessions.get(client)
        if session is None:
            return None
        if seq < session.floor:
            return PushExpired(client, seq, session.floor)
        result = session.results.get(seq)
        if isinstance(result, dict):  # callers may mutate what they get; the table must not change
            return {k: dict(v) if isinstance(v, dict) else v for k, v in result.items()}
        return result

    def record(self, entries: list[tuple[str, int, int, Result]], now: float) -> None:
        """Store ``(client, seq, floor, result)`` for each id of one applied entry, then raise
        floors, trim, and expire idle sessions. Order-independent within the entry."""
        touched: dict[str, Session] = {}
        for client, seq, _, result in entries:
            session = self.sessions.get(client)
            if session is None:
                session = self.sessions[client] = Session(floor=0, seen=now)
            session.results[seq] = result
            touched[client] = session
        for client, _, floor, _ in entries:
            session = touched[client]
            session.floor = max(session.floor, floor)
        for session in touched.values():
            session.seen = max(session.seen, now)  # leader clocks may step back across failover
            self._trim(session)
        self.expire(now)

    def _trim(self, session: Session) -> None:
        stale = [seq for seq in session.results if seq < session.floor]
        for seq in stale:
            del session.results[seq]
        excess = len(session.results) - self.cap
        if excess > 0:
            dropped = sorted(session.results)[:excess]
            for seq in dropped:
                del session.results[seq]
            session.floor = max(session.floor, dropped[-1] + 1)

    def expire(self, now: float) -> None:
        limit = now - self.ttl
        for client in [c for c, s in self.sessions.items() if s.seen < limit]:
            del self.sessions[client]

    # ---- snapshot form (JSON-safe, deterministic order) -----------------------------------------

    def to_json(self) -> list:
        return [[client, s.floor, s.seen, [[seq, _result_to_json(s.results[seq])] for seq in sorted(s.results)]]
                for client, s in sorted(self.sessions.items())]

    def load_json(self, data: Any) -> None:
        """Replace the table with ``data`` from ``to_json`` (raises KeyError/TypeError/ValueError
        on malformed input; the caller turns those into ``CodecError``)."""
        sessions: dict[str, Session] = {}
        for client, floor, seen, results in data:
            if not isinstance(client, str) or not isinstance(floor, int) or not isinstance(seen, (int, float)):
                raise TypeError("malformed session")
            sessions[client] = Session(floor=floor, seen=float(seen),
                                       results={int(seq): _result_from_json(r) for seq, r in results})
        self.sessions = sessions


def _result_to_json(result: Result) -> dict:
    return result.to_dict() if isinstance(result, KvpsError) else result


def _result_from_json(data: Any) -> Result:
    if not isinstance(data, dict):
        raise TypeError("malformed result")
    if "error" in data:
        return error_from_dict(data)
    versions = data["versions"]
    if not isinstance(versions, dict) or not all(isinstance(v, int) for v in versions.values()):
        raise TypeError("malformed versions")
    digest = data.get("digest", 0)
    if not isinstance(digest, int) or isinstance(digest, bool):
        raise TypeError("malformed digest")
    return {"versions": dict(versions), **({"digest": digest} if digest else {})}
