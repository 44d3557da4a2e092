"""``kvps demo --task ctr``: a click-through model trained on a local cluster while every shard's
leader is killed (``kvps.demo.ctr`` says what is trained; ``kvps.demo.run`` kills the leaders).

Three workers train item and user embeddings held in kvps tables and an MLP in a ``PSModule``.
At the end: the exactly-once checks of the digits demo (the step counter and every MLP
parameter's version equal the acknowledged steps), and the test AUC of the server's parameters
against the same training in one process without kvps or faults (and the truth's own AUC, the
ceiling).
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from kvps.demo.ctr import (
    COUNTER, PREFIX, QUICK, TABLES, CtrConfig, CtrData, auc, baseline, click_probability, ctr_worker,
    distinct_ids, make_data, make_model, predict,
)
from kvps.demo.run import Run, Workers, _plot, _train
from kvps.node.local import LocalCluster, wait_until

__all__ = ["main"]

TOLERANCE = 0.02  # AUC the faulty distributed run may lose against the baseline (staleness)
QUICK_TOLERANCE = 0.05  # ~60 steps: an under-trained model moves more with stale gradients


def _final_state(cluster: LocalCluster, cfg: CtrConfig,
                 data: CtrData) -> tuple[int, dict[str, int], float, dict[str, int]]:
    """(counter, {MLP key: version}, test AUC of the parameters and rows on the server, {table:
    rows stored})."""
    import kvps_client as kc
    from kvps_client.torch import EmbeddingBagCollection, SyncPSModule

    with kc.SyncClient(cluster.endpoints, token=cluster.token, seed=cfg.seed) as ps:
        counter, _ = ps.get(COUNTER, consistency="linearizable")
        specs = {f: cfg.table_spec(f) for f in TABLES}
        model = make_model(replace(cfg, seed=cfg.seed + 1), EmbeddingBagCollection(ps, specs))
        pm = SyncPSModule(model, ps, prefix=PREFIX, optimizer=kc.Adagrad(lr=cfg.mlp_lr))
        pm.pull()  # the server's MLP over these other initial weights; rows pulled by forward
        versions = {key: ps.describe(key, refresh=True)["version"] for key in pm.keys.values()}
        score = auc(predict(model, data[3], data[4]), data[5])
        rows = {info["key"]: int(info["rows"]) for info in ps.keys() if info["key"] in TABLES.values()}
    return int(counter[0]), versions, score, rows


def main(out: Path = Path("demo-out"), seed: int = 0, quick: bool = False,
         staleness: int | None = 4, max_rows_fraction: float | None = None, evict: str = "lfu",
         faults: bool = True) -> int:
    cfg = replace(QUICK if quick else CtrConfig(), seed=seed, staleness=staleness, evict=evict)
    shards = 2 if quick else 4
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    data = make_data(cfg)
    distinct = distinct_ids(data)
    if max_rows_fraction is not None:
        cfg = replace(cfg, caps=tuple(max(1, int(n * max_rows_fraction)) for n in distinct))
    truth = auc(click_probability(cfg, data[3], data[4]), data[5])
    print(f"training a CTR model (user and item embeddings of {cfg.dim} in kvps tables, row-wise Adagrad; "
          f"an MLP 48-32-1, Adagrad) on {cfg.train:,} synthetic impressions ({cfg.users} users, "
          f"{cfg.items} items): {cfg.workers} workers, {cfg.epochs} epochs, batch {cfg.batch}, "
          f"{'asynchronous' if staleness is None else f'bounded staleness {staleness}'}", flush=True)
    if cfg.caps is not None:
        print(f"tables capped at {max_rows_fraction:g} of the distinct ids trained on: users {cfg.caps[0]:,} "
              f"of {distinct[0]:,}, items {cfg.caps[1]:,} of {distinct[1]:,} ({evict} eviction); the "
              "baseline is unbounded", flush=True)
    arrays = {"users": data[0], "items": data[1], "clicks": data[2]}
    with tempfile.TemporaryDirectory(prefix="kvps-demo-") as tmp, \
            LocalCluster(Path(tmp), nodes=3, shards=shards) as cluster, \
            Workers(cluster, cfg, None, target=ctr_worker, arrays=arrays) as workers, \
            ThreadPoolExecutor(1) as side:
        print(cluster.describe(), flush=True)
        base = side.submit(baseline, cfg, data)  # while the nodes start and elect their leaders
        cluster.start(timeout=120)
        base_auc, base_losses = base.result()
        print(f"baseline (one process, no kvps, no faults): test AUC {base_auc:.4f} (the truth's own: "
              f"{truth:.4f})", flush=True)
        import kvps_client as kc
        with kc.SyncClient(cluster.endpoints, token=cluster.token, seed=seed) as ps:
            ps.create(COUNTER, np.zeros(1, np.float64))
        if not faults:
            print("no faults: no leader is killed in this run", flush=True)
        run = _train(cluster, workers, cfg, cfg.total_steps(), deadline_s=60 if quick else 300, kills=faults)
        wait_until(cluster.ready, 60, "every shard to serve")
        counter, versions, score, rows = _final_state(cluster, cfg, data)
        print("stopping the cluster ...", flush=True)
        with ThreadPoolExecutor(len(cluster.cfg.nodes)) as pool:
            list(pool.map(cluster.stop_node, [n.id for n in cluster.cfg.nodes]))
    summary = _summary(cfg, run, counter, versions, score, base_auc, truth, quick, time.monotonic() - started)
    summary.update(faults=faults, table_rows=rows, distinct_ids=dict(zip(("user", "item"), distinct)),
                   max_rows_fraction=max_rows_fraction)
    _plot(out / "loss.png", run, base_losses, window=15 if quick else 45,
          title="kvps demo: CTR model (embeddings in kvps tables) "
                + ("while every shard's leader is killed" if faults else "without faults"))
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    _print_summary(summary, out)
    return 0 if summary["ok"] else 1


def _summary(cfg: CtrConfig, run: Run, counter: int, versions: dict[str, int], score: float,
             base_auc: float, truth: float, quick: bool, elapsed: float) -> dict:
    acked = sum(run.acked.values())
    bad_versions = {k: v for k, v in versions.items() if v != acked}
    killed = sorted(k.shard for k in run.kills if k.serving_after is not None)
    tolerance = QUICK_TOLERANCE if quick else TOLERANCE
    ok = (counter == acked and not bad_versions and killed == list(range(len(killed)))
          and len(killed) == len(run.kills) and score >= base_auc - tolerance)
    return {"task": "ctr", "config": asdict(cfg), "acknowledged": acked, "counter": counter,
            "lost": max(0, acked - counter), "applied_twice": max(0, counter - acked),
            "param_versions": versions, "auc": score, "baseline_auc": base_auc, "truth_auc": truth,
            "tolerance": tolerance, "kills": [asdict(k) for k in run.kills], "train_s": run.seconds,
            "elapsed_s": elapsed, "ok": ok}


def _print_summary(s: dict, out: Path) -> None:
    print("\n=== kvps demo (ctr) summary ===")
    print(f"workers: {s['config']['workers']} processes   steps acknowledged: {s['acknowledged']} "
          f"in {s['train_s']:.0f} s   counter on the server: {s['counter']}")
    print(f"lost: {s['lost']}   applied twice: {s['applied_twice']}   MLP parameter versions: "
          f"{sorted(set(s['param_versions'].values()))} (each must equal the acknowledged steps)")
    for k in s["kills"]:
        print(f"kill -9 leader of shard {k['shard']} (node {k['node']}) at step {k['step']}: serving again "
              f"after {k['serving_after']:.2f} s, next step acknowledged after {k['next_step_after'] or 0:.2f} s")
    rows = ", ".join(f"{table} {n:,}" for table, n in sorted(s.get("table_rows", {}).items()))
    cap = s.get("max_rows_fraction")
    print(f"rows stored: {rows}" + (f" (capped at {cap:g} of the distinct ids)" if cap is not None else ""))
    print(f"test AUC: {s['auc']:.4f} with kvps{' and faults' if s.get('faults', True) else ', no faults'} vs {s['baseline_auc']:.4f} in one process without "
          f"faults ({s['auc'] - s['baseline_auc']:+.4f}; allowed -{s['tolerance']}); truth {s['truth_auc']:.4f}")
    print(f"loss curve: {out / 'loss.png'}   summary: {out / 'summary.json'}   elapsed: {s['elapsed_s']:.0f} s")
    print("result:", "OK" if s["ok"] else "FAILED")


if __name__ == "__main__":
    sys.exit(main())
