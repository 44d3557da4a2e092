"""``kvps chaos``: run a chaos scenario and exit 0 only if every check passed.

    kvps chaos [--duration S] [--seed N] [--faults a,b,...] [--out DIR] [--mode auto|netns|loopback]
               [--shards N] [--register-reads linearizable|leader] [--unsafe-disable-dedup]
               [--fsync never|interval|always] [--keep-data] [--no-progress]
"""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

from kvps.config import FSYNC_POLICIES, RaftConfig, ServerConfig

from kvps_chaos.faults import ALL_FAULTS
from kvps_chaos.runner import ChaosOptions, run_chaos

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvps chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=120.0, help="seconds of workload and faults")
    p.add_argument("--seed", type=int, default=None, help="replays a run (default: random, printed)")
    p.add_argument("--faults", default="", help=f"comma-separated subset of: {', '.join(ALL_FAULTS)}")
    p.add_argument("--out", default="chaos-out", help="report.json, report.md, timeline.png, logs")
    p.add_argument("--mode", choices=("auto", "netns", "loopback"), default="auto")
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--register-reads", choices=("linearizable", "leader"), default="linearizable",
                   help="leader: register reads without a read barrier (stale under partitions)")
    p.add_argument("--unsafe-disable-dedup", action="store_true",
                   help="a deliberately broken server (no duplicate table): the run must fail")
    p.add_argument("--fsync", choices=FSYNC_POLICIES, default=RaftConfig.fsync,
                   help="the cluster's Raft journal fsync policy (default: %(default)s)")
    p.add_argument("--every-kind", action="store_true",
                   help="run every fault kind once even if that takes longer than --duration")
    p.add_argument("--procs", type=int, choices=(0, 1), default=ServerConfig.procs,
                   help="where nodes run their replicas: 1 (default), in the node's process (faults "
                        "that kill or wipe one replica kill its whole node); 0, a process each")
    p.add_argument("--keep-data", action="store_true", help="keep journals even if the run passes")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    faults = tuple(f.strip() for f in args.faults.split(",") if f.strip())
    opts = ChaosOptions(duration=args.duration, seed=seed, faults=faults, out=Path(args.out),
                        mode=args.mode, shards=args.shards, register_reads=args.register_reads,
                        unsafe_disable_dedup=args.unsafe_disable_dedup, fsync=args.fsync,
                        keep_data=args.keep_data, every_kind=args.every_kind, procs=args.procs,
                        progress=not args.no_progress)
    try:
        report = run_chaos(opts)
    except (ValueError, RuntimeError) as exc:
        print(f"kvps chaos: {exc} (seed {seed})", file=sys.stderr)
        return 2
    print((Path(args.out) / "report.md").read_text().split("## Failover by fault kind")[0])
    if not report["ok"]:
        print(f"kvps chaos: FAILED: {'; '.join(report['failures'])}\n"
              f"replay with: {report['replay']}", file=sys.stderr)
        return 1
    return 0
