"""The cluster under test: a ``LocalCluster`` on loopback, or one node per network namespace.

In namespace mode the node addresses in ``cluster.toml`` are the namespaces' addresses, each node
process is started with ``ip netns exec``, and a delay proxy runs next to it (``kvps_chaos.proxy``).
Everything else (config files, process groups, restarts) is ``LocalCluster``'s.
"""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvps.config import RaftConfig, ServerConfig
from kvps.node.local import LocalCluster
from kvps.node.process import spawn, stop_process

from kvps_chaos.netns import PROXY_PORT, Topology
from kvps_chaos.proxy import set_delay

__all__ = ["ChaosCluster"]

NETNS_PORT = 7100  # every node has its own address in namespace mode, so fixed ports are fine


class ChaosCluster(LocalCluster):
    def __init__(self, data_dir: Path, *, nodes: int, shards: int, raft: RaftConfig,
                 server: ServerConfig, topology: Topology | None = None, seed: int = 0) -> None:
        self.topology = topology
        self.seed = seed
        self.proxies: dict[int, subprocess.Popen] = {}
        self.joined: dict[int, subprocess.Popen] = {}  # nodes started with join_node, by id
        self.join_ports: dict[int, int] = {}  # loopback: the admin port each joined node was given
        super().__init__(data_dir, nodes=nodes, shards=shards, replicas=3,
                         port=NETNS_PORT if topology else None, raft=raft, server=server,
                         env={"KVPS_LOG_LEVEL": "info"})
        if topology is not None:
            hosts = tuple(dataclasses.replace(n, host=topology.address(n.id)) for n in self.cfg.nodes)
            self.cfg = dataclasses.replace(self.cfg, nodes=hosts).validate()
            self._write_files()

    @property
    def netns(self) -> bool:
        return self.topology is not None

    # ---- processes -------------------------------------------------------------------------

    def start(self, *, wait: bool = True, timeout: float = 90.0) -> "ChaosCluster":
        if self.topology is not None and not self.proxies:
            self._start_proxies()
        return super().start(wait=wait, timeout=timeout)

    def node_command(self, node_id: int, args: list[str]) -> list[str]:
        # in namespace mode every node runs inside its own network namespace
        return args if self.topology is None else self.topology.exec_args(node_id, args)

    def raft_ports(self, shard: int | None = None) -> list[int]:
        shards = range(self.cfg.shards) if shard is None else [shard]
        return sorted({n.port_base + 2 * s for n in self.cfg.nodes for s in shards})

    def _start_proxies(self) -> None:
        assert self.topology is not None
        for n in self.cfg.nodes:
            control = self.proxy_control(n.id)
            Path(control).unlink(missing_ok=True)
            args = [sys.executable, "-m", "kvps_chaos.proxy", "--port", str(PROXY_PORT),
                    "--control", control, "--seed", str(self.seed * 100 + n.id)]
            log = self.data_dir / f"node-{n.id}" / "logs" / "proxy.log"
            self.proxies[n.id] = spawn(self.topology.exec_args(n.id, args), log)
            peers = [p.host for p in self.cfg.nodes if p.id != n.id]
            self.topology.redirect_raft(n.id, peers, self.raft_ports())
        from kvps.node.local import wait_until
        wait_until(lambda: all(Path(self.proxy_control(n.id)).exists() for n in self.cfg.nodes),
                   30, "the delay proxies to listen")

    def proxy_control(self, node_id: int) -> str:
        return str(self.data_dir / f"proxy-{node_id}.sock")

    def set_delay(self, node_id: int, rules: dict[str, tuple[float, float]]) -> None:
        set_delay(self.proxy_control(node_id), rules)

    def stop(self) -> None:
        try:
            for node_id in list(self.joined):
                self.release_node(node_id)
            super().stop()
        finally:
            for proc in self.proxies.values():
                stop_process(proc, timeout=2.0)
            self.proxies.clear()

    def node_pid(self, node_id: int) -> int | None:
        proc = self.procs.get(node_id)
        return proc.pid if proc is not None and proc.poll() is None else None

    def join_node(self, node_id: int) -> subprocess.Popen:
        """Start ``kvps node join`` for one more node; the caller drains it (its process then
        exits by itself) and calls ``release_node``. ``node_id`` is the id the cluster will give
        it (ids are never reused: the number of nodes it has known); it names the data dir and,
        in namespace mode, the node's namespace and address. The same call again after
        ``release_node`` restarts that node (a repeated join gets the same id back). A joined node gets no delay proxy:
        the membership fault runs alone, so no delay fault ever targets it."""
        from kvps.node.local import free_port_base, ports_free, wait_until
        from kvps.node.process import python_module_args
        if node_id in self.joined:
            raise RuntimeError(f"node {node_id} was already started by this harness")
        count = 2 * self.cfg.shards + 3  # admin, 2 per shard, metadata, wire
        if self.topology is None and node_id in self.join_ports:  # a restart: the same ports
            host, port = "127.0.0.1", self.join_ports[node_id]
            # The admin port must be free for the node to start; a replica whose port an outgoing
            # connection holds for a moment is restarted by its node.
            wait_until(lambda: ports_free(port, 1), 60, f"node {node_id}'s admin port to be free", 0.1)
        elif self.topology is None:
            host, port = "127.0.0.1", free_port_base(count, seed=self.seed * 1000 + node_id)
            self.join_ports[node_id] = port
        else:
            host, port = self.topology.add_node(node_id), NETNS_PORT
        data = self.data_dir / f"joined-{node_id}"
        seed = next((n.admin_url for n in self.cfg.nodes if self.node_pid(n.id)), self.endpoints[0])
        args = python_module_args("kvps.cli", "node", "join", "--seed", seed,
                                  "--host", host, "--port", str(port), "--data-dir", str(data))
        try:
            proc = spawn(self.node_command(node_id, args), data / "node.log", new_session=True,
                         env={**self.env, "KVPS_TOKEN": self.token})
        except BaseException:
            if self.topology is not None:
                self.topology.remove_node(node_id)
            raise
        self.joined[node_id] = proc
        return proc

    def release_node(self, node_id: int) -> None:
        """Stop a joined node's process (if it still runs) and remove its namespace."""
        proc = self.joined.pop(node_id, None)
        if proc is not None:
            stop_process(proc, timeout=10.0, group=True)
        if self.topology is not None:
            self.topology.remove_node(node_id)


    def replica_dir(self, node_id: int, shard: int) -> Path:
        return self.data_dir / self.cfg.node(node_id).data_dir / f"shard-{shard}"

    # ---- observation -----------------------------------------------------------------------

    def state_hashes(self, shard: int, timeout: float = 2.0) -> dict[int, tuple[str, int] | None]:
        """{node: (state hash, applied index)} for every replica of ``shard`` (None: no answer)."""
        return {n: self.state_hash(n, shard, timeout=timeout) for n in self.cfg.replica_nodes(shard)}

    def leaders(self) -> dict[int, dict[str, Any] | None]:
        """{shard: serving leader replica or None}, from one cluster map."""
        cmap = self.cluster_map()
        if cmap is None:
            return {s: None for s in range(self.cfg.shards)}
        return {sh["id"]: next((r for r in sh["replicas"] if r.get("role") == "leader"
                                and r.get("serving")), None) for sh in cmap["shards"]}
