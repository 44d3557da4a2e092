"""One 3-replica shard group: replicated push throughput and failover time, end to end.

    .venv/bin/python benchmarks/replicated_push.py [--seconds 10] [--inflight 8] [--kills 5]

Starts a local cluster of 3 nodes hosting ONE shard (so every push goes through one Raft group),
then, from this separate client process:
  1. pushes 1 MiB gradients to distinct 1 MiB keys (Add optimizer) with --inflight pushes
     outstanding, for --seconds; prints committed MB/s and latency percentiles;
  2. kills the shard leader with SIGKILL --kills times under a light push stream and prints
     kill -> first acknowledged push (committed by the new leader), median and max.
Numbers are for this machine only; compare ratios, not absolutes.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import kvps_client as kc
from kvps.bench.progress import say
from kvps.node.local import LocalCluster, wait_until

MiB = 1 << 20



async def throughput(cluster: LocalCluster, seconds: float, inflight: int, keys: int) -> dict:
    async with kc.Client(cluster.endpoints, token=cluster.token, seed=0) as ps:
        grad = np.random.default_rng(0).standard_normal(MiB // 4).astype(np.float32)  # 1 MiB
        names = [f"bench/{i}" for i in range(keys)]
        for name in names:
            await ps.create(name, np.zeros(MiB // 4, np.float32))
        latencies: list[float] = []
        done = 0
        deadline = time.monotonic() + seconds
        start = time.monotonic()

        async def pusher(i: int) -> None:
            nonlocal done
            n = i
            while time.monotonic() < deadline:
                t0 = time.monotonic()
                await ps.push({names[n % keys]: grad})
                latencies.append(time.monotonic() - t0)
                done += 1
                n += inflight

        async def report() -> None:
            while time.monotonic() < deadline:
                await asyncio.sleep(1.0)
                say(f"  {time.monotonic() - start:4.1f}s  {done} pushes  "
                         f"{done / (time.monotonic() - start):6.1f} MB/s")

        reporter = asyncio.create_task(report())
        await asyncio.gather(*(pusher(i) for i in range(inflight)))
        reporter.cancel()
        elapsed = time.monotonic() - start
        lat = sorted(latencies)
        return {"pushes": done, "seconds": round(elapsed, 2), "mb_per_s": round(done / elapsed, 1),
                "latency_ms_p50": round(1000 * lat[len(lat) // 2], 2),
                "latency_ms_p99": round(1000 * lat[int(len(lat) * 0.99)], 2),
                "inflight": inflight}


def current_leader(cluster: LocalCluster, shard: int = 0) -> dict | None:
    """The replica that says, itself, that it is the serving leader (not the node's cached view)."""
    import urllib.request
    for n in cluster.cfg.replica_nodes(shard):
        url = cluster.cfg.node(n).data_url(shard) + "/v1/status"
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {cluster.token}"})
        try:
            with urllib.request.urlopen(req, timeout=1) as resp:
                st = json.loads(resp.read())
        except OSError:
            continue
        if st["role"] == "leader" and st["serving"]:
            return st
    return None


async def failover(cluster: LocalCluster, kills: int) -> dict:
    """kill -9 the leader; time from the kill to the first acknowledged push that was *sent*
    after the kill (so it was committed by the new leader, not in flight before)."""
    times = []
    async with kc.Client(cluster.endpoints, token=cluster.token, seed=1, timeout=60) as ps:
        await ps.create("fo/counter", np.zeros(1, np.float32))
        pushes: list[tuple[float, float]] = []  # (sent, acknowledged)
        stop = asyncio.Event()

        async def stream() -> None:
            while not stop.is_set():
                sent = time.monotonic()
                await ps.push({"fo/counter": np.ones(1, np.float32)})
                pushes.append((sent, time.monotonic()))

        task = asyncio.create_task(stream())
        for k in range(kills):
            leader = await asyncio.to_thread(wait_until, lambda: current_leader(cluster), 60,
                                             "a serving leader")
            # every replica is up again (the killed one restarted and caught up)
            await asyncio.to_thread(wait_until, lambda: all(
                r["alive"] and r["applied_index"] for r in cluster.cluster_map()["shards"][0]["replicas"]),
                60, "all replicas up")
            await asyncio.to_thread(wait_until, lambda: len(pushes) > 0 and
                                    time.monotonic() - pushes[-1][1] < 0.05, 10, "a live stream")
            killed = time.monotonic()
            cluster.kill_pid(leader["pid"], signal.SIGKILL)
            await asyncio.to_thread(wait_until, lambda: any(s > killed for s, _ in pushes), 30,
                                    "a push sent after the kill to be acknowledged")
            first = min(a for s, a in pushes if s > killed)
            times.append(first - killed)
            say(f"  kill {k + 1}/{kills}: leader on node {leader['node']} -> first commit "
                     f"after {times[-1] * 1000:.0f} ms")
        stop.set()
        await task
        value, version = await ps.get("fo/counter")
        lost = len(pushes) - int(value[0])
    return {"kills": kills, "kill_to_commit_s": [round(t, 3) for t in times],
            "median_s": round(statistics.median(times), 3), "max_s": round(max(times), 3),
            "acked": len(pushes), "counter": int(value[0]), "lost_or_duplicated": lost}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--inflight", type=int, default=8)
    ap.add_argument("--keys", type=int, default=16)
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--out", default=None, help="write results.json here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvps-bench-") as tmp:
        with LocalCluster(Path(tmp), nodes=3, shards=1) as cluster:
            say("starting a 3-replica, 1-shard cluster ...")
            cluster.start(timeout=90)
            say(f"B: {args.seconds:.0f}s of 1 MiB pushes, {args.inflight} in flight")
            tp = asyncio.run(throughput(cluster, args.seconds, args.inflight, args.keys))
            say(f"F: {args.kills} leader kills under a light push stream")
            fo = asyncio.run(failover(cluster, args.kills))
    results = {"throughput": tp, "failover": fo}
    print(f"replicated 1 MiB pushes: {tp['mb_per_s']} MB/s ({tp['pushes']} pushes in {tp['seconds']} s, "
          f"{tp['inflight']} in flight, p50 {tp['latency_ms_p50']} ms, p99 {tp['latency_ms_p99']} ms)")
    print(f"failover kill -> first commit: median {fo['median_s']} s, max {fo['max_s']} s "
          f"over {fo['kills']} kills; acked {fo['acked']}, counter {fo['counter']}, "
          f"lost/duplicated {fo['lost_or_duplicated']}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
