"""The Redis peer: a primary and two replicas on 127.0.0.1, configured to be fast and fair.

Fair means: the replication backlog and the replica output buffer are large enough that 1 MiB
values at full speed never force a full resync or drop a replica (Redis's defaults, 1 MB backlog
and a 256 MB / 64 MB-for-60 s replica buffer limit, do); persistence is off. The kvps cluster runs
its default fsync policy, ``interval`` (``Plan.kvps_fsync`` says why not ``never``): it writes every
entry to its journal and fdatasyncs every 50 ms, which Redis does not; ``WAIT 2 <timeout>`` after each
batch of writes makes an acknowledgement mean "on all three copies", as a kvps push means "on a
majority". What Redis does *not* give, and the report says so: concurrent writers to one key are
last-writer-wins (each worker SETs the value it computed from what it pulled, so the others'
updates in between are lost), and a failover needs Sentinel or Cluster, which this bench does not
run.

``ensure_redis_server()`` finds ``redis-server`` or installs Debian's package when it may
(``apt-get``, as root); the ``redis`` PyPI client is the ``bench`` extra.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Self

import numpy as np

from kvps.bench.harness import StepWindow, Window, worker_loop
from kvps.bench.workload import LR, Model
from kvps.node.local import free_port_base
from kvps.node.process import spawn, stop_process

__all__ = ["RedisGroup", "ensure_redis_server", "redis_missing_reason", "redis_worker"]

WAIT_TIMEOUT_MS = 5000


def redis_missing_reason(install: bool = False) -> str | None:
    """None when the Redis peer can run; otherwise one line that says why not."""
    try:
        import redis  # noqa: F401
    except ImportError:
        return "the 'redis' Python client is not installed (pip install 'kvps[bench]')"
    if ensure_redis_server(install) is None:
        return ("redis-server is not installed and could not be installed "
                "(apt-get install -y redis-server, as root)")
    return None


def ensure_redis_server(install: bool = False) -> str | None:
    """Path of ``redis-server``; with ``install``, try ``apt-get install`` first when missing."""
    found = shutil.which("redis-server") or next(
        (p for p in ("/usr/bin/redis-server", "/usr/local/bin/redis-server") if os.access(p, os.X_OK)), None)
    if found or not install or os.geteuid() != 0 or shutil.which("apt-get") is None:
        return found
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for args in (["apt-get", "install", "-y", "-q", "redis-server"],
                 ["apt-get", "update", "-q"],
                 ["apt-get", "install", "-y", "-q", "redis-server"]):
        subprocess.run(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        found = shutil.which("redis-server")
        if found:
            return found
    return None


class RedisGroup:
    """``redis-server`` primary + ``replicas`` replicas, stopped on exit (use ``with``)."""

    def __init__(self, data_dir: Path, *, replicas: int = 2, server: str | None = None,
                 appendonly: bool = False) -> None:
        self.data_dir = Path(data_dir)
        # appendonly: every server logs its writes (AOF) and fsyncs it every second, what a
        # fair comparison with kvps's journal needs; off, Redis persists nothing
        self.appendonly = appendonly
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.server = server or ensure_redis_server() or "redis-server"
        self.replicas = replicas
        base = free_port_base(replicas + 1)
        self.ports = list(range(base, base + replicas + 1))
        self.procs: list[subprocess.Popen] = []

    @property
    def primary_port(self) -> int:
        return self.ports[0]

    def _args(self, i: int) -> list[str]:
        port = self.ports[i]
        args = [self.server, "--port", str(port), "--bind", "127.0.0.1", "--protected-mode", "no",
                "--dir", str(self.data_dir), "--dbfilename", f"dump-{port}.rdb",
                "--save", "", "--daemonize", "no",
                "--repl-backlog-size", "512mb",
                "--client-output-buffer-limit", "replica 0 0 0",
                "--client-output-buffer-limit", "normal 0 0 0",
                "--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0",
                "--proto-max-bulk-len", "512mb", "--logfile", str(self.data_dir / f"redis-{port}.log")]
        if self.appendonly:
            args += ["--appendonly", "yes", "--appendfsync", "everysec",
                     "--appendfilename", f"appendonly-{port}.aof", "--appenddirname", f"aof-{port}"]
        else:
            args += ["--appendonly", "no"]
        if i > 0:
            args += ["--replicaof", "127.0.0.1", str(self.primary_port)]
        return args

    def start(self, timeout: float = 30.0) -> RedisGroup:
        import redis

        for i in range(self.replicas + 1):
            self.procs.append(spawn(self._args(i), None))
        primary = redis.Redis(port=self.primary_port)
        deadline = time.monotonic() + timeout
        while True:
            try:
                info = primary.info("replication")
                online = [v for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)
                          and v.get("state") == "online"]
                if len(online) == self.replicas:
                    break
            except redis.exceptions.ConnectionError:
                pass
            dead = [p for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"redis group did not come up (log: {self.data_dir})")
            time.sleep(0.05)
        primary.close()
        return self

    def stop(self) -> None:
        for proc in self.procs:
            stop_process(proc, timeout=5.0)
        self.procs.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def read(self, names: list[str]) -> list[np.ndarray]:
        """The values of ``names`` on the primary (float32)."""
        import redis

        r = redis.Redis(port=self.primary_port)
        try:
            return [np.frombuffer(raw, dtype=np.float32) for raw in r.mget(names)]
        finally:
            r.close()

    def load(self, names: list[str], values: list[np.ndarray]) -> None:
        import redis

        r = redis.Redis(port=self.primary_port)
        pipe = r.pipeline(transaction=False)
        for name, value in zip(names, values):
            pipe.set(name, value.tobytes())
        pipe.execute_command("WAIT", self.replicas, WAIT_TIMEOUT_MS)
        pipe.execute()
        r.close()


def redis_worker(rank: int, port: int, replicas: int, model: Model) -> Callable[[Window], StepWindow]:
    """Pull = one pipelined GET of every tensor; push = one pipelined SET of every new value
    (``value - LR * grad``, computed here) followed by ``WAIT replicas timeout``."""
    import redis

    names = model.names()
    grads = model.grads(rank)
    lr = np.float32(LR)
    r = redis.Redis(port=port)
    r.ping()
    short = [0]  # WAITs that returned fewer replicas than asked (acknowledged but not on all copies)

    def step() -> None:
        pipe = r.pipeline(transaction=False)
        for name in names:
            pipe.get(name)
        raw = pipe.execute()
        pipe = r.pipeline(transaction=False)
        for name, data, grad in zip(names, raw, grads):
            value = np.frombuffer(data, dtype=np.float32)          # (numel,) read-only view
            pipe.set(name, (value - lr * grad).tobytes())
        pipe.execute_command("WAIT", replicas, WAIT_TIMEOUT_MS)
        if pipe.execute()[-1] < replicas:
            short[0] += 1

    def run(window: Window) -> StepWindow:
        out = StepWindow()
        try:
            worker_loop(step, window, out)
        finally:
            out.counters["wait_short"] = short[0]
            r.close()
        return out

    return run
