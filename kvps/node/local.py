"""A local cluster of node processes on 127.0.0.1: used by ``kvps up``, the demo, tests and benchmarks.

``LocalCluster`` writes ``cluster.toml``, ``secret`` and ``token`` (one bare line: an admin token,
``kvps.service.auth``) into its data dir (reusing existing ones, so a restart keeps its data), starts one ``kvps node`` process per node in its own process
group, and stops every process it started — also when the caller fails (use it as a context manager).
"""
from __future__ import annotations

import os
import secrets
import signal
import socket
import ssl
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvps.config import ClusterConfig, NodeConfig, RaftConfig, ServerConfig, dump_cluster
from kvps.errors import KvpsError, Unavailable
from kvps.service.auth import admin_token, new_token
from kvps.service.http import request_json, rpc
from kvps.node.process import python_module_args, spawn, stop_process

__all__ = [
    "LocalCluster", "free_port_base", "make_config", "ports_free", "ports_needed", "wait_until",
]


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, period: float = 0.05) -> Any:
    """Poll ``predicate`` until it returns a truthy value or ``timeout`` passes (then raise)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.1f}s waiting for {what}")
        time.sleep(period)


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def ports_free(base: int, count: int) -> bool:
    """Whether ports ``base`` .. ``base + count - 1`` are all free right now."""
    return all(_port_free(p) for p in range(base, base + count))


def _ephemeral_low() -> int:
    """The first port the kernel hands out to outgoing connections (Linux; 32768 elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_base(count: int, *, seed: int | None = None) -> int:
    """A base port such that ``count`` consecutive ports are free right now.

    Below the ephemeral range when it leaves room: a port a replica gives up (its replica moved
    away) can otherwise become the local port of some process's long-lived outgoing connection,
    and the replica that moves back to it cannot bind for as long as that connection lives (seen
    in tests/cluster/test_elastic.py, a replica retrying its bind for minutes)."""
    import random
    rng = random.Random(seed if seed is not None else os.getpid() ^ time.monotonic_ns())
    low, high = 10000, min(_ephemeral_low(), 60000)
    if high - low < count + 1000:  # an unusual ephemeral range: take what there is
        low, high = 20000, 60000
    for _ in range(200):
        base = rng.randrange(low, high - count)
        if ports_free(base, count):
            return base
    raise Unavailable(f"no block of {count} free ports found")


def _abs(path: str | Path) -> str:
    return str(Path(path).resolve()) if path else ""


def make_config(*, nodes: int, shards: int, replicas: int, port: int, block_bytes: int,
                raft: RaftConfig, server: ServerConfig, tls_cert: str = "", tls_key: str = "",
                tls_ca: str = "") -> ClusterConfig:
    scheme = "https" if tls_cert else "http"
    node_cfgs = tuple(
        NodeConfig(id=i, host="127.0.0.1", admin_port=port + i,
                   port_base=port + nodes + i * (2 * shards + 2), data_dir=f"node-{i}", scheme=scheme)
        for i in range(nodes))
    return ClusterConfig(nodes=node_cfgs, shards=shards, replicas=replicas, block_bytes=block_bytes,
                         raft=raft, server=server, tls_cert=tls_cert, tls_key=tls_key,
                         tls_ca=tls_ca).validate()


def ports_needed(nodes: int, shards: int) -> int:
    # per node: 2 per shard (raft, data) + 1 for its metadata replica (kvps/meta.py) + its wire port
    return nodes + nodes * (2 * shards + 2)


class LocalCluster:
    def __init__(self, data_dir: str | Path, *, nodes: int = 3, shards: int = 8, replicas: int = 3,
                 port: int | None = None, block_bytes: int = 1 << 20,
                 raft: RaftConfig | None = None, server: ServerConfig | None = None,
                 env: dict[str, str] | None = None, tls_cert: str | Path = "",
                 tls_key: str | Path = "", tls_ca: str | Path = "") -> None:
        self.data_dir = Path(data_dir).resolve()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if port is None:
            port = free_port_base(ports_needed(nodes, shards))
        self.cfg = make_config(nodes=nodes, shards=shards, replicas=min(replicas, nodes), port=port,
                               block_bytes=block_bytes, raft=raft or RaftConfig(),
                               server=server or ServerConfig(), tls_cert=_abs(tls_cert),
                               tls_key=_abs(tls_key), tls_ca=_abs(tls_ca))
        self.ssl = ssl.create_default_context(cafile=self.cfg.tls_ca or self.cfg.tls_cert) \
            if self.cfg.tls_cert else None
        self.config_path = self.data_dir / "cluster.toml"
        self.env = env or {}
        self.procs: dict[int, subprocess.Popen] = {}
        self._write_files()

    def _write_files(self) -> None:
        self.config_path.write_text(dump_cluster(self.cfg))
        for name, make in (("secret", lambda: secrets.token_hex(32)),
                           ("token", new_token)):
            path = self.data_dir / name
            if not path.exists():
                path.touch(mode=0o600)
                path.write_text(make() + "\n")

    @property
    def token(self) -> str:
        """The token file's first admin token."""
        return admin_token(self.data_dir / "token")

    @property
    def endpoints(self) -> list[str]:
        return [n.admin_url for n in self.cfg.nodes]

    # ---- processes ---------------------------------------------------------------------------

    def start(self, *, wait: bool = True, timeout: float = 60.0) -> "LocalCluster":
        for node in self.cfg.nodes:
            self.start_node(node.id)
        if wait:
            self.wait_ready(timeout)
            wait_until(self.fully_up, timeout, "every replica up and every node's identity recorded",
                       period=0.1)
        return self

    def start_node(self, node_id: int, *, replace: bool = False, zone: str | None = None) -> None:
        """Start node ``node_id`` (no-op while it runs); ``replace``: ``kvps node --replace``, for
        a node whose data directory was lost; ``zone``: ``kvps node --zone``."""
        proc = self.procs.get(node_id)
        if proc is not None and proc.poll() is None:
            return
        args = python_module_args("kvps.cli", "node", "--config", str(self.config_path),
                                  "--id", str(node_id), *(["--replace"] if replace else []),
                                  *(["--zone", zone] if zone is not None else []))
        log = self.data_dir / f"node-{node_id}" / "logs" / "node.log"
        self.procs[node_id] = spawn(self.node_command(node_id, args), log, new_session=True,
                                    env=self.env)

    def node_command(self, node_id: int, args: list[str]) -> list[str]:
        """The command that runs node ``node_id`` (a subclass may wrap it, e.g. in a namespace)."""
        return args

    def kill_node(self, node_id: int, sig: int = signal.SIGKILL) -> None:
        """Signal the node supervisor only; with SIGKILL its replicas die with it (PDEATHSIG)."""
        proc = self.procs.get(node_id)
        if proc is not None and proc.poll() is None:
            proc.send_signal(sig)
            if sig == signal.SIGKILL:
                proc.wait()

    def stop_node(self, node_id: int) -> None:
        proc = self.procs.get(node_id)
        if proc is not None:
            stop_process(proc, timeout=10.0, group=True)

    def stop(self) -> None:
        for node_id in list(self.procs):
            self.stop_node(node_id)

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- observation -------------------------------------------------------------------------

    def cluster_map(self, timeout: float = 1.0) -> dict[str, Any] | None:
        for node in self.cfg.nodes:
            proc = self.procs.get(node.id)
            if proc is None or proc.poll() is not None:
                continue
            try:
                return request_json("GET", node.admin_url + "/v1/cluster", token=self.token,
                                    timeout=timeout, ssl=self.ssl)
            except KvpsError:
                continue
        return None

    def ready(self) -> bool:
        cmap = self.cluster_map()
        if cmap is None:
            return False
        for shard in cmap["shards"]:
            leader = next((r for r in shard["replicas"] if r.get("role") == "leader"), None)
            if leader is None or not leader.get("serving"):
                return False
        return True

    def fully_up(self) -> bool:
        """Every replica of every shard answers as leader or follower, and the metadata group has
        recorded every node's incarnation (kvps.node.identity): what a freshly started cluster
        reaches a moment after ``ready()``, before which a test's snapshot or fingerprint would
        miss a replica or see the metadata change."""
        cmap = self.cluster_map()
        if cmap is None or not all(r.get("role") in ("leader", "follower")
                                   for s in cmap["shards"] for r in s["replicas"]):
            return False
        try:
            meta = self.admin("GET", "/v1/meta", timeout=1.0)
        except KvpsError:
            return False
        return all(n.get("incarnation") for n in meta["nodes"] if n.get("state") != "removed")

    def wait_ready(self, timeout: float = 60.0) -> None:
        wait_until(self.ready, timeout, "every shard to have a serving leader", period=0.1)

    def leaders_spread(self) -> bool:
        """Every shard has a leader and every node leads shards/nodes ±1 (kvps.node.leaders)."""
        cmap = self.cluster_map()
        if cmap is None or any(s["leader"] is None for s in cmap["shards"]):
            return False
        led = [sum(1 for s in cmap["shards"] if s["leader"] == n["id"]) for n in cmap["nodes"]]
        return max(led) - min(led) <= 1

    def wait_leaders_spread(self, timeout: float = 30.0) -> bool:
        """Wait until ``leaders_spread()`` (False if it did not happen within ``timeout``): a
        measurement started before would count the spreading transfers as elections."""
        try:
            wait_until(self.leaders_spread, timeout, "the leaders to spread over the nodes", period=0.2)
        except TimeoutError:
            return False
        return True

    def leader(self, shard: int) -> dict[str, Any] | None:
        cmap = self.cluster_map()
        if cmap is None:
            return None
        return next((r for r in cmap["shards"][shard]["replicas"]
                     if r.get("role") == "leader" and r.get("serving")), None)

    def wait_leader(self, shard: int, timeout: float = 30.0) -> dict[str, Any]:
        """``shard``'s serving leader (with its pid), waiting for one: a node that misses the
        cluster view's short deadline shows its replicas' roles as unknown for a moment."""
        return self._wait_shard(shard, timeout, every=False)[0]

    def wait_replicas(self, shard: int, timeout: float = 30.0) -> list[dict[str, Any]]:
        """``shard``'s replicas, its serving leader first, once every one has a role and a pid."""
        return self._wait_shard(shard, timeout, every=True)

    def _wait_shard(self, shard: int, timeout: float, every: bool) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = []

        def known() -> bool:
            cmap = self.cluster_map()
            if cmap is None:
                return False
            replicas = cmap["shards"][shard]["replicas"]
            leaders = [r for r in replicas if r.get("role") == "leader" and r.get("serving")
                       and r.get("pid") is not None]
            if len(leaders) != 1 or every and any(r.get("role") in (None, "unknown")
                                                  or r.get("pid") is None for r in replicas):
                return False
            found[:] = [*leaders, *(r for r in replicas if r is not leaders[0])]
            return True
        what = "every replica" if every else "a serving leader"
        wait_until(known, timeout, f"{what} of shard {shard} in the cluster view")
        return found

    def replica(self, shard: int, node_id: int) -> dict[str, Any] | None:
        cmap = self.cluster_map()
        if cmap is None:
            return None
        return next((r for r in cmap["shards"][shard]["replicas"] if r["node"] == node_id), None)

    def admin(self, method: str, path: str, body: Any = None, *, timeout: float = 10.0) -> Any:
        """An admin API call to the first node (with the cluster token); the decoded reply."""
        return request_json(method, self.endpoints[0] + path, body, token=self.token,
                            timeout=timeout, ssl=self.ssl)

    def state_hash(self, node_id: int, shard: int, *, timeout: float = 2.0) -> tuple[str, int] | None:
        """(state hash, applied index) of ``node_id``'s replica of ``shard``; None: no answer."""
        try:
            meta = rpc(self.cfg.node(node_id).data_url(shard), "state_hash", {}, token=self.token,
                       timeout=timeout, ssl=self.ssl)
        except KvpsError:
            return None
        return meta["hash"], meta["applied_index"]

    def kill_replica(self, replica: dict[str, Any]) -> bool:
        """``kill -9`` of the process ``replica`` (a cluster-map entry) runs in. With
        ``server.procs = 1`` that is its node's process, with every replica of the node: the node
        is started again at once, as a service manager would (True). With ``procs = 0`` it is the
        replica's own process, which its node restarts (False). Call it, as ``start_node``, from
        a thread that outlives the node: a child gets SIGKILL when the thread that started it
        ends (``PR_SET_PDEATHSIG``), so not from ``asyncio.to_thread``."""
        node = replica["node"]
        proc = self.procs.get(node)
        if proc is not None and proc.pid == replica["pid"]:
            self.kill_node(node, signal.SIGKILL)
            self.start_node(node)
            return True
        self.kill_pid(replica["pid"], signal.SIGKILL)
        return False

    def kill_pid(self, pid: int, sig: int = signal.SIGKILL) -> None:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    def describe(self) -> str:
        lines = [f"kvps local cluster: {len(self.cfg.nodes)} nodes, {self.cfg.shards} shards × "
                 f"{self.cfg.replicas} replicas, data in {self.data_dir}"]
        lines += [f"  node {n.id}: {n.admin_url}" for n in self.cfg.nodes]
        return "\n".join(lines)
