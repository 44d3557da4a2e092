"""Elastic membership as the harness sees it: the metadata view, "settled" (nothing moves, the
load is even over exactly the expected nodes), replicas that agree, and the grow-then-shrink
scenario (nodes join, replicas spread onto them, they are drained while pushes stream).

The scenario runs on a ``ChaosCluster`` in either mode: on loopback, or with every node (the
joining ones too) in its own network namespace; in namespace mode the caller runs it in the hub
(``Topology.entered``). It returns what it saw; ``GrowShrink.failures`` gives the verdicts, so the
tests and the chaos fault judge alike.
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from kvps.errors import KvpsError
from kvps.node.local import LocalCluster, wait_until
from kvps.service.http import request_json, rpc

__all__ = ["GrowShrink", "grow_and_shrink", "loads", "meta", "print_logs", "replicas_agree", "settled"]


def meta(cluster: LocalCluster, timeout: float = 5.0) -> dict[str, Any] | None:
    """``GET /v1/meta`` from the first initial node that answers (any node forwards it)."""
    for url in cluster.endpoints:
        try:
            return request_json("GET", url + "/v1/meta", token=cluster.token, timeout=timeout)
        except KvpsError:  # e.g. a node restarting
            continue
    return None


def loads(m: dict[str, Any]) -> dict[int, int]:
    """{node: replicas it holds} over the active nodes and every node the assignment names."""
    out = {n["id"]: 0 for n in m["nodes"] if n["state"] == "active"}
    for s in m["assignment"]["shards"]:
        for n in s["nodes"]:
            out[n] = out.get(n, 0) + 1
    return out


def settled(cluster: LocalCluster, active: Collection[int]) -> dict[str, Any] | None:
    """The metadata view once exactly ``active`` are the active nodes, nothing moves or drains,
    every shard has its full replica count on active nodes, and loads differ by at most one."""
    m = meta(cluster, timeout=2.0)
    if m is None or m["rebalance"]["moving"] is not None:
        return None
    states = {n["id"]: n["state"] for n in m["nodes"]}
    if {n for n, st in states.items() if st == "active"} != set(active) or "draining" in states.values():
        return None
    if any(len(s["nodes"]) != cluster.cfg.replicas for s in m["assignment"]["shards"]):
        return None
    load = loads(m)
    if set(load) != set(active) or max(load.values()) - min(load.values()) > 1:
        return None
    return m


def _state_hash(url: str, token: str) -> tuple[str, int] | None:
    try:
        m = rpc(url, "state_hash", {}, token=token, timeout=2)
    except KvpsError:
        return None
    return m["hash"], m["applied_index"]


def replicas_agree(cluster: LocalCluster) -> bool:
    """Every shard of the current cluster map has its full replica count, all with one state hash."""
    cmap = cluster.cluster_map()
    if cmap is None:
        return False
    for shard in cmap["shards"]:
        hashes = {_state_hash(r["data_url"], cluster.token) for r in shard["replicas"]}
        if None in hashes or len(hashes) != 1 or len(shard["replicas"]) != cluster.cfg.replicas:
            return False
    return True


@dataclass
class GrowShrink:
    """What one grow-then-shrink run saw."""
    seed: int
    initial: list[int]
    joined: list[int] = field(default_factory=list)
    drained: list[int] = field(default_factory=list)           # the nodes drained (default: the joined)
    acked: int = 0                                             # pushes acknowledged (each adds 1 per key)
    values: dict[str, tuple[float, int]] = field(default_factory=dict)   # key: (value, version) at the end
    push_errors: list[str] = field(default_factory=list)
    stopped: str | None = None                                 # why the scenario ended early
    grown: dict[str, Any] | None = None                        # metadata view once spread over every node
    shrunk: dict[str, Any] | None = None                       # ... and once back on the initial nodes
    drain_output: str = ""
    drain_rc: int | None = None
    exited: dict[int, bool] = field(default_factory=dict)      # joined node's process exited by itself
    agreed: bool = False                                       # every shard's replicas agree at the end
    timings: dict[str, float] = field(default_factory=dict)

    def failures(self) -> list[str]:
        out = [f"push failed (outcome unknown): {e}" for e in self.push_errors]
        out += [f"scenario stopped early: {self.stopped}"] if self.stopped else []
        for key, (value, version) in sorted(self.values.items()):
            if value != self.acked or version != self.acked:
                what = "LOST" if value < self.acked else "APPLIED TWICE" if value > self.acked else "version"
                out.append(f"{key}: {self.acked} pushes acknowledged, value {value:g} version {version} ({what})")
        for name, m, active in (("grown", self.grown, self.initial + self.joined),
                                ("shrunk", self.shrunk, self.remaining)):
            if m is None:
                out.append(f"never {name}: replicas did not settle evenly on nodes {active}")
        if self.grown is not None and self.grown["rebalance"]["moves_done"] < 2 * len(self.joined):
            out.append(f"only {self.grown['rebalance']['moves_done']} moves for {len(self.joined)} joins")
        if self.shrunk is not None:
            states = {n["id"]: n["state"] for n in self.shrunk["nodes"]}
            want = {**{n: "active" for n in self.remaining}, **{n: "removed" for n in self.drained}}
            if states != want:
                out.append(f"node states {states}, expected {want}")
        if self.drained and (self.drain_rc != 0 or f"node {self.drained[-1]} removed" not in self.drain_output):
            out.append(f"kvps node drain {self.drained[-1]} exited {self.drain_rc}: {self.drain_output[-500:]}")
        out += [f"node {n}'s process did not exit after its removal" for n, ok in self.exited.items() if not ok]
        if not self.agreed:
            out.append("replicas of some shard did not agree at the end")
        return out

    @property
    def remaining(self) -> list[int]:
        return [n for n in self.initial + self.joined if n not in self.drained]

    def explain(self) -> str:
        return (f"seed {self.seed}: {self.failures()}\nacked {self.acked}, values {self.values}, "
                f"timings {self.timings}")


KEYS = [f"elastic/c{i}" for i in range(8)]


async def _push_forever(ps: Any, stop: asyncio.Event, acks: list[float], errors: list[str]) -> None:
    import numpy as np

    from kvps.errors import KvpsError
    one = np.ones(1, np.float32)
    while not stop.is_set():
        try:
            await ps.push({k: one for k in KEYS})
        except KvpsError as exc:  # the count can no longer be exact: report it, stop this worker
            errors.append(f"{type(exc).__name__}: {exc}")
            return
        acks.append(time.monotonic())


async def _wait(cond: Callable[[], Any], timeout: float, what: str) -> Any:
    return await asyncio.to_thread(wait_until, cond, timeout, what, 0.1)


async def grow_and_shrink(cluster: Any, *, seed: int, joins: int = 2, drain: list[int] | None = None,
                          pushers: int = 3, settle_timeout: float = 180.0) -> GrowShrink:
    """``joins`` nodes join (``cluster.join_node``), replicas spread evenly over every node; then
    ``drain`` (default: the joined nodes) are drained (the last through ``kvps node drain``, which
    waits; the others through the admin API) and replicas settle on the remaining nodes.
    ``pushers`` tasks push +1 to every key throughout; ``acked`` counts the acknowledged pushes.
    Timeouts end the run early (the result then says what was never reached); every joined node
    is released before it returns."""
    import numpy as np

    import kvps_client as kc
    from kvps.node.process import python_module_args
    res = GrowShrink(seed, [n.id for n in cluster.cfg.nodes])
    every = res.initial
    started = time.monotonic()
    try:
        async with kc.Client(cluster.endpoints, token=cluster.token, seed=seed, timeout=60) as ps:
            for k in KEYS:
                await ps.create(k, np.zeros(1, np.float32))
            stop, acks = asyncio.Event(), []
            tasks = [asyncio.create_task(_push_forever(ps, stop, acks, res.push_errors)) for _ in range(pushers)]

            async def more_acks(n: int, what: str) -> None:
                want = len(acks) + n
                await _wait(lambda: len(acks) >= want or res.push_errors, 60, f"{n} acks {what}")

            try:
                await more_acks(20, "before growing")
                for _ in range(joins):
                    m = meta(cluster)
                    if m is None:
                        raise TimeoutError("no metadata view")
                    node_id = len(m["nodes"])
                    await asyncio.to_thread(cluster.join_node, node_id)
                    res.joined.append(node_id)
                    await _wait(lambda n=node_id: len((meta(cluster) or {"nodes": []})["nodes"]) > n, 60,
                                f"node {node_id} to join")
                every = res.initial + res.joined
                res.grown = await _wait(lambda: settled(cluster, every), settle_timeout,
                                        f"replicas to spread over nodes {every}")
                res.timings["grow_s"] = round(time.monotonic() - started, 1)
                await more_acks(20, "after growing")
                shrinking = time.monotonic()
                res.drained = list(res.joined if drain is None else drain)
                via = next(n for n in every if n not in res.drained)  # a node that stays
                drainer = await asyncio.create_subprocess_exec(
                    *python_module_args("kvps.cli", "node", "drain", str(res.drained[-1]),
                                        "--endpoint", _admin_url(cluster, via),
                                        "--timeout", str(int(settle_timeout))),
                    env={**os.environ, "KVPS_TOKEN": cluster.token},
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
                try:
                    for node_id in res.drained[:-1]:
                        await asyncio.to_thread(cluster.admin, "POST", f"/v1/nodes/{node_id}/drain", {})
                    out, _ = await asyncio.wait_for(drainer.communicate(), settle_timeout + 30)
                finally:
                    if drainer.returncode is None:
                        drainer.kill()
                        await drainer.wait()
                res.drain_output, res.drain_rc = out.decode(errors="replace"), drainer.returncode
                res.shrunk = await _wait(lambda: settled(cluster, res.remaining), settle_timeout,
                                         f"replicas settled on nodes {res.remaining}")
                res.timings["shrink_s"] = round(time.monotonic() - shrinking, 1)
                await more_acks(20, "after shrinking")
            except (TimeoutError, OSError, subprocess.SubprocessError) as exc:
                res.stopped = f"{type(exc).__name__}: {exc}"
            finally:
                stop.set()
                await asyncio.gather(*tasks)
            res.acked = len(acks)
            for k in KEYS:
                value, version = await ps.get(k)
                res.values[k] = (float(value[0]), int(version))
        for node_id in res.drained:  # a removed node's process exits by itself
            proc = cluster.joined.get(node_id) or cluster.procs[node_id]
            try:
                await _wait(lambda p=proc: p.poll() is not None, 30, f"node {node_id} to exit")
                res.exited[node_id] = True
            except TimeoutError:
                res.exited[node_id] = False
        try:
            res.agreed = await _wait(lambda: replicas_agree(cluster), 60, "every shard's replicas to agree")
        except TimeoutError:
            res.agreed = False
    finally:
        for node_id in res.joined:
            await asyncio.to_thread(cluster.release_node, node_id)
    return res


def _admin_url(cluster: Any, node_id: int) -> str:
    if node_id < len(cluster.cfg.nodes):
        return cluster.cfg.node(node_id).admin_url
    m = meta(cluster)
    node = (m or {"nodes": []})["nodes"][node_id]
    return f"{node['scheme']}://{node['host']}:{node['admin_port']}"


def print_logs(cluster: LocalCluster, lines: int = 60) -> None:
    """The tail of every joined node's log (a failing test shows them)."""
    for log in sorted(cluster.data_dir.glob("joined-*/node.log")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        print(f"----- {log.relative_to(cluster.data_dir)} -----\n" + "\n".join(tail), file=sys.stderr)
