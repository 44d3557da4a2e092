"""The ``kvps`` command line: the composition root (the only place that reads argv and env).

Every kvps process starts here (``kvps ...`` or ``python -m kvps.cli ...``), nodes and replicas
included; each subcommand's body lives with what it runs (``kvps.node.main``,
``kvps.replica.main``, ``kvps.cli.status`` ...).

    kvps up [--nodes 3] [--shards 8] [--replicas 3] [--port 7100] [--data-dir DIR]
    kvps node --config cluster.toml --id ID
    kvps status [--endpoint URL] [--json]
    kvps demo [--task digits|ctr] [--out DIR] [--seed N] [--quick] [--staleness S|none]
              [--max-rows-fraction F] [--evict lru|lfu] [--no-faults]
    kvps chaos ...   (kvps_chaos.cli)
    kvps bench ...   (kvps.bench.cli)
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from pathlib import Path

from kvps.config import FSYNC_POLICIES, RaftConfig, ServerConfig
from kvps.errors import InvalidRequest, KvpsError
from kvps.service.lifecycle import setup_logging

__all__ = ["build_parser", "main"]

DEFAULT_ENDPOINT = "http://127.0.0.1:7100"


# ---- kvps up -----------------------------------------------------------------------------------

def _cmd_up(args: argparse.Namespace) -> int:
    from kvps.node.local import LocalCluster, wait_until

    cluster = LocalCluster(args.data_dir, nodes=args.nodes, shards=args.shards,
                           replicas=args.replicas, port=args.port, tls_cert=args.tls_cert or "",
                           tls_key=args.tls_key or "", tls_ca=args.tls_ca or "",
                           raft=RaftConfig(fsync=args.fsync), server=ServerConfig(procs=args.procs))
    stop = {"now": False}

    def on_signal(signum, frame):
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        cluster.start(wait=False)
        print(cluster.describe(), flush=True)
        wait_until(lambda: stop["now"] or cluster.ready(), 120, "the cluster to become ready", 0.1)
        if not stop["now"]:
            print(f"ready. export KVPS_TOKEN=$(cat {cluster.data_dir / 'token'})  "
                  f"KVPS_ENDPOINT={cluster.endpoints[0]}", flush=True)
        while not stop["now"]:
            dead = [n for n, p in cluster.procs.items() if p.poll() is not None]
            for n in dead:  # a node supervisor that died is restarted, like a host coming back
                print(f"node {n} exited; restarting it", file=sys.stderr, flush=True)
                cluster.start_node(n)
            time.sleep(0.2)
    finally:
        print("stopping the cluster ...", flush=True)
        cluster.stop()
    return 0


# ---- main --------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvps", description="kvps: a fault-tolerant parameter server")
    p.add_argument("--log-level", default=os.environ.get("KVPS_LOG_LEVEL", "info"))
    p.add_argument("--log-format", choices=("text", "json"),
                   default=os.environ.get("KVPS_LOG_FORMAT", "text"),
                   help="json: one object per line (also $KVPS_LOG_FORMAT; inherited by nodes and replicas)")
    sub = p.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run a local cluster in the foreground")
    up.add_argument("--nodes", type=int, default=3)
    up.add_argument("--shards", type=int, default=8)
    up.add_argument("--replicas", type=int, default=3)
    up.add_argument("--port", type=int, default=7100)
    up.add_argument("--data-dir", default="./kvps-data")
    up.add_argument("--tls-cert", help="serve client and admin traffic over HTTPS with this PEM certificate")
    up.add_argument("--tls-key", help="the certificate's PEM private key")
    up.add_argument("--tls-ca", help="CA that signed the certificate (default: the certificate itself)")
    up.add_argument("--fsync", choices=FSYNC_POLICIES, default=RaftConfig.fsync,
                    help="when Raft journal appends reach stable storage (default: %(default)s; "
                         "every choice survives kill -9, they differ on power loss: see README "
                         "Durability)")
    up.add_argument("--procs", type=int, choices=(0, 1), default=ServerConfig.procs,
                    help="where each node runs its replicas: 0, one process per replica; 1, all in "
                         "the node's process (default: %(default)s)")

    node = sub.add_parser("node", help="run one node of a cluster")
    node.add_argument("--config", required=True)
    node.add_argument("--id", type=int, required=True)
    node.add_argument("--bind", help="listen on this address (e.g. 0.0.0.0 in a container) instead "
                                     "of the node's host in cluster.toml, which stays the address "
                                     "the others reach it at")
    node.add_argument("--zone", help="this node's failure domain (a rack, a zone), instead of its "
                                     "zone in cluster.toml: a shard never keeps two replicas in one "
                                     "zone while another can take one")
    node.add_argument("--procs", type=int, choices=(0, 1),
                      help="where this node runs its replicas: 0, one process per replica; 1, all "
                           "in the node's process (one event loop, one Raft ticker). Default: "
                           "[server] procs in cluster.toml")
    node.add_argument("--replace", action="store_true",
                      help="this node takes the place of node ID, whose data directory was lost: "
                           "a new incarnation whose replicas come back recovering (no vote until "
                           "caught up). Without it a node with an empty data directory is refused "
                           "under an id the cluster knows")

    rep = sub.add_parser("replica", help="(internal) one shard replica; nodes start these")
    rep.add_argument("--config", required=True)
    rep.add_argument("--node", type=int, required=True)
    rep.add_argument("--shard", type=int, required=True)
    rep.add_argument("--peers", help="raft addresses of the other members, comma-separated "
                                     "(default: the config's placement)")
    rep.add_argument("--join", action="store_true", help="join an existing group (a moved replica)")
    rep.add_argument("--bind", help="listen address (set by the node from its own --bind)")

    st = sub.add_parser("status", help="shards, leaders, terms, health")
    st.add_argument("--endpoint", default=os.environ.get("KVPS_ENDPOINT", DEFAULT_ENDPOINT))
    st.add_argument("--json", action="store_true")
    st.add_argument("--token", default=os.environ.get("KVPS_TOKEN"),
                    help="a token of any role, read is enough (default $KVPS_TOKEN)")
    st.add_argument("--cafile", default=os.environ.get("KVPS_CAFILE"),
                    help="CA certificate to verify an https endpoint (default $KVPS_CAFILE)")

    for name, text in (("export", "write every key to a PyTorch file (torch.load(path, weights_only=True))"),
                       ("import", "write the tensors of a PyTorch state_dict file into the cluster")):
        sp = sub.add_parser(name, help=text)
        sp.add_argument("path")
        sp.add_argument("--endpoint", default=os.environ.get("KVPS_ENDPOINT", DEFAULT_ENDPOINT))
        sp.add_argument("--token", default=os.environ.get("KVPS_TOKEN"))
        sp.add_argument("--cafile", default=os.environ.get("KVPS_CAFILE"))
        if name == "export":
            sp.add_argument("--snapshot", metavar="ID", help="export a snapshot instead of the live state")
        if name == "import":
            sp.add_argument("--optimizer", help='for keys it creates, e.g. \'{"name": "sgd", "lr": 0.1}\' '
                                                "(default: add)")

    from kvps.cli import snapshot as snapshot_cli
    snapshot_cli.add_parser(sub)

    # Subcommands implemented in their own packages; they parse their own arguments.
    chaos = sub.add_parser("chaos", help="fault injection under training, with checks and a report",
                           add_help=False)
    chaos.add_argument("args", nargs=argparse.REMAINDER)
    bench = sub.add_parser("bench", help="benchmarks against Redis and a PyTorch RPC server",
                           add_help=False)
    bench.add_argument("args", nargs=argparse.REMAINDER)

    demo = sub.add_parser("demo", help="train on a local cluster while leaders are killed")
    demo.add_argument("--task", choices=("digits", "ctr"), default="digits",
                      help="digits: an MLP on scikit-learn's digits; ctr: a click-through model with "
                           "embedding tables on synthetic clicks")
    demo.add_argument("--out", default="demo-out")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--quick", action="store_true", help="3 epochs on 2 shards (a smoke test)")
    demo.add_argument("--staleness", default=4, type=_staleness,
                      help="SSP bound in steps; 0 = synchronous (BSP), 'none' = asynchronous")
    demo.add_argument("--max-rows-fraction", type=_fraction, default=None, metavar="F",
                      help="--task ctr: cap each table at F of the distinct ids it is trained on "
                           "(rows past the cap are evicted; the baseline stays unbounded)")
    demo.add_argument("--evict", choices=("lru", "lfu"), default="lfu",
                      help="--task ctr with --max-rows-fraction: which rows the cap evicts first")
    demo.add_argument("--no-faults", dest="faults", action="store_false",
                      help="--task ctr: kill no leader (the same run without faults, to compare)")
    return p


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError("a fraction in (0, 1]")
    return value


def _staleness(text: str) -> int | None:
    if text.lower() == "none":
        return None
    if not text.isdigit():
        raise argparse.ArgumentTypeError("an int >= 0, or 'none' (asynchronous)")
    return int(text)


# Subcommands whose own packages parse their arguments, and global options that take a value.
_DELEGATED = ("chaos", "bench")
_GLOBAL_VALUED = ("--log-level", "--log-format")


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """argparse's REMAINDER loses options that come first (``kvps chaos --duration 5`` is refused),
    so the arguments of a delegated subcommand are split off before parsing."""
    argv = list(sys.argv[1:] if argv is None else argv)
    for i, tok in enumerate(argv):
        if i and argv[i - 1] in _GLOBAL_VALUED or tok.startswith("-"):
            continue
        if tok in _DELEGATED:
            args = parser.parse_args(argv[:i + 1])
            args.args = argv[i + 1:]
            return args
        break  # the first positional is another subcommand
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["node"] and argv[1:2] in (["join"], ["drain"]):  # kvps/join.py parses these
        from kvps.cli.membership import main as membership_main
        setup_logging(os.environ.get("KVPS_LOG_LEVEL", "info"), os.environ.get("KVPS_LOG_FORMAT", "text"))
        return membership_main(argv[1:])
    args = _parse(build_parser(), argv)
    setup_logging(args.log_level, args.log_format)
    os.environ["KVPS_LOG_FORMAT"] = args.log_format  # child processes log the same way
    try:
        if args.command == "replica":
            peers = None if args.peers is None else [p for p in args.peers.split(",") if p]
            from kvps.replica.main import run_replica
            asyncio.run(run_replica(Path(args.config).resolve(), args.node, args.shard, peers,
                                    args.join, bind=args.bind))
        elif args.command == "node":
            from kvps.node.main import run_node
            asyncio.run(run_node(Path(args.config).resolve(), args.id, replace=args.replace, bind=args.bind,
                                 zone=args.zone, procs=args.procs))
        elif args.command == "up":
            return _cmd_up(args)
        elif args.command == "status":
            from kvps.cli.status import run as status_run
            return status_run(args)
        elif args.command == "export":
            if args.snapshot:
                from kvps.cli.snapshot import export_snapshot
                return export_snapshot(args)
            from kvps.cli.transfer import export_live
            return asyncio.run(export_live(args))
        elif args.command == "snapshot":
            from kvps.cli.snapshot import run as snapshot_run
            return snapshot_run(args)
        elif args.command == "import":
            from kvps.cli.transfer import import_file
            return asyncio.run(import_file(args))
        elif args.command == "chaos":
            from kvps_chaos.cli import main as chaos_main
            return chaos_main(args.args)
        elif args.command == "bench":
            from kvps.bench.cli import main as bench_main
            return bench_main(args.args)
        elif args.command == "demo":
            if args.task == "ctr":
                from kvps.demo.ctr_run import main as ctr_main
                return ctr_main(out=Path(args.out), seed=args.seed, quick=args.quick,
                                staleness=args.staleness, max_rows_fraction=args.max_rows_fraction,
                                evict=args.evict, faults=args.faults)
            if args.max_rows_fraction is not None or not args.faults:
                raise InvalidRequest("--max-rows-fraction and --no-faults are options of --task ctr",
                                     field="max_rows_fraction" if args.max_rows_fraction is not None else "faults")
            from kvps.demo.run import main as demo_main
            return demo_main(out=Path(args.out), seed=args.seed, quick=args.quick,
                             staleness=args.staleness)
    except KvpsError as exc:
        one_line = " ".join(exc.message.split())  # the contract: one clear line on stderr
        kind = "" if type(exc) is KvpsError else f"{type(exc).__name__}: "  # the server's error type
        print(f"kvps {args.command}: {kind}{one_line[:500]}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0
