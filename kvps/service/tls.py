"""TLS contexts for client and admin traffic, from the cluster config (wiring layer only)."""
from __future__ import annotations

import ssl
from pathlib import Path

from kvps.config import ClusterConfig

__all__ = ["client_context", "server_context"]


def _path(base: Path, name: str) -> str:
    return str(base / name)


def server_context(cfg: ClusterConfig, base: Path) -> ssl.SSLContext | None:
    if not cfg.tls_cert:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(_path(base, cfg.tls_cert), _path(base, cfg.tls_key))
    return ctx


def client_context(cfg: ClusterConfig, base: Path) -> ssl.SSLContext | None:
    if not cfg.tls_cert:
        return None
    return ssl.create_default_context(cafile=_path(base, cfg.tls_ca or cfg.tls_cert))
