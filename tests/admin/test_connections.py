"""Connection limits on the data and admin ports: a per-peer cap and an idle timeout.

300 idle connections from one address (127.0.0.2: loopback answers on all of 127/8) against a
cap of 100: the server holds at most 100 (its descriptors do not grow past that), answers the
rest 429 and closes them, closes the held ones once they have been idle for ``idle_timeout``,
counts all of it in its metrics, and serves a real client from 127.0.0.1 throughout.
"""
from __future__ import annotations

import asyncio
import os
import socket
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import kvps_client as kc
from conftest import module_cluster, wait_for
from kvps.config import ServerConfig

pytestmark = pytest.mark.cluster

# IDLE: long enough that no held connection idles out while the 300 are still being opened on a
# loaded machine (then it would be counted closed, not refused)
CAP, HOSTILE, IDLE = 100, 300, 4.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    server = ServerConfig(idle_timeout=IDLE, max_connections_per_peer=CAP)
    yield from module_cluster(tmp_path_factory, "conns", nodes=1, shards=1, replicas=1, server=server)


def metric(cluster, name: str, server: str) -> float:
    with urllib.request.urlopen(cluster.endpoints[0] + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and s.labels.get("server") == server)


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def open_idle(host: str, port: int, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.2", 0))
        s.connect((host, port))
        s.setblocking(False)
        socks.append(s)
    return socks


def closed_by_server(s: socket.socket, got: dict) -> bool:
    try:
        while data := s.recv(4096):
            got[s] = got.get(s, b"") + data
        return True  # EOF
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def real_client_works(cluster, tag: str) -> bool:
    async def main():
        async with kc.Client(cluster.endpoints, token=cluster.token, seed=0, timeout=20) as ps:
            await ps.create(f"conn/{tag}", np.zeros(4, np.float32))
            await ps.push({f"conn/{tag}": np.ones(4, np.float32)})
            return (await ps.pull(f"conn/{tag}"))[f"conn/{tag}"]
    return bool(np.all(asyncio.run(main()) == 1))


@pytest.mark.parametrize("server", ["admin", "shard-0"])
def test_idle_connections_are_capped_per_peer_and_closed_when_idle(cluster, server):
    leader = wait_for(lambda: cluster.leader(0), 30, "a leader")
    if server == "admin":
        host, port, pid = "127.0.0.1", cluster.cfg.node(0).admin_port, cluster.procs[0].pid
    else:
        host, port, pid = "127.0.0.1", cluster.cfg.node(0).data_port(0), leader["pid"]
    refused0 = metric(cluster, "kvps_connections_refused_total", server)
    idle0 = metric(cluster, "kvps_connections_idle_closed_total", server)
    fds0 = fds(pid)
    socks = open_idle(host, port, HOSTILE)
    got: dict[socket.socket, bytes] = {}
    try:
        # everything over the cap is answered 429 Overloaded and closed at once
        wait_for(lambda: sum(closed_by_server(s, got) for s in socks) >= HOSTILE - CAP, 10,
                 f"{HOSTILE - CAP} connections over the cap refused")
        wait_for(lambda: metric(cluster, "kvps_connections_refused_total", server) - refused0 >= HOSTILE - CAP,
                 10, "the refusals counted")
        refusals = [d for d in got.values() if d]
        assert refusals and all(d.startswith(b"HTTP/1.1 429 ") and b'"Overloaded"' in d for d in refusals)
        assert fds(pid) - fds0 <= CAP + 10  # the held ones, and a few of the server's own
        assert metric(cluster, "kvps_connections_open", server) <= CAP + 10
        assert real_client_works(cluster, f"{server}-during")  # from 127.0.0.1: not capped
        # the held ones are closed once idle for IDLE seconds, and counted
        wait_for(lambda: all(closed_by_server(s, got) for s in socks), IDLE + 10,
                 "every idle connection closed by the server")
        wait_for(lambda: metric(cluster, "kvps_connections_idle_closed_total", server) - idle0 >= CAP,
                 10, "idle closes counted")
        wait_for(lambda: fds(pid) <= fds0 + 5, 10, "descriptors back to where they were")
    finally:
        for s in socks:
            s.close()
    assert real_client_works(cluster, f"{server}-after")
