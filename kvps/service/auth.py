"""Bearer tokens and their roles.

The token file holds one accepted token per line, ``TOKEN [ROLE]``: ``read`` (GET routes, pulls,
describe, keys, status), ``write`` (read, plus what a training worker does: pushes, sets, creating
and deleting keys, clock ticks) or ``admin`` (everything: membership, moves, snapshots). A bare
``TOKEN`` line is ``admin``, as every token was before roles existed. Blank lines are skipped. A
process calling another kvps process sends the file's first ``admin`` token.

The file is re-read when it changes, so tokens rotate without downtime: add the new line, move
clients over, then remove the old line. An unreadable, empty or malformed file keeps the tokens
read last (a half-written file never locks everyone out). Comparison is constant-time against
every accepted token.
"""
from __future__ import annotations

import hmac
import logging
import os
import secrets
import time
from pathlib import Path

from kvps.errors import ConfigError, Forbidden, Unauthorized

__all__ = ["ROLES", "TokenStore", "admin_token", "allows", "new_token", "parse_bearer", "parse_tokens",
           "read_tokens"]

log = logging.getLogger("kvps.auth")

ROLES = ("read", "write", "admin")  # each role may do what the ones before it may


def allows(role: str, needs: str) -> bool:
    """Whether a token of ``role`` may call what needs ``needs``."""
    return ROLES.index(role) >= ROLES.index(needs)


def parse_tokens(text: str) -> list[tuple[str, str]]:
    """``[(token, role)]`` in file order; ``ConfigError`` names the first bad line."""
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields:
            continue
        if len(fields) > 2 or (len(fields) == 2 and fields[1] not in ROLES):
            raise ConfigError(f"token file line {number}: expected 'TOKEN [ROLE]' with ROLE one of "
                              f"{', '.join(ROLES)}", line=number)
        out.append((fields[0], fields[1] if len(fields) == 2 else "admin"))
    return out


def new_token() -> str:
    """A fresh token: 192 random bits as hex. Hex because a token that starts with ``-`` (one in 64
    of ``token_urlsafe``'s) reads as an option on a command line: ``kvps status --token -x…`` fails."""
    return secrets.token_hex(24)


def read_tokens(path: Path) -> list[tuple[str, str]]:
    """The ``(token, role)`` pairs of a token file, in order."""
    return parse_tokens(path.read_text())


def admin_token(path: Path) -> str:
    """The token a process sends when it calls another kvps process: the file's first admin one."""
    for token, role in read_tokens(path):
        if role == "admin":
            return token
    raise ConfigError(f"token file {path} holds no admin token (a line 'TOKEN' or 'TOKEN admin'); "
                      f"kvps processes call each other with one")


class TokenStore:
    def __init__(self, path: Path, *, recheck_every: float = 1.0) -> None:
        self.path = path
        self._recheck_every = recheck_every
        self._checked = 0.0
        self._mtime: float | None = None
        self._entries: tuple[tuple[bytes, str], ...] = ()
        self._reload()

    def _reload(self) -> None:
        try:
            st = os.stat(self.path)
            if st.st_mtime_ns != self._mtime:
                entries = tuple((t.encode(), r) for t, r in read_tokens(self.path))
                if entries:  # an empty or half-written file never locks everyone out
                    if self._mtime is not None and entries != self._entries:
                        log.info("token file %s changed: %d token(s) accepted", self.path, len(entries))
                    self._entries = entries
                self._mtime = st.st_mtime_ns
        except (OSError, ConfigError) as exc:
            log.warning("cannot read token file %s: %s (keeping %d token(s))", self.path, exc,
                        len(self._entries))

    def entries(self) -> tuple[tuple[bytes, str], ...]:
        """The accepted ``(token, role)`` pairs, re-read at most every ``recheck_every`` seconds."""
        now = time.monotonic()
        if now - self._checked >= self._recheck_every:
            self._checked = now
            self._reload()
        return self._entries

    def admin_token(self) -> str:
        """The first admin token (what this process sends to others); "" if there is none."""
        return next((t.decode() for t, r in self.entries() if r == "admin"), "")

    def check(self, authorization: str | None, needs: str, what: str = "") -> str:
        """The caller's role; ``Unauthorized`` for a missing or unknown token, ``Forbidden`` for a
        known one whose role is below ``needs``."""
        given = parse_bearer(authorization)
        role = None
        for token, token_role in self.entries():
            if hmac.compare_digest(given, token):  # every token compared: no early exit
                role = role or token_role
        if role is None:
            raise Unauthorized("invalid token")
        if not allows(role, needs):
            raise Forbidden(role, needs, what)
        return role


def parse_bearer(authorization: str | None) -> bytes:
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise Unauthorized("missing bearer token")
    return given.strip().encode()
