"""The journal fsync policies side by side: replicated push throughput and latency, and raw disk cost.

    .venv/bin/python benchmarks/fsync_policy.py [--seconds 4] [--inflight 1,8] [--rounds 1]
                                                [--dir DIR] [--out results.json]

For each ``raft.fsync`` policy (never, interval, always) starts a local cluster of 3 nodes hosting
ONE shard (every push goes through one Raft group), then from this separate client process pushes
64 KiB and then 1 MiB gradients to distinct keys for --seconds with each --inflight number of
pushes outstanding, and reports committed MB/s and push latency percentiles (a push returns once
its entry is committed by a majority and applied on the leader). With 1 in flight every push is
its own log entry (one fdatasync per replica under ``always``); with more, the leader merges
waiting pushes into one entry. With --rounds > 1 the policy order rotates each round and the
median round (by MB/s) is reported; every round is in the JSON.

Two more columns: "disk" is what the device under --dir wrote during the window per MB pushed
(from /proc/diskstats: every writer on the device counts, including the write-back of earlier
rounds): about 3 (three journals) when the policy syncs; under ``never`` the kernel writes dirty
pages back ~30 s later, so a short window misses a cost that a long-running cluster pays all the
same, in the background. "cpu" is the CPU time of the cluster's processes (nodes and replicas,
user + system) per MB pushed, less disturbed by other work on the machine than MB/s (the kernel's
write-back threads are not in it).

Two raw lines: write + fdatasync of 64 KiB and 1 MiB blocks in --dir (a dd oflag=dsync
equivalent), and the CPU time of one journal append of a 1 MiB command, pysyncobj's FileJournal
against ours (policy never: no fsync). The clusters live under --dir (default: the system's temp
dir): point it at the disk the journals would use; tmpfs makes every fsync free. Numbers are for
this machine only; compare ratios.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import kvps_client as kc
from kvps.bench.progress import say
from kvps.config import FSYNC_POLICIES, RaftConfig
from kvps.node.local import LocalCluster

KiB = 1 << 10
MiB = 1 << 20
SIZES = (64 * KiB, MiB)



def raw_fdatasync(directory: Path, size: int, seconds: float = 1.0) -> dict:
    """write(size) + fdatasync in a loop, like ``dd bs=size oflag=dsync``."""
    path = directory / f"fdatasync-probe-{size}"
    block = os.urandom(size)
    times = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline or len(times) < 20:
            t0 = time.perf_counter()
            os.write(fd, block)
            os.fdatasync(fd)
            times.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
        path.unlink()
    times.sort()
    return {"block_bytes": size, "writes": len(times),
            "mb_per_s": round(size * len(times) / sum(times) / MiB, 1),
            "ms_p50": round(1000 * times[len(times) // 2], 3),
            "ms_p99": round(1000 * times[int(len(times) * 0.99)], 3)}


def journal_add_cpu(directory: Path, size: int = MiB, count: int = 200) -> dict:
    """CPU seconds per append (no fsync), pysyncobj's FileJournal vs kvps's RaftJournal."""
    from pysyncobj.journal import FileJournal

    from kvps.raft.journal import RaftJournal

    command = os.urandom(size)
    out = {}
    for name, make in (("FileJournal", lambda p: FileJournal(str(p))),
                       ("RaftJournal", lambda p: RaftJournal(p, fsync="never"))):
        path = directory / f"journal-probe-{name}"
        journal = make(path)
        t0 = time.process_time()
        for i in range(count):
            journal.add(command, i + 1, 1)
        out[name] = round(1000 * (time.process_time() - t0) / count, 3)
        journal._destroy()
        for leftover in directory.glob(f"journal-probe-{name}*"):
            leftover.unlink()
    return {"command_bytes": size, "cpu_ms_per_add": out}


def sectors_written(path: Path) -> int | None:
    """Sectors (512 bytes) the block device holding ``path`` has written, or None if unknown."""
    dev = os.stat(path).st_dev
    try:
        with open("/proc/diskstats") as f:
            for line in f:
                fields = line.split()
                if (int(fields[0]), int(fields[1])) == (os.major(dev), os.minor(dev)):
                    return int(fields[9])
    except (OSError, ValueError, IndexError):
        pass
    return None


def cluster_cpu_seconds(cluster: LocalCluster) -> float:
    """user + system CPU seconds of the cluster's node processes and all their descendants."""
    parent: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) "
        pid = int(stat.parent.name)
        parent[pid] = int(fields[1])
        ticks[pid] = int(fields[11]) + int(fields[12])  # utime, stime
    roots = {p.pid for p in cluster.procs.values()}
    total = 0
    for pid, t in ticks.items():
        p = pid
        while p > 1 and p not in roots:
            p = parent.get(p, 0)
        if p in roots:
            total += t
    return total / os.sysconf("SC_CLK_TCK")


async def pushes(cluster: LocalCluster, size: int, seconds: float, inflight: int, keys: int) -> dict:
    async with kc.Client(cluster.endpoints, token=cluster.token, seed=0) as ps:
        grad = np.random.default_rng(0).standard_normal(size // 4).astype(np.float32)
        names = [f"bench/{size}/{i}" for i in range(keys)]
        for name in names:
            await ps.create(name, np.zeros(size // 4, np.float32))
        for name in names[:inflight]:  # warm up: connections, leader, first appends
            await ps.push({name: grad})
        latencies: list[float] = []
        sectors = sectors_written(cluster.data_dir)
        cpu = cluster_cpu_seconds(cluster)
        deadline = time.monotonic() + seconds
        start = time.monotonic()

        async def pusher(i: int) -> None:
            n = i
            while time.monotonic() < deadline:
                t0 = time.monotonic()
                await ps.push({names[n % keys]: grad})
                latencies.append(time.monotonic() - t0)
                n += inflight

        await asyncio.gather(*(pusher(i) for i in range(inflight)))
        elapsed = time.monotonic() - start
        after = sectors_written(cluster.data_dir)
        cpu = cluster_cpu_seconds(cluster) - cpu
    lat = sorted(latencies)
    pushed_mb = len(lat) * size / MiB
    disk = None if sectors is None or after is None else round((after - sectors) * 512 / MiB / pushed_mb, 2)
    return {"push_bytes": size, "pushes": len(lat), "seconds": round(elapsed, 2),
            "inflight": inflight, "mb_per_s": round(len(lat) * size / MiB / elapsed, 1),
            "latency_ms_p50": round(1000 * lat[len(lat) // 2], 2),
            "latency_ms_p99": round(1000 * lat[int(len(lat) * 0.99)], 2), "disk_mb_per_mb": disk,
            "cpu_ms_per_mb": round(1000 * cpu / pushed_mb, 1)}


def run_policy(root: Path, policy: str, args: argparse.Namespace) -> dict:
    with LocalCluster(root / f"cluster-{policy}", nodes=3, shards=1,
                      raft=RaftConfig(fsync=policy)) as cluster:
        try:
            cluster.start(timeout=90)
        except TimeoutError:
            for log in sorted(cluster.data_dir.glob("node-*/logs/*.log")):
                say(f"----- {log.relative_to(cluster.data_dir)} -----\n" +
                         "\n".join(log.read_text(errors="replace").splitlines()[-15:]))
            raise
        out = {}
        for size in SIZES:
            for inflight in args.inflight:
                r = asyncio.run(pushes(cluster, size, args.seconds, inflight, args.keys))
                out[f"{size}/{inflight}"] = r
                say(f"  {policy:8s} {size // KiB:5d} KiB x{inflight}: {r['mb_per_s']:7.1f} MB/s  "
                         f"p50 {r['latency_ms_p50']:7.2f} ms  p99 {r['latency_ms_p99']:7.2f} ms  "
                         f"disk {r['disk_mb_per_mb']}  cpu {r['cpu_ms_per_mb']} ms/MB")
        return out


def filesystem(path: Path) -> str:
    try:
        return subprocess.run(["df", "-T", str(path)], capture_output=True, text=True,
                              check=True).stdout.splitlines()[1].split()[1]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=4.0, help="measuring window per size and inflight")
    ap.add_argument("--inflight", type=lambda t: [int(x) for x in t.split(",")], default=[1, 8],
                    help="pushes outstanding, comma-separated (default 1,8)")
    ap.add_argument("--keys", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--dir", default=None, help="where the clusters' journals live")
    ap.add_argument("--out", default=None, help="write results.json here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvps-fsync-", dir=args.dir) as tmp:
        root = Path(tmp)
        fs = filesystem(root)
        raw = [raw_fdatasync(root, size) for size in SIZES]
        adds = journal_add_cpu(root)
        rounds: dict[str, list[dict]] = {p: [] for p in FSYNC_POLICIES}
        for r in range(args.rounds):
            order = FSYNC_POLICIES[r % 3:] + FSYNC_POLICIES[:r % 3]
            for policy in order:
                say(f"round {r + 1}/{args.rounds}: fsync={policy}")
                rounds[policy].append(run_policy(root / f"r{r}", policy, args))
    results = {"filesystem": fs, "raw_fdatasync": raw, "journal_add": adds, "seconds": args.seconds,
               "rounds": args.rounds, "median": {}, "all_rounds": rounds}
    cases = [f"{size}/{inflight}" for size in SIZES for inflight in args.inflight]
    for policy, runs in rounds.items():
        results["median"][policy] = {}
        for case in cases:
            by_rate = sorted((run[case] for run in runs), key=lambda x: x["mb_per_s"])
            results["median"][policy][case] = by_rate[len(by_rate) // 2]
    print(f"disk ({fs}), write + fdatasync per block: " + "; ".join(
        f"{r['block_bytes'] // KiB} KiB {r['mb_per_s']} MB/s, p50 {r['ms_p50']} ms, p99 {r['ms_p99']} ms"
        for r in raw))
    print("journal append of a 1 MiB command, CPU per add (no fsync): " + ", ".join(
        f"{name} {ms} ms" for name, ms in adds["cpu_ms_per_add"].items()))
    print(f"replicated pushes, 3 replicas, 1 shard, {args.seconds:g} s per case"
          f"{f', median of {args.rounds} rounds' if args.rounds > 1 else ''}:")
    print(f"  {'push':>8s}{'inflight':>9s}  " + "".join(f"{p + ': MB/s, p50/p99 ms, disk, cpu':>44s}"
                                                     for p in FSYNC_POLICIES))
    for case in cases:
        size, inflight = (int(x) for x in case.split("/"))
        cells = []
        for policy in FSYNC_POLICIES:
            r = results["median"][policy][case]
            cells.append(f"{r['mb_per_s']:.1f}, {r['latency_ms_p50']:.1f} / {r['latency_ms_p99']:.1f}, "
                         f"{r['disk_mb_per_mb']}, {r['cpu_ms_per_mb']}")
        print(f"  {size // KiB:>4d} KiB{inflight:>9d}  " + "".join(f"{c:>44s}" for c in cells))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
