"""ConnectionLimits without a network: the per-peer cap, its release, idle-close accounting."""
from __future__ import annotations

import types

import pytest
from prometheus_client import CollectorRegistry

from kvps.config import ServerConfig
from kvps.errors import ConfigError
from kvps.service.connections import ConnectionLimits


class FakeTransport:
    def __init__(self, ip: str) -> None:
        self.ip, self.written, self.closed = ip, b"", False

    def get_extra_info(self, name: str):
        return (self.ip, 40000) if name == "peername" else None

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True


class FakeServer:
    def __init__(self) -> None:
        self.made, self.lost = [], []

    def connection_made(self, handler, transport) -> None:
        self.made.append(handler)

    def connection_lost(self, handler, exc=None) -> None:
        self.lost.append(handler)


def limits(now: list[float]):
    """(limits, fake server, metric value by name)"""
    registry = CollectorRegistry()
    lim = ConnectionLimits(idle_timeout=5.0, per_peer=2, registry=registry, node=0,
                           server="admin", clock=lambda: now[0])
    server = FakeServer()
    lim.install(types.SimpleNamespace(server=server))
    return lim, server, lambda name: registry.get_sample_value(name, {"node": "0", "server": "admin"})


def test_a_peer_over_the_cap_is_answered_429_and_closed_and_others_are_not_affected():
    now = [0.0]
    lim, server, value = limits(now)
    handlers = [object() for _ in range(4)]
    transports = [FakeTransport("10.0.0.1") for _ in range(3)] + [FakeTransport("10.0.0.2")]
    for h, t in zip(handlers, transports):
        server.connection_made(h, t)
    assert [t.closed for t in transports] == [False, False, True, False]
    assert transports[2].written.startswith(b"HTTP/1.1 429 ") and b'"Overloaded"' in transports[2].written
    assert lim.peers() == {"10.0.0.1": 2, "10.0.0.2": 1} and value("kvps_connections_open") == 3
    assert value("kvps_connections_refused_total") == 1
    server.connection_lost(handlers[2])          # the refused one: nothing to release
    server.connection_lost(handlers[0])          # a held one closes: room for another
    assert lim.peers() == {"10.0.0.1": 1, "10.0.0.2": 1}
    server.connection_made(object(), FakeTransport("10.0.0.1"))
    assert lim.peers()["10.0.0.1"] == 2 and value("kvps_connections_refused_total") == 1


def test_only_connections_silent_for_the_idle_timeout_count_as_closed_idle():
    now = [0.0]
    lim, server, value = limits(now)
    quick, idle = object(), object()
    server.connection_made(quick, FakeTransport("10.0.0.1"))
    server.connection_made(idle, FakeTransport("10.0.0.1"))
    now[0] = 1.0
    server.connection_lost(quick)                # the client closed it early
    now[0] = 5.0
    server.connection_lost(idle)                 # aiohttp's keep-alive timer closed it
    assert value("kvps_connections_idle_closed_total") == 1 and value("kvps_connections_open") == 0 and lim.peers() == {}


@pytest.mark.parametrize("field", ["idle_timeout", "max_connections_per_peer"])
def test_connection_limits_must_be_positive(field):
    with pytest.raises(ConfigError) as err:
        ServerConfig(**{field: 0}).validate()
    assert err.value.fields["field"] == field
