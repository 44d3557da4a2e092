"""The ``kvps`` command line: the composition root (the only place that reads argv and env).

    kvps up [--nodes 3] [--shards 8] [--replicas 3] [--port 7100] [--data-dir DIR]
    kvps node --config cluster.toml --id ID
    kvps status [--endpoint URL] [--json]
    kvps demo [--out DIR] [--seed N] [--quick] [--staleness S|none]
    kvps chaos ...   (kvps_chaos.cli)
    kvps bench ...   (kvps.bench.cli)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from kvps.config import FSYNC_POLICIES, RaftConfig, load_cluster
from kvps.errors import KvpsError

DEFAULT_ENDPOINT = "http://127.0.0.1:7100"


class _JsonFormatter(logging.Formatter):
    """One JSON object per line, for log shippers."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": round(record.created, 6), "level": record.levelname, "logger": record.name,
                 "pid": record.process, "msg": record.getMessage()}
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def _setup_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"))
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler])


def _read_tokens(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text().splitlines() if line.strip()]


def _stop_event() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


# ---- kvps replica (started by a node) ---------------------------------------------------------

async def _run_replica(config: Path, node_id: int, shard: int, peers: list[str] | None = None,
                       joining: bool = False) -> None:
    from aiohttp import web

    from kvps.auth import TokenStore
    from kvps.dataplane import make_app
    from kvps.replica import Replica
    from kvps.tls import client_context, server_context

    # Two busy threads share the GIL here (pysyncobj's tick thread and the event loop). With the
    # default 5 ms switch interval every hand-off between them can stall a commit by 5 ms.
    sys.setswitchinterval(0.0005)
    cfg = load_cluster(config)
    base = config.parent
    node = cfg.node(node_id)
    secret = (base / cfg.secret_file).read_bytes().strip()
    tokens = TokenStore(base / cfg.token_file)
    replica = Replica(cfg, node_id, shard, secret=secret, data_dir=base / node.data_dir,
                      peers=peers, joining=joining)
    replica.client_ssl = client_context(cfg, base)
    stop = _stop_event()
    await replica.start()
    runner = web.AppRunner(make_app(replica, tokens), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, node.host, node.data_port(shard), reuse_address=True,
                      ssl_context=server_context(cfg, base)).start()
    logging.getLogger("kvps.replica").info("shard %d replica on node %d serving %s", shard, node_id,
                                           node.data_url(shard))
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        await replica.stop()


# ---- kvps node ---------------------------------------------------------------------------------

async def _run_node(config: Path, node_id: int) -> None:
    from kvps.node import Node
    from kvps.tls import client_context, server_context

    cfg = load_cluster(config)
    base = config.parent
    token = _read_tokens(base / cfg.token_file)[0]
    node = Node(cfg, node_id, config, base / cfg.node(node_id).data_dir, token,
                server_ssl=server_context(cfg, base), client_ssl=client_context(cfg, base))
    await node.run(_stop_event())


# ---- kvps up -----------------------------------------------------------------------------------

def _cmd_up(args: argparse.Namespace) -> int:
    from kvps.local import LocalCluster, wait_until

    cluster = LocalCluster(args.data_dir, nodes=args.nodes, shards=args.shards,
                           replicas=args.replicas, port=args.port, tls_cert=args.tls_cert or "",
                           tls_key=args.tls_key or "", tls_ca=args.tls_ca or "",
                           raft=RaftConfig(fsync=args.fsync))
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


# ---- kvps status -------------------------------------------------------------------------------

def _get_json(url: str, timeout: float = 3.0, cafile: str | None = None) -> dict:
    import ssl
    ctx = ssl.create_default_context(cafile=cafile) if cafile else None
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=ctx) as resp:
            return json.loads(resp.read())
    except (OSError, urllib.error.URLError, ValueError) as exc:
        raise KvpsError(f"cannot reach {url}: {exc}") from exc


def format_status(cmap: dict) -> str:
    """One line per shard: leader, term, the worst follower lag, health, then every replica."""
    lines = [f"{'shard':>5}  {'leader':>6}  {'term':>5}  {'lag':>5}  {'health':<9}  "
             f"replicas (node:role applied; R: recovering)"]
    degraded = 0
    for shard in cmap["shards"]:
        reps = shard["replicas"]
        leader = next((r for r in reps if r.get("role") == "leader"), None)
        commit = (leader or {}).get("commit_index") or 0
        lag = max((commit - (r.get("applied_index") or 0) for r in reps if r is not leader), default=0)
        alive = sum(1 for r in reps if r.get("alive"))
        health = "ok" if leader and alive == len(reps) else ("degraded" if leader else "NO LEADER")
        degraded += health != "ok"
        # "R": recovering (its lost data replaced; no vote until caught up, kvps/raft/recovery.py)
        cells = "  ".join(f"{r['node']}:{'R' if r.get('recovering') else (r.get('role') or '?')[:1].upper()} "
                          f"{r.get('applied_index') or '-'}" for r in reps)
        lines.append(f"{shard['id']:>5}  {'-' if leader is None else leader['node']:>6}  "
                     f"{shard['term'] or 0:>5}  {lag if leader else '-':>5}  {health:<9}  {cells}")
    nodes = ", ".join(f"{n['id']}:{'up' if n['reachable'] else 'DOWN'}"
                      + (f" ({n['state']})" if n.get("state", "active") != "active" else "")
                      for n in cmap["nodes"] if n.get("state") != "removed")
    rebalance = (cmap.get("membership") or {}).get("rebalance") or {}
    if rebalance.get("moving") or rebalance.get("moves_done"):  # elastic membership (kvps/rebalance.py)
        m = rebalance.get("moving")
        what = "the metadata replica" if m and m.get("meta") else f"shard {m['shard']}'s replica" if m else ""
        now = f"moving {what} from node {m['source']} to node {m['target']}" if m else "settled"
        lines.append(f"rebalance: {now}; {rebalance.get('moves_done', 0)} moves done")
    lines.append(f"nodes: {nodes}    {len(cmap['shards']) - degraded}/{len(cmap['shards'])} shards healthy")
    return "\n".join(lines)


async def _export(args: argparse.Namespace) -> int:
    import torch

    from kvps_client import Client
    async with Client([args.endpoint], token=args.token, ssl=args.cafile) as ps:
        state = await ps.state_dict()
    tensors = {k: torch.from_numpy(v.copy()) for k, v in state.items()}
    tmp = Path(args.path + ".tmp")
    torch.save(tensors, tmp)
    os.replace(tmp, args.path)  # never a half-written file under the final name
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    print(f"exported {len(tensors)} tensors ({total / 2**20:.1f} MiB) to {args.path}")
    return 0


async def _import(args: argparse.Namespace) -> int:
    import torch

    from kvps.optimizer import optimizer_from_dict
    from kvps_client import Client
    try:
        state = torch.load(args.path, weights_only=True, map_location="cpu")
    except Exception as exc:  # torch raises many types for a bad file: one line, non-zero exit
        raise KvpsError(f"cannot read {args.path}: {type(exc).__name__}: {exc}") from exc
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise KvpsError(f"{args.path} is not a {{name: tensor}} state_dict")
    optimizer = optimizer_from_dict(json.loads(args.optimizer)) if args.optimizer else None
    async with Client([args.endpoint], token=args.token, ssl=args.cafile) as ps:
        written = await ps.load_state_dict({k: v.detach().cpu().numpy() for k, v in state.items()},
                                           optimizer=optimizer)
    print(f"imported {len(written)} keys from {args.path}")
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    cmap = _get_json(args.endpoint.rstrip("/") + "/v1/cluster", cafile=args.cafile)
    print(json.dumps(cmap, indent=2) if args.json else format_status(cmap))
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

    node = sub.add_parser("node", help="run one node of a cluster")
    node.add_argument("--config", required=True)
    node.add_argument("--id", type=int, required=True)

    rep = sub.add_parser("replica", help="(internal) one shard replica; nodes start these")
    rep.add_argument("--config", required=True)
    rep.add_argument("--node", type=int, required=True)
    rep.add_argument("--shard", type=int, required=True)
    rep.add_argument("--peers", help="raft addresses of the other members, comma-separated "
                                     "(default: the config's placement)")
    rep.add_argument("--join", action="store_true", help="join an existing group (a moved replica)")

    st = sub.add_parser("status", help="shards, leaders, terms, health")
    st.add_argument("--endpoint", default=os.environ.get("KVPS_ENDPOINT", DEFAULT_ENDPOINT))
    st.add_argument("--json", action="store_true")
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

    from kvps import snapshot_cli
    snapshot_cli.add_parser(sub)

    # Subcommands implemented in their own packages; they parse their own arguments.
    chaos = sub.add_parser("chaos", help="fault injection under training, with checks and a report",
                           add_help=False)
    chaos.add_argument("args", nargs=argparse.REMAINDER)
    bench = sub.add_parser("bench", help="benchmarks against Redis and a PyTorch RPC server",
                           add_help=False)
    bench.add_argument("args", nargs=argparse.REMAINDER)

    demo = sub.add_parser("demo", help="train on a local cluster while leaders are killed")
    demo.add_argument("--out", default="demo-out")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--quick", action="store_true", help="3 epochs on 2 shards (a smoke test)")
    demo.add_argument("--staleness", default=4, type=_staleness,
                      help="SSP bound in steps; 0 = synchronous (BSP), 'none' = asynchronous")
    return p


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
        from kvps.join import main as membership_main
        _setup_logging(os.environ.get("KVPS_LOG_LEVEL", "info"), os.environ.get("KVPS_LOG_FORMAT", "text"))
        return membership_main(argv[1:])
    args = _parse(build_parser(), argv)
    _setup_logging(args.log_level, args.log_format)
    os.environ["KVPS_LOG_FORMAT"] = args.log_format  # child processes log the same way
    try:
        if args.command == "replica":
            peers = None if args.peers is None else [p for p in args.peers.split(",") if p]
            asyncio.run(_run_replica(Path(args.config).resolve(), args.node, args.shard, peers,
                                     args.join))
        elif args.command == "node":
            asyncio.run(_run_node(Path(args.config).resolve(), args.id))
        elif args.command == "up":
            return _cmd_up(args)
        elif args.command == "status":
            return _cmd_status(args)
        elif args.command == "export":
            if args.snapshot:
                from kvps.snapshot_cli import export_snapshot
                return export_snapshot(args)
            return asyncio.run(_export(args))
        elif args.command == "snapshot":
            from kvps.snapshot_cli import run as snapshot_run
            return snapshot_run(args)
        elif args.command == "import":
            return asyncio.run(_import(args))
        elif args.command == "chaos":
            from kvps_chaos.cli import main as chaos_main
            return chaos_main(args.args)
        elif args.command == "bench":
            from kvps.bench.cli import main as bench_main
            return bench_main(args.args)
        elif args.command == "demo":
            from kvps.demo import main as demo_main
            return demo_main(out=Path(args.out), seed=args.seed, quick=args.quick,
                             staleness=args.staleness)
    except KvpsError as exc:
        one_line = " ".join(exc.message.split())  # the contract: one clear line on stderr
        print(f"kvps {args.command}: {one_line[:500]}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
