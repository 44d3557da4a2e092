"""Moving one shard replica that holds --mb MiB while training pushes stream (kvps/rebalance.py).

    .venv/bin/python benchmarks/move_replica.py [--mb 256] [--seconds 8] [--workers 4] [--leader]
                                                [--out bench-out]

Starts a local cluster of 4 nodes hosting ONE shard (3 replicas on nodes 0-2, node 3 spare),
fills the shard with --mb MiB of 1 MiB dense keys, then runs --workers push loops (1 MiB
gradients, Add optimizer, onto 8 training keys) and measures:
  1. pushes/s for --seconds before the move;
  2. the move of one replica (a follower's, or the leader's with --leader) to node 3: its time,
     phase by phase (place, add, catch_up, transfer, remove, retire), and pushes/s during it;
  3. that nothing was lost or applied twice (every training key's version = pushes acknowledged
     for it) and that the final replicas' state hashes agree.
Prints one line per figure and writes move_replica.json into --out. Numbers are for this machine
only; compare ratios, not absolutes.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import kvps_client as kc
from kvps.bench.progress import say
from kvps.node.local import LocalCluster, wait_until

MiB = 1 << 20
TRAIN_KEYS = 8




def move(cluster: LocalCluster, shard: int, source: int, target: int) -> dict:
    """Queue the move with the metadata group's rebalancer and wait for its report."""
    done = cluster.admin("GET", "/v1/meta")["rebalance"]["moves_done"]
    cluster.admin("POST", "/v1/moves", {"shard": shard, "source": source, "target": target})
    rebalance = wait_until(lambda: (lambda r: r["moves_done"] > done and r["moving"] is None and r)(
        cluster.admin("GET", "/v1/meta")["rebalance"]), 600, "the move", period=0.02)
    return rebalance["last"]



async def fill(ps: kc.Client, mb: int) -> None:
    rng = np.random.default_rng(0)
    sem = asyncio.Semaphore(4)

    async def one(i: int) -> None:
        async with sem:
            await ps.create(f"state/{i}", rng.standard_normal(MiB // 4).astype(np.float32))

    await asyncio.gather(*(one(i) for i in range(mb)))


async def run(args: argparse.Namespace, cluster: LocalCluster) -> dict:
    cfg = cluster.cfg
    async with kc.Client(cluster.endpoints, token=cluster.token, seed=0, timeout=120) as ps:
        t0 = time.monotonic()
        await fill(ps, args.mb)
        say(f"filled the shard with {args.mb} MiB in {time.monotonic() - t0:.1f} s")
        names = [f"train/{i}" for i in range(TRAIN_KEYS)]
        for name in names:
            await ps.create(name, np.zeros(MiB // 4, np.float32))
        grad = np.ones(MiB // 4, np.float32)  # 1 MiB
        acks: list[float] = []
        per_key = [0] * TRAIN_KEYS
        stop = asyncio.Event()

        async def worker(w: int) -> None:
            n = w
            while not stop.is_set():
                await ps.push({names[n % TRAIN_KEYS]: grad})
                per_key[n % TRAIN_KEYS] += 1
                acks.append(time.monotonic())
                n += args.workers

        def rate(a: float, b: float) -> float:
            return sum(1 for t in acks if a <= t < b) / (b - a)

        workers = [asyncio.create_task(worker(w)) for w in range(args.workers)]
        try:
            await asyncio.sleep(1.0)  # warm up (measurement windows are by ack time)
            before_start = time.monotonic()
            await asyncio.sleep(args.seconds)
            before_end = time.monotonic()
            leader = wait_until(lambda: cluster.leader(0), 30, "a leader")["node"]
            source = leader if args.leader else next(n for n in cfg.replica_nodes(0) if n != leader)
            await asyncio.to_thread(cluster.admin, "POST", "/v1/rebalance", {"auto": False})
            say(f"moving the replica on node {source} ({'leader' if args.leader else 'follower'})"
                     " to node 3 ...")
            move_start = time.monotonic()
            report = await asyncio.to_thread(move, cluster, 0, source, 3)
            move_end = time.monotonic()
            await asyncio.sleep(args.seconds)
            after_end = time.monotonic()
        finally:
            stop.set()
            await asyncio.gather(*workers, return_exceptions=True)
        versions = [(await ps.get(name))[1] for name in names]
        final = [n for n in (0, 1, 2, 3) if n != source]
        await asyncio.to_thread(wait_until, lambda: len({cluster.state_hash(n, 0, timeout=10) for n in final}) == 1
                                and None not in {cluster.state_hash(n, 0, timeout=10) for n in final}, 120,
                                "the final replicas to agree")
        before = rate(before_start, before_end)
        during = rate(move_start, move_end)
        after = rate(move_end, after_end)
        return {
            "mb": args.mb, "workers": args.workers, "push_bytes": MiB, "moved": "leader" if args.leader
            else "follower", "source": source, "target": 3, "move": report,
            "pushes_per_s": {"before": round(before, 1), "during": round(during, 1),
                             "after": round(after, 1)},
            "during_vs_before": round(during / before, 3) if before else None,
            "acknowledged": len(acks), "lost": sum(per_key) - sum(min(p, v) for p, v in zip(per_key, versions)),
            "applied_twice": sum(max(0, v - p) for p, v in zip(per_key, versions)),
            "versions_match": versions == per_key,
        }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=256, help="MiB of state in the shard")
    p.add_argument("--seconds", type=float, default=8.0, help="measurement window before/after")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--leader", action="store_true", help="move the leader's replica")
    p.add_argument("--out", default="bench-out")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvps-move-") as tmp, \
            LocalCluster(Path(tmp), nodes=4, shards=1, replicas=3) as cluster:
        cluster.start(timeout=120)
        res = asyncio.run(run(args, cluster))
    m = res["move"]
    order = ("place", "add", "catch_up", "transfer", "remove", "retire")
    phases = ", ".join(f"{k} {m['phases'][k]:.2f}s" for k in order if k in m["phases"])
    print(f"move: one {res['mb']} MiB shard replica ({res['moved']}) from node {res['source']} "
          f"to node 3 in {m['seconds']:.2f} s ({phases})")
    pps = res["pushes_per_s"]
    print(f"training: {pps['before']:.1f} pushes/s of 1 MiB before the move, {pps['during']:.1f} "
          f"during it ({100 * (res['during_vs_before'] or 0):.0f} % of before), {pps['after']:.1f} after")
    print(f"exactly-once: {res['acknowledged']} pushes acknowledged, lost {res['lost']}, applied twice "
          f"{res['applied_twice']}; final replicas' state hashes agree")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "move_replica.json").write_text(json.dumps(res, indent=2) + "\n")
    print(f"json: {out / 'move_replica.json'}")
    return 0 if res["versions_match"] else 1


if __name__ == "__main__":
    sys.exit(main())
