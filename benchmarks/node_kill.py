"""kill -9 of a whole node under training: when does each shard it led serve again?

    .venv/bin/python benchmarks/node_kill.py [--procs 0,1] [--kills 3] [--shards 8] [--out DIR]

For each process model (ServerConfig.procs: 0, a process per replica, the node supervisor and
its replicas killed together; 1, every replica in the node's process) this starts a 3-node
cluster, runs a training loop (2 tasks pulling and pushing a 16 × 1 MiB model) and one probe
key per shard, waits until the leaders are spread, then ``--kills`` times: picks the node that
leads the most shards, kills it with SIGKILL, and at once pushes to the probe key of every shard
it led. Each shard's time is kill → acknowledgement of that push (committed by the shard's next
leader). The node is then restarted and the cluster left to settle before the next kill.
Prints per-shard times and writes ``node_kill.json``. Numbers are for this machine only.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import kvps_client as kc
from kvps.bench.progress import say
from kvps.config import ServerConfig
from kvps.node.local import LocalCluster, wait_until
from kvps.placement import block_shard

MiB = 1 << 20


def probe_keys(shards: int) -> dict[int, str]:
    """A small key whose only block lives on each shard."""
    keys: dict[int, str] = {}
    i = 0
    while len(keys) < shards:
        name = f"probe/{i}"
        keys.setdefault(block_shard(name, 0, shards), name)
        i += 1
    return keys


async def train(ps: kc.Client, names: list[str], stop: asyncio.Event, steps: list[float]) -> None:
    grad = np.full(MiB // 4, 1e-6, np.float32)
    while not stop.is_set():
        t0 = time.monotonic()
        await ps.pull(names)
        await ps.push({n: grad for n in names})
        steps.append(time.monotonic() - t0)


def led_by(cluster: LocalCluster, node: int) -> list[int]:
    cmap = cluster.cluster_map() or {"shards": []}
    return [i for i, s in enumerate(cmap["shards"]) if s["leader"] == node]


async def one_model(procs: int, kills: int, shards: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvps-nodekill-") as tmp, \
            LocalCluster(Path(tmp), nodes=3, shards=shards, server=ServerConfig(procs=procs)) as cluster:
        cluster.start(timeout=120)
        cluster.wait_leaders_spread(60)
        probes = probe_keys(shards)
        records = []
        async with kc.Client(cluster.endpoints, token=cluster.token, seed=11, timeout=60) as ps:
            one = np.ones(1, np.float32)
            names = [f"model/{i}" for i in range(16)]
            for name in names:
                await ps.create(name, np.zeros(MiB // 4, np.float32), optimizer=kc.SGD(lr=0.01))
            for key in probes.values():
                await ps.create(key, np.zeros(1, np.float32))
                await ps.push({key: one})  # routes known before the first kill
            stop, steps = asyncio.Event(), []
            trainers = [asyncio.create_task(train(ps, names, stop, steps)) for _ in range(2)]
            try:
                for k in range(kills):
                    await asyncio.to_thread(wait_until, lambda: cluster.ready() and cluster.leaders_spread(),
                                            120, "every shard served, leaders spread")
                    await asyncio.to_thread(wait_until, lambda: len(steps) >= 3, 60, "training steps")
                    node = max(range(3), key=lambda n: len(led_by(cluster, n)))
                    led = led_by(cluster, node)
                    killed = time.monotonic()
                    cluster.kill_node(node)

                    async def first_commit(shard: int) -> float:
                        await ps.push({probes[shard]: one})
                        return time.monotonic() - killed
                    times = await asyncio.gather(*(first_commit(s) for s in led))
                    rec = {"kill": k, "node": node, "procs": procs,
                           "per_shard_s": {str(s): round(t, 3) for s, t in zip(led, times)}}
                    records.append(rec)
                    say(f"procs {procs} kill {k + 1}/{kills}: node {node} led {led}: "
                        + ", ".join(f"shard {s} {t:.2f}s" for s, t in zip(led, times)))
                    cluster.start_node(node)
                    steps.clear()
            finally:
                stop.set()
                await asyncio.gather(*trainers, return_exceptions=True)
        every = [t for r in records for t in r["per_shard_s"].values()]
        return {"procs": procs, "kills": records,
                "per_shard_p50_s": statistics.median(every) if every else None,
                "per_shard_max_s": max(every) if every else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--procs", default="0,1", help="process models to measure, e.g. 1 or 0,1")
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--out", default="node-kill-out")
    args = p.parse_args()
    results = [asyncio.run(one_model(int(m), args.kills, args.shards)) for m in args.procs.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "node_kill.json").write_text(json.dumps(results, indent=1))
    for r in results:
        say(f"procs {r['procs']}: every shard the killed node led served again: p50 "
            f"{r['per_shard_p50_s']:.2f} s, max {r['per_shard_max_s']:.2f} s "
            f"({sum(len(k['per_shard_s']) for k in r['kills'])} shard failovers in {len(r['kills'])} kills)")


if __name__ == "__main__":
    main()
