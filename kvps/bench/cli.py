"""``kvps bench [--quick] [--out DIR]``: kvps against Redis and a PyTorch RPC server, side by side.

Sections (``--only b1,b3`` picks some):
  B1  parameter-server workload: workers pull the whole model and push gradients, repeatedly
      (kvps vs Redis primary + 2 replicas with WAIT 2 vs the unreplicated PyTorch RPC server vs
      a single-process in-memory baseline);
  B2  raw replicated write throughput by payload size, one writer (kvps vs Redis);
  B3  failover under load: kill -9 of shard leaders, kill -> first commit and the training stall;
  B4  pulls: full vs incremental, dense and sparse changes, bytes and time;
  B5  the machine's limits in the same run: loopback TCP and memcpy bytes/s;
  B6  sparse rows: Zipf-distributed embedding ids pulled and pushed, rows/s (kvps vs Redis
      hash fields with HMGET/HSET + WAIT 2 vs the RPC server holding the table);
  B7  many small keys: 10,000 × 1 KiB created, then pulled all + pushed all (kvps vs Redis
      pipelined GET / SET + WAIT 2).

Writes DIR/results.json (every figure; ratios under ``ratio_vs_<peer>``), DIR/results.md (tables)
and DIR/*.png. A peer that cannot run (no redis-server and no way to install it, no torch RPC)
is skipped with one line saying why; the rest still runs.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kvps.bench.plan import PLANS, SECTIONS, SYSTEMS, with_overrides
from kvps.bench.progress import Progress

__all__ = ["build_parser", "main"]


def _csv(allowed: tuple[str, ...]):
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(t.strip().lower() for t in text.split(",") if t.strip())
        bad = [t for t in items if t not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(bad)} (choose from {', '.join(allowed)})")
        return items
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvps bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a run of a few minutes (shorter windows, fewer kills)")
    p.add_argument("--plan", choices=sorted(PLANS), default=None,
                   help="full (default), quick (= --quick) or tiny (seconds; for tests)")
    p.add_argument("--out", default="bench-out", help="output directory (default: bench-out)")
    p.add_argument("--only", type=_csv(SECTIONS), default=SECTIONS, help="sections, e.g. b1,b2")
    p.add_argument("--skip", type=_csv(SYSTEMS), default=(), help="systems to leave out, e.g. rpc")
    p.add_argument("--no-install", action="store_true",
                   help="never apt-get install redis-server (skip the Redis peer when it is missing)")
    p.add_argument("--workers", type=int, default=None, help="B1 workers (default 4)")
    p.add_argument("--seconds", type=float, default=None, help="B1 measuring window per system")
    p.add_argument("--kills", type=int, default=None, help="B3 leader kills")
    p.add_argument("--shards", type=int, default=None, help="kvps cluster shards (default 8)")
    p.add_argument("--fsync", choices=("never", "interval", "always"), default=None,
                   help="kvps journal fsync policy (default interval, kvps's own default)")
    p.add_argument("--procs", type=int, choices=(0, 1), default=None,
                   help="where the kvps nodes run their replicas (0: a process per replica, 1: in "
                        "the node's process); B1 also measures the other one")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    plan = PLANS[args.plan or ("quick" if args.quick else "full")]
    plan = with_overrides(plan, workers=args.workers, b1_seconds=args.seconds, b3_kills=args.kills,
                          kvps_procs=args.procs,
                          shards=args.shards, kvps_fsync=args.fsync)
    out = Path(args.out)
    systems = tuple(s for s in SYSTEMS if s not in args.skip)
    skipped: dict[str, str] = {}
    if "redis" in systems and {"b1", "b2", "b6", "b7"} & set(args.only):
        from kvps.bench.redis_peer import redis_missing_reason
        reason = redis_missing_reason(install=not args.no_install)
        if reason:
            skipped["redis"] = reason
    if "rpc" in systems and {"b1", "b6"} & set(args.only):
        from kvps.bench.rpc_peer import rpc_missing_reason
        reason = rpc_missing_reason()
        if reason:
            skipped["rpc"] = reason
    for system, reason in skipped.items():
        print(f"kvps bench: skipping {system}: {reason}", file=sys.stderr)
    systems = tuple(s for s in systems if s not in skipped)

    from kvps.bench.report import derive, write_outputs
    from kvps.bench.suite import run_suite

    t0 = time.monotonic()
    with Progress(plan.estimates(args.only, systems), enabled=not args.quiet) as progress:
        progress.log(f"kvps bench ({plan.name}): sections {','.join(args.only)}; "
                     f"systems {','.join(systems)}; output in {out}/")
        results = run_suite(plan, args.only, systems, progress, skipped)
    results["meta"]["seconds"] = round(time.monotonic() - t0, 1)
    derive(results)
    for line in write_outputs(results, out):
        print(f"kvps bench: {line}", file=sys.stderr)
    if not args.quiet:
        print((out / "results.md").read_text())
    return 0
