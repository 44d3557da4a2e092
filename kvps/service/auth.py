"""Bearer tokens: the accepted set lives in a file (one token per line) and is re-read when the
file changes, so tokens rotate without downtime: add the new line, move clients over, then remove
the old line. Comparison is constant-time against every accepted token."""
from __future__ import annotations

import hmac
import logging
import os
import time
from pathlib import Path

from kvps.errors import Unauthorized

__all__ = ["TokenStore", "parse_bearer", "read_tokens"]

log = logging.getLogger("kvps.auth")


class TokenStore:
    def __init__(self, path: Path, *, recheck_every: float = 1.0) -> None:
        self.path = path
        self._recheck_every = recheck_every
        self._checked = 0.0
        self._mtime: float | None = None
        self._tokens: tuple[bytes, ...] = ()
        self._reload()

    def _reload(self) -> None:
        try:
            st = os.stat(self.path)
            if st.st_mtime_ns != self._mtime:
                lines = self.path.read_text().splitlines()
                tokens = tuple(line.strip().encode() for line in lines if line.strip())
                if tokens:  # an empty or half-written file never locks everyone out
                    if self._mtime is not None and tokens != self._tokens:
                        log.info("token file %s changed: %d token(s) accepted", self.path, len(tokens))
                    self._tokens = tokens
                self._mtime = st.st_mtime_ns
        except OSError as exc:
            log.warning("cannot read token file %s: %s (keeping %d token(s))", self.path, exc,
                        len(self._tokens))

    def tokens(self) -> tuple[bytes, ...]:
        now = time.monotonic()
        if now - self._checked >= self._recheck_every:
            self._checked = now
            self._reload()
        return self._tokens

    def check(self, authorization: str | None) -> None:
        given = parse_bearer(authorization)
        ok = False
        for token in self.tokens():
            ok |= hmac.compare_digest(given, token)
        if not ok:
            raise Unauthorized("invalid token")


def parse_bearer(authorization: str | None) -> bytes:
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise Unauthorized("missing bearer token")
    return given.strip().encode()


def read_tokens(path: Path) -> list[str]:
    """The tokens in a token file, in order (the first is the one a process sends itself)."""
    return [line.strip() for line in path.read_text().splitlines() if line.strip()]
