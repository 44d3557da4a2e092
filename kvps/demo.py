"""``kvps demo``: a local cluster, two training workers, and a shard leader killed mid-run.

Each worker process fits a linear model ``y = X @ w`` on its own shard of synthetic data through
``kvps_client.SyncClient`` (pull w, compute the mean-squared-error gradient, push it; the leader
applies SGD), and adds 1 to an exactly-once ``steps`` counter per step. Half-way through, the
demo kills the leader of the counter's shard with SIGKILL. At the end it checks that every
acknowledged push is counted exactly once and that the loss still fell.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvps.local import LocalCluster, wait_until
from kvps.placement import block_shard

FEATURES = 256
ROWS = 2048
STEPS = 60
WORKERS = 2


def _data(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    w_true = rng.standard_normal(FEATURES).astype(np.float32)
    X = rng.standard_normal((ROWS, FEATURES)).astype(np.float32)    # (rows, features)
    y = X @ w_true + 0.01 * rng.standard_normal(ROWS).astype(np.float32)
    return X, y, w_true


def _worker(rank: int, endpoints: list[str], token: str, seed: int, out: mp.Queue) -> None:
    import kvps_client as kc

    X, y, _ = _data(seed)
    part = slice(rank * ROWS // WORKERS, (rank + 1) * ROWS // WORKERS)
    X, y = X[part], y[part]
    rng = np.random.default_rng(seed + 100 + rank)
    acked, losses = 0, []
    with kc.SyncClient(endpoints, token=token, seed=seed + rank, timeout=60) as ps:
        for step in range(STEPS):
            started = time.monotonic()
            w = ps.pull(["w"])["w"]
            idx = rng.integers(0, len(y), 128)
            err = X[idx] @ w - y[idx]                                # (batch,)
            grad = (2.0 / len(idx)) * (X[idx].T @ err)               # (features,)
            ps.push({"w": grad.astype(np.float32), "steps": np.ones(1, np.float32)})
            acked += 1
            losses.append(float(np.mean((X @ w - y) ** 2)))
            out.put(("step", rank, step, losses[-1], started, time.monotonic()))
    out.put(("done", rank, acked, losses))


def main(out: Path = Path("demo-out"), seed: int = 0) -> int:
    import kvps_client as kc

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvps-demo-") as tmp, \
            LocalCluster(Path(tmp), nodes=3, shards=4) as cluster:
        print(cluster.describe(), flush=True)
        print("waiting for every shard to elect a leader ...", flush=True)
        cluster.start(timeout=120)
        with kc.SyncClient(cluster.endpoints, token=cluster.token, seed=seed) as ps:
            ps.create("w", np.zeros(FEATURES, np.float32), optimizer=kc.SGD(lr=0.05))
            ps.create("steps", np.zeros(1, np.float32))
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        procs = [ctx.Process(target=_worker, args=(r, cluster.endpoints, cluster.token, seed, queue))
                 for r in range(WORKERS)]
        for p in procs:
            p.start()
        shard = block_shard("steps", 0, cluster.cfg.shards)
        results, steps_seen, kill = {}, 0, None
        try:
            while len(results) < WORKERS:
                msg = queue.get(timeout=120)
                if msg[0] == "step":
                    steps_seen += 1
                    if steps_seen % 20 == 0:
                        print(f"  {steps_seen:4d}/{STEPS * WORKERS} steps  loss {msg[3]:.4f}", flush=True)
                    if kill is None and steps_seen >= STEPS * WORKERS // 2:
                        leader = cluster.leader(shard)
                        kill = {"node": leader["node"], "pid": leader["pid"], "at": time.monotonic(),
                                "step": steps_seen}
                        cluster.kill_pid(leader["pid"], signal.SIGKILL)
                        print(f"  >>> kill -9 leader of shard {shard} (node {leader['node']}, "
                              f"pid {leader['pid']})", flush=True)
                    elif kill is not None and "resumed" not in kill and msg[4] > kill["at"]:
                        kill["resumed"] = msg[5] - kill["at"]  # first step begun after the kill
                else:
                    results[msg[1]] = msg
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
        wait_until(cluster.ready, 60, "the cluster to heal")
        with kc.SyncClient(cluster.endpoints, token=cluster.token, seed=seed) as ps:
            counter, version = ps.get("steps")
            w = ps.pull(["w"])["w"]
        X, y, w_true = _data(seed)
        acked = sum(r[2] for r in results.values())
        first_loss = float(np.mean(y ** 2))
        final_loss = float(np.mean((X @ w - y) ** 2))
        lost = max(0, acked - int(counter[0]))
        twice = max(0, int(counter[0]) - acked)
        print("\n=== kvps demo summary ===")
        print(f"workers: {WORKERS}   steps acknowledged: {acked}   counter on the server: {int(counter[0])}")
        print(f"lost: {lost}   applied twice: {twice}")
        if kill is not None:
            print(f"leader of shard {shard} killed at step {kill['step']}; the next step was "
                  f"acknowledged {kill.get('resumed', float('nan')):.2f} s after the kill")
        print(f"loss: {first_loss:.3f} at start -> {final_loss:.4f} at the end "
              f"(|w - w_true| = {np.linalg.norm(w - w_true):.3f})")
        ok = lost == 0 and twice == 0 and final_loss < first_loss / 10
        summary = {"workers": WORKERS, "acknowledged": acked, "counter": int(counter[0]), "lost": lost,
                   "applied_twice": twice, "kill": kill, "first_loss": first_loss,
                   "final_loss": final_loss, "ok": ok}
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        print("result:", "OK" if ok else "FAILED")
        print("stopping the cluster ...", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
