"""B3, failover under load: ``kill -9`` of shard leaders while a training loop runs.

A trainer process runs the B1 step (pull the whole model, push a gradient) on its own model
without pause. For each kill this process picks the next shard in turn, waits until all three of
its replicas are up and caught up, finds the replica that says itself that it is the serving
leader, sends it SIGKILL (its node restarts it) and at once pushes to a key of that shard.

* **kill → first commit**: from the kill to the acknowledgement of that push. It was sent after
  the kill, so it can only have been committed by the next leader; the client sees the dead
  leader, backs off, follows hints and retries — what any user would see.
* **stall seen by training**: for each kill, the longest trainer step that overlaps the 5 s after
  the kill, minus the trainer's median step time before the first kill.
"""
from __future__ import annotations

import asyncio
import json
import math
import multiprocessing as mp
import queue
import statistics
import time
import urllib.request
from collections.abc import Callable

import numpy as np

from kvps.bench.workload import Model
from kvps.placement import block_shard

__all__ = ["failover", "replica_status", "serving_leader"]

STALL_HORIZON = 5.0  # s after a kill in which a trainer step counts as affected
BASELINE_STEPS = 5   # undisturbed trainer steps before the first kill


def _trainer(endpoints: list[str], token: str, model: Model, stop, done, out) -> None:
    import kvps_client as kc

    names = model.names("b3")
    grads = dict(zip(names, model.grads(0)))
    steps: list[tuple[float, float]] = []

    async def main() -> None:
        async with kc.Client(endpoints, token=token, seed=11, timeout=60) as ps:
            while not stop.is_set():
                t0 = time.monotonic()
                await ps.pull(names)
                await ps.push(grads)
                steps.append((t0, time.monotonic()))
                with done.get_lock():
                    done.value += 1

    try:
        asyncio.run(main())
        out.put(("ok", steps))
    except BaseException as exc:  # noqa: BLE001  the parent reports it: a trainer failure is a finding
        out.put(("error", f"{type(exc).__name__}: {exc}", steps))


def _status(url: str, token: str) -> dict | None:
    req = urllib.request.Request(url + "/v1/status", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=1) as resp:
            return json.loads(resp.read())
    except (OSError, ValueError):
        return None


def replica_status(cluster, shard: int, node: int) -> dict | None:
    """``/v1/status`` of the replica of ``shard`` on ``node`` (None when it does not answer)."""
    return _status(cluster.cfg.node(node).data_url(shard), cluster.token)


def serving_leader(cluster, shard: int) -> dict | None:
    """The replica of ``shard`` that says, itself, that it is the serving leader."""
    for n in cluster.cfg.replica_nodes(shard):
        st = _status(cluster.cfg.node(n).data_url(shard), cluster.token)
        if st and st.get("role") == "leader" and st.get("serving"):
            return st
    return None


def _caught_up(cluster, shard: int) -> bool:
    sts = [_status(cluster.cfg.node(n).data_url(shard), cluster.token)
           for n in cluster.cfg.replica_nodes(shard)]
    if any(s is None or not s.get("applied_index") for s in sts):
        return False
    leader = [s for s in sts if s.get("role") == "leader" and s.get("serving")]
    return bool(leader) and all(s["applied_index"] >= leader[0]["commit_index"] - 2 for s in sts)


def _probe_key(shard: int, shards: int) -> str:
    i = 0
    while block_shard(f"b3/probe/{shard}/{i}", 0, shards) != shard:
        i += 1
    return f"b3/probe/{shard}/{i}"


def _wait(predicate: Callable[[], object], timeout: float, what: str) -> None:
    from kvps.node.local import wait_until
    wait_until(predicate, timeout, what, period=0.05)


def failover(cluster, model: Model, kills: int, tick: Callable[[str], None]) -> dict:
    import kvps_client as kc

    shards = cluster.cfg.shards
    probes = {s: _probe_key(s, shards) for s in range(shards)}

    async def setup() -> None:
        async with kc.Client(cluster.endpoints, token=cluster.token, seed=12, timeout=60) as ps:
            await asyncio.gather(*(ps.create(n, v, optimizer=kc.SGD(lr=1e-4))
                                   for n, v in zip(model.names("b3"), model.values(3))))
            await asyncio.gather(*(ps.create(k, np.zeros(1, np.float32)) for k in probes.values()))

    asyncio.run(setup())
    ctx = mp.get_context("spawn")
    stop, done, out = ctx.Event(), ctx.Value("i", 0), ctx.Queue()
    trainer = ctx.Process(target=_trainer, args=(cluster.endpoints, cluster.token, model, stop, done, out),
                          daemon=True)
    trainer.start()
    records: list[dict] = []
    try:
        # the baseline: a few undisturbed training steps before the first kill
        _wait(lambda: done.value >= BASELINE_STEPS or not trainer.is_alive(), 120,
              f"{BASELINE_STEPS} training steps before the first kill")
        records = asyncio.run(_kills(cluster, probes, kills, tick))
    finally:
        stop.set()
        try:
            result = out.get(timeout=120)
        except queue.Empty:  # the trainer died without a word
            result = ("error", "trainer did not report", [])
        trainer.join(timeout=10)
        if trainer.is_alive():
            trainer.kill()
    steps = result[-1]
    return _summary(records, steps, result[1] if result[0] == "error" else None)


async def _kills(cluster, probes: dict[int, str], kills: int, tick: Callable[[str], None]) -> list[dict]:
    import kvps_client as kc

    records = []
    one = np.ones(1, np.float32)
    async with kc.Client(cluster.endpoints, token=cluster.token, seed=13, timeout=60) as ps:
        for key in probes.values():
            await ps.push({key: one})  # routes and layouts known before the first kill
        for k in range(kills):
            shard = k % len(probes)
            await asyncio.to_thread(_wait, lambda s=shard: _caught_up(cluster, s), 60,
                                    f"shard {shard}'s replicas to be up and caught up")
            leader = await asyncio.to_thread(serving_leader, cluster, shard)
            if leader is None:
                await asyncio.to_thread(_wait, lambda s=shard: serving_leader(cluster, s), 30, "a leader")
                leader = serving_leader(cluster, shard)
            killed = time.monotonic()
            # procs = 1: the replica's process is its node's (started again at once); procs = 0:
            # its own, which the node restarts
            cluster.kill_replica(leader)  # on this thread: a node started in a worker thread dies with it
            await ps.push({probes[shard]: one})
            acked = time.monotonic()
            records.append({"shard": shard, "node": leader["node"], "kill_t": killed,
                            "kill_to_commit_s": acked - killed})
            tick(f"B3 kill {k + 1}/{kills}: shard {shard} -> {1000 * (acked - killed):.0f} ms")
            await asyncio.sleep(0.5)
    return records


def _summary(records: list[dict], steps: list[tuple[float, float]], error: str | None) -> dict:
    times = sorted(r["kill_to_commit_s"] for r in records)
    first_kill = records[0]["kill_t"] if records else float("inf")
    before = sorted(e - s for s, e in steps if e < first_kill)
    base = before[len(before) // 2] if before else float("nan")
    for r in records:
        hit = [e - s for s, e in steps if e > r["kill_t"] and s < r["kill_t"] + STALL_HORIZON]
        r["worst_step_s"] = max(hit) if hit else float("nan")
        r["stall_s"] = r["worst_step_s"] - base
    stalls = sorted(r["stall_s"] for r in records if not math.isnan(r["stall_s"]))
    out = {
        "kills": len(records),
        "kill_to_commit_s": [r["kill_to_commit_s"] for r in records],
        "p50_s": statistics.median(times) if times else float("nan"),
        "p90_s": times[min(len(times) - 1, int(0.9 * len(times)))] if times else float("nan"),
        "max_s": times[-1] if times else float("nan"),
        "trainer_step_p50_s": base,
        "trainer_steps": len(steps),
        "stall_s": [r["stall_s"] for r in records],
        "stall_p50_s": statistics.median(stalls) if stalls else float("nan"),
        "stall_max_s": stalls[-1] if stalls else float("nan"),
        "per_kill": [{k: v for k, v in r.items() if k != "kill_t"} for r in records],
    }
    if error:
        out["trainer_error"] = error
    return out
