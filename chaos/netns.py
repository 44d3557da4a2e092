"""Network namespaces for chaos runs: one per node, with its own address, plus a hub.

Layout (everything lives in namespaces this run created; nothing is added to the host's own
network namespace, and no packet can leave the machine)::

    hub namespace:   bridge br0 10.250.0.254/24   (the harness, its clients and training workers)
       |-- veth --   node namespace n0: eth0 10.250.0.1/24   (kvps node 0 and its replicas)
       |-- veth --   node namespace n1: eth0 10.250.0.2/24
       ...
       |-- veth --   node namespace n3: eth0 10.250.0.4/24   (added mid-run: a node that joins)

Faults are nftables rules inside a node's namespace (table ``inet kvpschaos``: chains ``input`` and
``output``), so they touch nothing outside the run. Healing flushes both chains (one fault at a
time). A transparent redirect (table ``ip kvpschaos_nat``) sends every outgoing Raft connection
through the node's delay proxy (``kvps_chaos.proxy``), so the cluster config stays the single source
of truth: nodes dial the addresses in ``cluster.toml``, the kernel hands the connection to the proxy.

Names carry the pid of the process that made them, so a run killed with ``kill -9`` leaves
namespaces that the next run removes (``remove_stale``), with their ``/etc/netns`` files.

Names can be given addresses (``set_hosts``: an ``/etc/hosts`` per namespace, which ``ip netns exec``
bind-mounts over the real one), so processes started with ``exec_args`` reach each other by name, as
Kubernetes pods reach each other by their DNS names.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

__all__ = ["PROXY_MARK", "PROXY_PORT", "Topology", "netns_support", "remove_stale"]

PREFIX = "kvpsc"
SUBNET = "10.250.0"          # private to this run's namespaces: they are not linked to the host
PROXY_PORT = 6999            # the delay proxy's port on 127.0.0.1 inside each node namespace
PROXY_MARK = 0x4B5053        # socket mark on the proxy's own upstream connections (not redirected)
_CLONE_NEWNET = 0x40000000
ETC_NETNS = Path("/etc/netns")  # ip netns exec bind-mounts /etc/netns/<name>/* over /etc/*
_libc = ctypes.CDLL(None, use_errno=True)


def netns_support() -> tuple[bool, str]:
    """(usable, why not): namespaces need root, iproute2 and nftables, and a sandbox may still
    refuse them, so a throw-away namespace is made and given an nftables table."""
    if os.geteuid() != 0:
        return False, "not root"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            return False, f"{tool} not installed (apt-get install -y iproute2 nftables)"
    probe = f"{PREFIX}{os.getpid()}-n99"
    made = _run(["ip", "netns", "add", probe], check=False)
    if made.returncode != 0:
        return False, f"ip netns add failed: {made.stderr.strip()}"
    try:
        nft = _run(["ip", "netns", "exec", probe, "nft", "-f", "-"], stdin=_BASE_RULES, check=False)
        if nft.returncode != 0:
            return False, f"nft failed inside a namespace: {nft.stderr.strip()}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return True, ""


def _run(args: Sequence[str], stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(list(args), input=stdin, capture_output=True, text=True, timeout=30)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({res.returncode}): {res.stderr.strip()}")
    return res


def _namespaces() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def remove_stale() -> list[str]:
    """Delete namespaces left by chaos runs whose process is gone."""
    removed = []
    for name in _namespaces():
        m = re.fullmatch(PREFIX + r"(\d+)-(hub|n\d+)", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _run(["ip", "netns", "del", name], check=False)
            removed.append(name)
    for path in ETC_NETNS.glob(f"{PREFIX}*-*") if ETC_NETNS.is_dir() else ():
        m = re.fullmatch(PREFIX + r"(\d+)-(hub|n\d+)", path.name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            shutil.rmtree(path, ignore_errors=True)
    return removed


def _setns(fd: int) -> None:
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


class Topology:
    def __init__(self, nodes: int, *, run_id: int | None = None) -> None:
        self.nodes = nodes
        self.run_id = os.getpid() if run_id is None else run_id
        self.hub = f"{PREFIX}{self.run_id}-hub"
        self.created: list[str] = []
        self.hosts: str | None = None  # /etc/hosts inside every namespace of the run (set_hosts)

    def ns(self, node: int) -> str:
        return f"{PREFIX}{self.run_id}-n{node}"

    @staticmethod
    def address(node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    hub_address = f"{SUBNET}.254"

    # ---- lifecycle -------------------------------------------------------------------------

    def create(self) -> "Topology":
        try:
            self._add_ns(self.hub)
            ip = ["ip", "-n", self.hub]
            _run([*ip, "link", "add", "br0", "type", "bridge"])
            _run([*ip, "addr", "add", f"{self.hub_address}/24", "dev", "br0"])
            for dev in ("lo", "br0"):
                _run([*ip, "link", "set", dev, "up"])
            for n in range(self.nodes):
                self._add_node(n)
        except BaseException:
            self.destroy()
            raise
        return self

    def _add_ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self.created.append(name)
        if self.hosts is not None:
            self._write_hosts(name)

    def set_hosts(self, names: Mapping[str, str]) -> None:
        """Resolve ``names`` (name -> address) in every namespace of this run, and in those added
        later: processes started with ``ip netns exec`` see ``/etc/netns/<namespace>/hosts`` as
        their ``/etc/hosts``. The files go with their namespaces."""
        self.hosts = "127.0.0.1 localhost\n" + "".join(f"{addr} {name}\n" for name, addr in names.items())
        for name in self.created:
            self._write_hosts(name)

    def _write_hosts(self, name: str) -> None:
        (ETC_NETNS / name).mkdir(parents=True, exist_ok=True)
        (ETC_NETNS / name / "hosts").write_text(self.hosts or "")

    @staticmethod
    def _del_ns(name: str) -> None:
        _run(["ip", "netns", "del", name], check=False)
        shutil.rmtree(ETC_NETNS / name, ignore_errors=True)

    def add_node(self, n: int) -> str:
        """A namespace for a node that joins mid-run (veth on the hub's bridge, nftables table);
        its address. Undone by ``remove_node`` (and by ``destroy``)."""
        if self.ns(n) in self.created:
            raise RuntimeError(f"node {n} already has a namespace ({self.ns(n)})")
        try:
            self._add_node(n)
        except BaseException:
            self.remove_node(n)
            raise
        return self.address(n)

    def remove_node(self, n: int) -> None:
        """Delete a node's namespace; its veth pair goes with it. The caller stops the node's
        processes first (a namespace lives on while a process is inside it)."""
        ns = self.ns(n)
        if ns in self.created:
            self._del_ns(ns)
            self.created.remove(ns)

    def _add_node(self, n: int) -> None:
        if not 0 <= n < 253:
            raise ValueError(f"node {n}: a /24 has addresses for nodes 0-252 only")
        ns = self.ns(n)
        self._add_ns(ns)
        # Both ends are created directly inside their namespaces: nothing appears on the host.
        _run(["ip", "link", "add", "name", "eth0", "netns", ns, "type", "veth",
              "peer", "name", f"p{n}", "netns", self.hub])
        _run(["ip", "-n", self.hub, "link", "set", f"p{n}", "master", "br0"])
        _run(["ip", "-n", self.hub, "link", "set", f"p{n}", "up"])
        _run(["ip", "-n", ns, "addr", "add", f"{self.address(n)}/24", "dev", "eth0"])
        for dev in ("lo", "eth0"):
            _run(["ip", "-n", ns, "link", "set", dev, "up"])
        self.nft(n, _BASE_RULES)

    def destroy(self) -> None:
        for name in reversed(self.created):
            self._del_ns(name)
        self.created.clear()
        with contextlib.suppress(OSError):  # only if empty: no other namespace has files there
            ETC_NETNS.rmdir()

    def __enter__(self) -> "Topology":
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """Run the calling thread (and the threads and processes it starts) in the hub namespace."""
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(f"/var/run/netns/{self.hub}", os.O_RDONLY)
        try:
            _setns(target)
            try:
                yield
            finally:
                _setns(home)
        finally:
            os.close(home)
            os.close(target)

    # ---- commands inside a node ------------------------------------------------------------

    def exec_args(self, node: int, args: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns(node), *args]

    def nft(self, node: int, script: str) -> None:
        _run(self.exec_args(node, ["nft", "-f", "-"]), stdin=script)

    def redirect_raft(self, node: int, peers: Sequence[str], raft_ports: Sequence[int]) -> None:
        """Send this node's outgoing Raft connections through its delay proxy."""
        self.nft(node, f"""
            table ip kvpschaos_nat {{
              chain output {{
                type nat hook output priority -100; policy accept;
                meta mark != {PROXY_MARK:#x} ip daddr {{ {", ".join(peers)} }} \
                  tcp dport {{ {", ".join(map(str, raft_ports))} }} redirect to :{PROXY_PORT}
              }}
            }}""")

    def drop_between(self, node: int, peers: Sequence[str], ports: Sequence[int] | None) -> None:
        """Drop every packet between ``node`` and ``peers`` (on ``ports`` only, if given)."""
        rules = []
        for chain, iface, addr in (("input", "iifname", "saddr"), ("output", "oifname", "daddr")):
            match = f'{iface} "eth0" ip {addr} {{ {", ".join(peers)} }}'
            if ports is None:
                rules.append(f"add rule inet kvpschaos {chain} {match} drop")
            else:
                plist = ", ".join(map(str, ports))
                rules += [f"add rule inet kvpschaos {chain} {match} tcp dport {{ {plist} }} drop",
                          f"add rule inet kvpschaos {chain} {match} tcp sport {{ {plist} }} drop"]
        self.nft(node, "\n".join(rules) + "\n")

    def lose_packets(self, node: int, percent: int) -> None:
        """Drop ``percent`` % of the packets through the node's interface, both ways."""
        self.nft(node, "".join(
            f'add rule inet kvpschaos {chain} {iface} "eth0" numgen random mod 100 < {percent} drop\n'
            for chain, iface in (("input", "iifname"), ("output", "oifname"))))

    def heal(self, node: int) -> None:
        self.nft(node, "flush chain inet kvpschaos input\nflush chain inet kvpschaos output\n")

    def rules(self, node: int) -> str:
        return _run(self.exec_args(node, ["nft", "list", "table", "inet", "kvpschaos"])).stdout


_BASE_RULES = """
table inet kvpschaos {
  chain input { type filter hook input priority 0; policy accept; }
  chain output { type filter hook output priority 0; policy accept; }
}
"""
