"""torchrun's rendezvous on kvps: ``torchrun --rdzv-backend kvps --rdzv-endpoint HOST:PORT``.

torch's dynamic rendezvous (the one behind ``--rdzv-backend c10d``) keeps its state in any
``torch.distributed.Store`` through ``C10dRendezvousBackend``; this handler gives it a
``KvpsStore`` instead of a TCPStore hosted by one of the agents, so the rendezvous state is
replicated by Raft and outlives the loss of any one machine. torchrun finds the handler through
the ``torchrun.handlers`` entry point (pyproject.toml). ``--rdzv-endpoint`` is one or more kvps
admin endpoints (``HOST:PORT`` or URLs, comma-separated); the token comes from
``--rdzv-conf token=...`` or ``$KVPS_TOKEN``.

torch's rendezvous package loads the entry point while it is being imported, so this module
imports it only inside the handler: importing it at the top would be a circular import whenever
this module is imported first (torch then logs the failure and leaves the backend unregistered).
"""
from __future__ import annotations

import atexit
import functools
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

from ._torch_store import KvpsStore

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters

__all__ = ["endpoints_of", "handler_factory", "kvps_rendezvous_handler"]


def endpoints_of(endpoint: str) -> list[str]:
    """``host:port[,host:port...]`` (or URLs) as admin URLs."""
    out = []
    for part in (p.strip() for p in endpoint.split(",")):
        if part:
            out.append(part if "://" in part else "http://" + part)
    return out


@functools.cache
def _backend_type() -> type:
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    class KvpsRendezvousBackend(C10dRendezvousBackend):
        """torch's store-based rendezvous state, under this backend's name (torchrun checks that
        the handler's backend is the one asked for)."""

        @property
        def name(self) -> str:
            return "kvps"
    return KvpsRendezvousBackend


def kvps_rendezvous_handler(params: RendezvousParameters) -> RendezvousHandler:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    store = KvpsStore(endpoints_of(params.endpoint), token=params.config.get("token"),
                      prefix=f"rdzv/{params.run_id}/",
                      timeout=timedelta(seconds=params.get_as_int("store_timeout", 300) or 300))
    atexit.register(store.close)  # the agent never closes its rendezvous store itself
    return create_handler(store, _backend_type()(store, params.run_id), params)


def handler_factory() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The ``torchrun.handlers`` entry point: torch calls it and registers what it returns."""
    return kvps_rendezvous_handler
