"""The packet-level faults are real: namespaces, nftables drops and the delay proxy, measured with
a TCP echo server in one node namespace and a client in another (skipped without root + nft)."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvps.node.local import wait_until
from kvps.node.process import stop_process
from kvps_chaos import netns
from kvps_chaos.proxy import set_delay

pytestmark = pytest.mark.cluster

SUPPORTED, WHY = netns.netns_support()
ECHO_PORT = 7000  # plays a Raft port

ECHO = """
import socket, threading
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", %d)); s.listen()
def serve(c):
    while (d := c.recv(65536)):
        c.sendall(d)
while True:
    threading.Thread(target=serve, args=(s.accept()[0],), daemon=True).start()
""" % ECHO_PORT

PING = """
import socket, sys, time
try:
    c = socket.create_connection((sys.argv[1], %d), timeout=1.5)
    t = time.monotonic(); c.sendall(b"x"); c.recv(1); print(time.monotonic() - t)
except OSError:
    print("unreachable")
""" % ECHO_PORT


@pytest.fixture
def topo(tmp_path):
    if not SUPPORTED:
        pytest.skip(f"network namespaces unavailable: {WHY}")
    t = netns.Topology(2).create()
    procs = []
    try:
        procs.append(subprocess.Popen(t.exec_args(1, [sys.executable, "-c", ECHO])))
        yield t, procs
    finally:
        for p in procs:
            stop_process(p, timeout=2)
        t.destroy()
        assert not [n for n in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
                    .stdout.split() if n.startswith(t.hub.rsplit("-", 1)[0])]


def rtt(t: netns.Topology) -> float | None:
    """Round trip from node 0 to node 1's echo server, or None when unreachable."""
    out = subprocess.run(t.exec_args(0, [sys.executable, "-c", PING, t.address(1)]),
                         capture_output=True, text=True, timeout=30).stdout.strip()
    return None if out == "unreachable" else float(out)


def test_partition_drops_then_heals(topo):
    t, _ = topo
    wait_until(lambda: rtt(t) is not None, 20, "the echo server")
    t.drop_between(0, [t.address(1)], [ECHO_PORT])
    assert rtt(t) is None
    t.heal(0)
    assert rtt(t) is not None
    t.lose_packets(0, 99)  # numgen mod 100 < 99: all but 1 % (a lost SYN is retried after 1 s)
    assert rtt(t) is None
    t.heal(0)
    assert rtt(t) is not None


def test_delay_proxy_adds_latency_to_redirected_connections(topo, tmp_path):
    t, procs = topo
    control = str(tmp_path / "proxy.sock")
    procs.append(subprocess.Popen(t.exec_args(0, [sys.executable, "-m", "kvps_chaos.proxy", "--port",
                                                  str(netns.PROXY_PORT), "--control", control])))
    t.redirect_raft(0, [t.address(1)], [ECHO_PORT])
    wait_until(lambda: Path(control).exists(), 20, "the proxy")
    wait_until(lambda: rtt(t) is not None, 20, "the echo server through the proxy")
    base = min(rtt(t) for _ in range(3))
    set_delay(control, {t.address(1): (0.15, 0.0)})
    delayed = rtt(t)
    assert delayed is not None and delayed >= 0.25, (base, delayed)  # both directions delayed
    set_delay(control, {})
    started = time.monotonic()
    assert rtt(t) < 0.15 and time.monotonic() - started < 10
