"""Incremental, compressed pulls through a real cluster (issue: kvps/delta).

    .venv/bin/python benchmarks/pull_delta.py [--rows 1000000] [--out results.json]

(a) a 64 MB dense model (64 keys x 1 MiB, float32, weights ~N(0, 0.05)) pulled after one SGD step
    (lr x grad ~ 1e-4, i.e. weights move ~0.2 %): bytes on the wire and pull time, full pull
    (a client without deltas) vs incremental (XOR delta + shuffle/lz4), and the delta codec's own
    encode/decode speed on the same data;
(b) a 1,000,000 x 64 float32 embedding table, 1 % of rows pushed: bytes of an incremental pull of
    every row vs the table's size.
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
from kvps.delta import frame
from kvps.delta.xor import xor_delta
from kvps.node.local import LocalCluster

MiB = 1 << 20



async def dense(cluster: LocalCluster) -> dict:
    rng = np.random.default_rng(0)
    names = [f"m/{i}" for i in range(64)]
    weights = {n: (rng.standard_normal(MiB // 4) * 0.05).astype(np.float32) for n in names}
    async with kc.Client(cluster.endpoints, token=cluster.token, seed=0, deltas=True) as inc, \
            kc.Client(cluster.endpoints, token=cluster.token, seed=1, deltas=False) as full:
        for n, w in weights.items():
            await inc.create(n, w, optimizer=kc.SGD(lr=1e-4))
        await inc.pull(names)
        await full.pull(names)
        grads = {n: rng.standard_normal(MiB // 4).astype(np.float32) for n in names}
        await inc.push(grads)
        t0, b0 = time.perf_counter(), full.stats.bytes_received
        want = await full.pull(names)
        full_s, full_bytes = time.perf_counter() - t0, full.stats.bytes_received - b0
        t0, b0 = time.perf_counter(), inc.stats.bytes_received
        got = await inc.pull(names)
        inc_s, inc_bytes = time.perf_counter() - t0, inc.stats.bytes_received - b0
        exact = all(got[n].tobytes() == want[n].tobytes() for n in names)
    new = {n: (weights[n] - np.float32(1e-4) * grads[n]).astype(np.float32) for n in names}
    deltas = [xor_delta(new[n], weights[n]) for n in names]
    t0 = time.perf_counter()
    encoded = [frame.encode(frame.KIND_RESPONSE, {}, [d], codec="shuffle-lz4") for d in deltas]
    enc_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for e in encoded:
        frame.decode(e)
    dec_s = time.perf_counter() - t0
    raw = 64 * MiB
    return {"model_bytes": raw, "full_pull_bytes": full_bytes, "full_pull_s": round(full_s, 3),
            "incremental_pull_bytes": inc_bytes, "incremental_pull_s": round(inc_s, 3),
            "bytes_ratio_full_over_incremental": round(full_bytes / inc_bytes, 3),
            "bit_exact": exact,
            "delta_codec_encode_mb_s": round(raw / MiB / enc_s, 1),
            "delta_codec_decode_mb_s": round(raw / MiB / dec_s, 1)}


async def sparse(cluster: LocalCluster, rows: int, dim: int = 64) -> dict:
    async with kc.Client(cluster.endpoints, token=cluster.token, seed=2, timeout=300,
                         request_timeout=120) as ps:
        await ps.create_table("emb", dim=dim, optimizer=kc.SGD(lr=0.1), init=kc.Normal(std=0.01, seed=0))
        ids = np.arange(rows, dtype=np.int64)
        t0, b0 = time.perf_counter(), ps.stats.bytes_received
        await ps.pull_rows("emb", ids)
        first_s, first_bytes = time.perf_counter() - t0, ps.stats.bytes_received - b0
        touched = np.random.default_rng(3).choice(rows, rows // 100, replace=False)
        await ps.push_rows("emb", touched, np.ones((len(touched), dim), np.float32))
        t0, b0, s0 = time.perf_counter(), ps.stats.bytes_received, ps.stats.bytes_sent
        await ps.pull_rows("emb", ids)
        inc_s = time.perf_counter() - t0
        inc_bytes, sent = ps.stats.bytes_received - b0, ps.stats.bytes_sent - s0
    table = rows * dim * 4
    return {"table_bytes": table, "touched_rows": int(len(touched)),
            "first_pull_bytes": first_bytes, "first_pull_s": round(first_s, 2),
            "incremental_pull_bytes_received": inc_bytes, "incremental_pull_bytes_sent": sent,
            "incremental_pull_s": round(inc_s, 2),
            "incremental_fraction_of_table": round(inc_bytes / table, 4),
            "incremental_fraction_both_directions": round((inc_bytes + sent) / table, 4)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--out")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvps-delta-") as tmp, \
            LocalCluster(Path(tmp), nodes=3, shards=4) as cluster:
        say("starting a 3-node, 4-shard cluster ...")
        cluster.start(timeout=90)
        say("(a) 64 MB dense model, one SGD step ...")
        a = asyncio.run(dense(cluster))
        say(f"(b) {args.rows:,} x 64 table, 1 % of rows touched ...")
        b = asyncio.run(sparse(cluster, args.rows))
    print(f"(a) 64 MB model after one SGD step: full pull {a['full_pull_bytes'] / MiB:.1f} MiB in "
          f"{a['full_pull_s']} s; incremental {a['incremental_pull_bytes'] / MiB:.1f} MiB in "
          f"{a['incremental_pull_s']} s -> {a['bytes_ratio_full_over_incremental']}x fewer bytes, "
          f"bit-exact {a['bit_exact']}; delta codec {a['delta_codec_encode_mb_s']} MB/s encode, "
          f"{a['delta_codec_decode_mb_s']} MB/s decode")
    print(f"(b) {args.rows:,} x 64 table, {b['touched_rows']:,} rows touched: incremental pull received "
          f"{b['incremental_pull_bytes_received'] / MiB:.2f} MiB = {100 * b['incremental_fraction_of_table']:.2f} % "
          f"of the table ({100 * b['incremental_fraction_both_directions']:.2f} % counting the request); "
          f"first full pull {b['first_pull_bytes'] / MiB:.0f} MiB in {b['first_pull_s']} s")
    if args.out:
        Path(args.out).write_text(json.dumps({"dense": a, "sparse": b}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
