"""User snapshots of a >= 1 GiB model: write and restore throughput against dd on the same disk,
and training throughput while a snapshot is taken.

    .venv/bin/python benchmarks/snapshot_speed.py [--gib 1] [--out DIR] [--no-drop-caches]

A local cluster of 3 nodes x 4 shards x 3 replicas holds --gib GiB of float32 keys (64 MiB each,
SGD: no optimizer state, so the snapshot is the model). All replicas share this machine's disk,
so a snapshot writes 3 x the model and a restore reads 3 x the model: the peer is three `dd`
processes writing (conv=fsync) and then reading (page cache dropped first, as root) 1/3 of that
each, side by side in the same run. Reported: model bytes/s (what a user waits for) and disk
bytes/s (all replicas), each as a ratio of dd's disk bytes/s.

Write throughput is measured on a snapshot taken with nothing else running (no training, no log
compaction in flight); the restore, measured the same way, reads it back. Training throughput: one client steps (pull + push of a 16 MiB key) for --window seconds
without a snapshot, during a second snapshot of the whole model, and without again; the ratio is
during / mean of the two without. Leader changes during the run are counted (heartbeats must keep flowing while
the replicas write). Writes results.json and snapshot.png to --out.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

import kvps_client as kc
from kvps.bench.progress import say
from kvps.config import ServerConfig
from kvps.node.local import LocalCluster

MiB = 1 << 20
KEY_BYTES = 64 * MiB



def drop_caches(enabled: bool) -> bool:
    if not enabled or os.geteuid() != 0:
        return False
    subprocess.run(["sync"], check=True)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def dd_peer(root: Path, total: int, procs: int, drop: bool) -> dict:
    """``procs`` concurrent dd's writing (fsync) then reading ``total`` bytes in all."""
    each = total // procs
    count = each // (4 * MiB)
    files = [root / f"dd-{i}" for i in range(procs)]
    t0 = time.monotonic()
    ps = [subprocess.Popen(["dd", "if=/dev/zero", f"of={f}", "bs=4M", f"count={count}", "conv=fsync"],
                           stderr=subprocess.DEVNULL) for f in files]
    for p in ps:
        p.wait()
    write_s = time.monotonic() - t0
    dropped = drop_caches(drop)
    t0 = time.monotonic()
    ps = [subprocess.Popen(["dd", f"if={f}", "of=/dev/null", "bs=4M"], stderr=subprocess.DEVNULL)
          for f in files]
    for p in ps:
        p.wait()
    read_s = time.monotonic() - t0
    for f in files:
        f.unlink()
    nbytes = count * 4 * MiB * procs
    return {"bytes": nbytes, "write_s": write_s, "read_s": read_s, "write_Bps": nbytes / write_s,
            "read_Bps": nbytes / read_s, "cold_read": dropped}



def compactions(c: LocalCluster) -> list[dict]:
    """Every replica's log-compaction record (count, last duration and size)."""
    out = []
    cmap = c.cluster_map(timeout=5.0) or {"shards": []}
    for shard in cmap["shards"]:
        for r in shard["replicas"]:
            req = urllib.request.Request(r["data_url"] + "/v1/status",
                                         headers={"Authorization": f"Bearer {c.token}"})
            with urllib.request.urlopen(req, timeout=10) as resp:
                st = json.loads(resp.read())
            out.append({"shard": shard["id"], "node": r["node"], **(st.get("compactions") or {}),
                        "tick_stalls": st.get("tick_stalls")})
    return out


def wait_compactions_idle(c: LocalCluster, timeout: float = 180.0) -> None:
    """Until no replica is writing a log compaction (the 'nothing else running' measurements)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(x.get("started", 0) == x.get("succeeded", 0) + x.get("failed", 0) + x.get("discarded", 0)
               for x in compactions(c)):
            return
        time.sleep(0.2)
    say("  (a compaction is still running; measuring anyway)")


def leader_changes(c: LocalCluster) -> int:
    cmap = c.cluster_map(timeout=5.0) or {"shards": []}
    return sum(int(s.get("term") or 0) for s in cmap["shards"])


async def load_model(c: LocalCluster, gib: float) -> int:
    n = int(gib * 1024 * MiB // KEY_BYTES)
    async with kc.Client(c.endpoints, token=c.token, seed=0) as ps:
        rng = np.random.default_rng(0)
        for i in range(n):
            value = rng.standard_normal(KEY_BYTES // 4, dtype=np.float32).reshape(4096, 4096)
            await ps.create(f"model/{i}", value, optimizer=kc.SGD(lr=0.01))
            say(f"  loaded {i + 1}/{n} x 64 MiB")
        await ps.create("train/w", np.zeros((1024, 4096), np.float32), optimizer=kc.SGD(lr=0.01))
    return n * KEY_BYTES


class Trainer:
    """Steps (pull + push of train/w) in a thread; records the time of every step."""

    def __init__(self, c: LocalCluster) -> None:
        self.c = c
        self.times: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        grad = np.full((1024, 4096), 1e-3, np.float32)
        async with kc.Client(self.c.endpoints, token=self.c.token, seed=1) as ps:
            while not self.stop.is_set():
                await ps.pull(["train/w"])
                await ps.push({"train/w": grad})
                self.times.append(time.monotonic())

    def rate(self, start: float, end: float) -> float:
        return sum(1 for t in self.times if start <= t < end) / (end - start)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--window", type=float, default=6.0)
    ap.add_argument("--shards", type=int, default=4,
                    help="1 puts the whole model in one shard: its log compactions then write >= --gib")
    ap.add_argument("--out", default="bench-out/snapshot")
    ap.add_argument("--no-drop-caches", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    drop = not args.no_drop_caches
    results: dict = {"gib": args.gib}
    with tempfile.TemporaryDirectory(prefix="kvps-snapbench-", dir=str(out.resolve())) as tmp:
        root = Path(tmp)
        c = LocalCluster(root / "cluster", nodes=3, shards=args.shards, replicas=3,
                         server=ServerConfig(snapshot_hold=10.0))
        try:
            say(f"starting a 3-node cluster ({args.shards} shards x 3 replicas)")
            c.start(timeout=120)
            say(f"loading a {args.gib} GiB model")
            terms_load = leader_changes(c)
            model = asyncio.run(load_model(c, args.gib))
            results["model_bytes"] = model
            terms0 = leader_changes(c)
            results["log_compactions_during_load"] = compactions(c)
            results["leader_changes_during_load"] = terms0 - terms_load

            wait_compactions_idle(c)
            say("taking a snapshot with nothing else running (write throughput)")
            t_quiet = time.monotonic()
            snap = c.admin("POST", "/v1/snapshots", {"label": "bench-quiet"}, timeout=3600)
            snap_s = time.monotonic() - t_quiet
            say(f"  snapshot {snap['id']}: {snap['size'] / MiB:.0f} MiB per copy in {snap_s:.2f} s")

            trainer = Trainer(c)
            trainer.thread.start()
            while len(trainer.times) < 5:
                time.sleep(0.05)
            say(f"training without a snapshot for {args.window} s")
            t0 = time.monotonic()
            time.sleep(args.window)
            before = trainer.rate(t0, time.monotonic())

            say("taking a snapshot while training")
            t_snap = time.monotonic()
            busy = c.admin("POST", "/v1/snapshots", {"label": "bench-training"}, timeout=3600)
            busy_s = time.monotonic() - t_snap
            during = trainer.rate(t_snap, t_snap + busy_s)
            say(f"  snapshot {busy['id']}: {busy['size'] / MiB:.0f} MiB per copy in {busy_s:.2f} s")
            say(f"training without a snapshot for {args.window} s")
            t1 = time.monotonic()
            time.sleep(args.window)
            after = trainer.rate(t1, time.monotonic())
            trainer.stop.set()
            trainer.thread.join(30)
            terms1 = leader_changes(c)
            results["replicas_after_snapshot"] = compactions(c)

            say("restoring it (once no log compaction is running)")
            wait_compactions_idle(c)
            dropped = drop_caches(drop)
            t_restore = time.monotonic()
            c.admin("POST", f"/v1/snapshots/{snap['id']}/restore", timeout=3600)
            restore_s = time.monotonic() - t_restore
            disk = root / "cluster"
            say("dd on the same disk (3 writers with fsync, then 3 readers)")
            dd = dd_peer(disk, 3 * snap["size"], 3, drop)
        finally:
            c.stop()
            logs = out / "logs"  # the cluster's logs outlive its data (elections, compactions)
            shutil.rmtree(logs, ignore_errors=True)
            for log in (root / "cluster").glob("node-*/logs/*.log"):
                dest = logs / log.parent.parent.name / log.name
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(log, dest)

    copies = 3
    base = (before + after) / 2
    results.update({
        "snapshot": {"seconds": snap_s, "bytes_per_copy": snap["size"], "copies": copies,
                     "model_Bps": model / snap_s, "disk_Bps": copies * snap["size"] / snap_s},
        "snapshot_during_training": {"seconds": busy_s, "disk_Bps": copies * busy["size"] / busy_s},
        "restore": {"seconds": restore_s, "model_Bps": model / restore_s,
                    "disk_Bps": copies * snap["size"] / restore_s, "cold_read": dropped},
        "dd": dd,
        "training": {"steps_per_s_before": before, "steps_per_s_during": during,
                     "steps_per_s_after": after, "ratio_during_vs_without": during / base if base else None},
        "leader_changes_during_run": terms1 - terms0,
        "step_times": [round(t - t0, 3) for t in trainer.times],  # s since the first window began
        "snapshot_window": [round(t_snap - t0, 3), round(t_snap - t0 + busy_s, 3)],
    })
    results["ratio_vs_dd"] = {
        "snapshot_disk_write": results["snapshot"]["disk_Bps"] / dd["write_Bps"],
        "snapshot_model_write": results["snapshot"]["model_Bps"] / dd["write_Bps"],
        "restore_disk_read": results["restore"]["disk_Bps"] / dd["read_Bps"],
        "restore_model_read": results["restore"]["model_Bps"] / dd["read_Bps"],
    }
    (out / "results.json").write_text(json.dumps(results, indent=2))
    r, d = results, dd
    print(f"snapshot of a {model / 2**30:.2f} GiB model, 3 replicas on one disk: {snap_s:.2f} s, "
          f"{r['snapshot']['disk_Bps'] / 1e6:.0f} MB/s to disk ({r['snapshot']['model_Bps'] / 1e6:.0f} MB/s of model)"
          f" vs dd {d['write_Bps'] / 1e6:.0f} MB/s: ratio_vs_dd {r['ratio_vs_dd']['snapshot_disk_write']:.2f}"
          f" (model bytes: {r['ratio_vs_dd']['snapshot_model_write']:.2f})")
    print(f"restore: {restore_s:.2f} s, {r['restore']['disk_Bps'] / 1e6:.0f} MB/s from disk "
          f"({r['restore']['model_Bps'] / 1e6:.0f} MB/s of model){' cold cache' if dropped else ''}"
          f" vs dd {d['read_Bps'] / 1e6:.0f} MB/s: ratio_vs_dd {r['ratio_vs_dd']['restore_disk_read']:.2f}"
          f" (model bytes: {r['ratio_vs_dd']['restore_model_read']:.2f})")
    t = r["training"]
    print(f"snapshot while training: {busy_s:.2f} s, {r['snapshot_during_training']['disk_Bps'] / 1e6:.0f} MB/s to disk")
    print(f"training: {t['steps_per_s_before']:.2f} steps/s before, {t['steps_per_s_during']:.2f} during the "
          f"snapshot, {t['steps_per_s_after']:.2f} after: ratio {t['ratio_during_vs_without']:.2f}; "
          f"leader changes during the run: {r['leader_changes_during_run']}")
    big = max((x.get("last_bytes", 0) for x in results["log_compactions_during_load"]), default=0)
    secs = max((x.get("last_seconds", 0) for x in results["log_compactions_during_load"]), default=0)
    print(f"log compaction while loading: largest {big / 2**30:.2f} GiB written in up to {secs:.2f} s "
          f"off the tick thread; leader changes during the load: {results['leader_changes_during_load']}")
    after = results["replicas_after_snapshot"]
    print(f"log compactions during training: {sum(x.get('succeeded', 0) for x in after)} done, the last "
          f"{max(x.get('last_bytes', 0) for x in after) / 2**30:.2f} GiB each, written in up to "
          f"{max(x.get('last_seconds', 0) for x in after):.1f} s off the tick thread")
    stalls = [x["tick_stalls"] for x in after if x.get("tick_stalls")]
    if stalls:
        print(f"Raft tick thread: longest gap {max(s['max_seconds'] for s in stalls):.3f} s, "
              f"gaps over 100 ms: {sum(s['over_100ms'] for s in stalls)} (all replicas, whole run)")
    try:
        _plot(results, out / "snapshot.png")
    except ImportError:
        say("matplotlib not installed: no plot")
    return 0


def _plot(r: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    labels = ["snapshot write", "restore read"]
    kv = [r["snapshot"]["disk_Bps"] / 1e6, r["restore"]["disk_Bps"] / 1e6]
    dd = [r["dd"]["write_Bps"] / 1e6, r["dd"]["read_Bps"] / 1e6]
    x = np.arange(2)
    a.bar(x - 0.2, kv, 0.4, label="kvps (3 replicas)")
    a.bar(x + 0.2, dd, 0.4, label="dd (3 processes)")
    a.set_xticks(x, labels)
    a.set_ylabel("MB/s to / from disk")
    a.legend()
    steps = np.array(r["step_times"])
    if len(steps) > 1:
        b.plot(steps[1:], 1.0 / np.maximum(np.diff(steps), 1e-3), ".", ms=3)
        b.axvspan(*r["snapshot_window"], color="orange", alpha=0.3, label="snapshot")
        b.set_xlabel("s")
        b.set_ylabel("training steps/s (1 / step time)")
        b.legend()
    fig.suptitle(f"kvps snapshot of a {r['model_bytes'] / 2**30:.1f} GiB model")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    raise SystemExit(main())
