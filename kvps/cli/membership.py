"""``kvps node join`` and ``kvps node drain``: grow and shrink a running cluster.

    kvps node join --seed URL --port P --data-dir DIR [--host H] [--zone Z] [--token T]
    kvps node drain ID [--endpoint URL] [--token T] [--no-wait] [--timeout S]

``join`` asks the seed (any node) to add a node at ``H:P`` (admin API; shard ports P+1 ..
P+2*shards, the metadata replica's P+2*shards+1, the wire port P+2*shards+2) to the metadata group, writes the cluster's ``cluster.toml``, ``secret`` and ``token``
into DIR, and then runs that node in the foreground like ``kvps node`` (Ctrl-C / SIGTERM stop it;
run the same command again to restart it: a repeated join gets the same id back). While the
seed cannot be reached or answers with a retryable error (no metadata leader yet, say), ``join``
retries with backoff for ``--wait`` seconds (default 120), printing each retry. The
rebalancer then moves replicas onto it, one at a time. ``drain`` marks a node draining: its
replicas move away one at a time, then it is marked removed and its process exits; without
``--no-wait`` the command prints progress until then. Both need an ``admin`` token; the joined node's
token file is the seed's (every role's tokens).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from pathlib import Path

from tqdm import tqdm

from kvps.errors import ConnectError, KvpsError, RetryableError
from kvps.node.identity import Identity
from kvps.service.http import request_json

__all__ = ["drain", "join", "main"]

DEFAULT_ENDPOINT = "http://127.0.0.1:7100"


def _request(method: str, url: str, token: str, body: dict | None = None, timeout: float = 15.0) -> dict:
    try:  # refused, reset, timed out (ConnectError): the node may be starting or restarting
        return request_json(method, url, body, token=token, timeout=timeout)
    except ConnectError:
        raise
    except KvpsError as exc:  # the server's typed error, with the URL in front
        raise type(exc).restore(f"{method} {url}: {exc.message}", exc.fields) from exc


def _retrying(call, what: str, wait: float):
    """``call()``, retried with backoff on retryable errors until ``wait`` seconds have passed
    (typed errors such as a bad token or a refused request fail at once)."""
    deadline = time.monotonic() + wait
    delay = 0.5
    while True:
        try:
            return call()
        except RetryableError as exc:
            if time.monotonic() + delay > deadline:
                raise
            print(f"  {what}: {type(exc).__name__}: {exc.message}; retrying in {delay:.1f} s",
                  file=sys.stderr, flush=True)
            time.sleep(delay)  # backoff between attempts, not a wait on a condition
            delay = min(2 * delay, 5.0)


def join(args: argparse.Namespace) -> int:
    from kvps.node.main import run_node
    if not args.token:
        raise KvpsError("the cluster token is needed: --token or $KVPS_TOKEN")
    data_dir = Path(args.data_dir).resolve()
    # The incarnation this data directory is (kvps.node.identity): a repeated join from it gets
    # its id back; a wiped directory is a new incarnation and never gets an old id.
    held = [i for i in (Identity.load(p) for p in sorted(data_dir.glob("node-*"))) if i is not None]
    incarnation = held[0].incarnation if held else uuid.uuid4().hex
    # With --secret-file (a mounted Secret) the cluster secret is not asked for over the wire.
    secret = Path(args.secret_file).read_text().strip() if args.secret_file else None
    body = {"host": args.host, "admin_port": args.port, "port_base": args.port + 1,
            "incarnation": incarnation, "want_secret": secret is None, "zone": args.zone}
    reply = _retrying(lambda: _request("POST", args.seed.rstrip("/") + "/v1/nodes", args.token, body),
                      f"join via {args.seed}", args.wait)
    node_id = int(reply["id"])
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / "cluster.toml").write_text(reply["config"])
    node_dir = data_dir / f"node-{node_id}"
    node_dir.mkdir(exist_ok=True)
    Identity(node_id, incarnation).save(node_dir)
    if not (node_dir / "assignment.json").exists():  # a restarted join keeps what it follows
        (node_dir / "assignment.json").write_text(json.dumps(reply["assignment"]))
    if "meta_members" in reply and not (node_dir / "meta_members.json").exists():
        (node_dir / "meta_members.json").write_text(json.dumps(reply["meta_members"]))
    # the seed's token file (every role's tokens); with --secret-file (secrets kept off the wire) or
    # a seed from before roles there is none: the joining (admin) token, unless a token file put
    # here by hand already accepts it as admin (then it is kept, with its other roles' lines)
    tokens = reply.get("tokens") or (None if _accepts(data_dir / "token", args.token) else args.token)
    for name, text in (("secret", secret or reply["secret"]), ("token", tokens)):
        if text is None:
            continue
        path = data_dir / name
        path.touch(mode=0o600)
        path.write_text(text + "\n")
    print(f"joined as node {node_id}: admin API http://{args.host}:{args.port}, data in {data_dir}",
          flush=True)
    asyncio.run(run_node(data_dir / "cluster.toml", node_id, bind=args.bind, zone=args.zone))
    return 0


def _accepts(token_file: Path, token: str) -> bool:
    """Whether ``token_file`` exists and holds ``token`` as an admin token."""
    from kvps.service.auth import read_tokens
    try:
        return (token, "admin") in read_tokens(token_file)
    except (OSError, KvpsError):
        return False


def drain(args: argparse.Namespace) -> int:
    base = args.endpoint.rstrip("/")
    if not args.token:
        raise KvpsError("the cluster token is needed: --token or $KVPS_TOKEN")
    _request("POST", f"{base}/v1/nodes/{args.id}/drain", args.token, {})
    print(f"node {args.id} is draining", flush=True)
    if args.no_wait:
        return 0
    deadline = time.monotonic() + args.timeout
    last, bar = None, None
    urls = [base]  # where the metadata view is read: the endpoint first, then the nodes it named
    try:
        while time.monotonic() < deadline:
            meta = _meta(urls, args.token)
            if meta is None:  # none answers right now (a restart, an election): ask again
                time.sleep(0.5)
                continue
            urls = [base, *(f"{n['scheme']}://{n['host']}:{n['admin_port']}" for n in meta["nodes"]
                            if n["state"] == "active" and n["id"] != args.id)]
            state = meta["nodes"][args.id]["state"]
            hosted = [s["id"] for s in meta["assignment"]["shards"] if args.id in s["nodes"]]
            if bar is None:  # a bar over the replicas still to move
                bar = tqdm(total=len(hosted), unit="replica", desc=f"draining node {args.id}",
                           file=sys.stdout, disable=not sys.stdout.isatty())
            bar.update(max(0, bar.total - len(hosted) - bar.n))
            line = f"  node {args.id}: {state}, hosts shards {hosted}; moving {meta['rebalance'].get('moving')}"
            if line != last:
                bar.write(line, file=sys.stdout)
                last = line
            if state == "removed":
                bar.close()
                print(f"node {args.id} removed", flush=True)
                return 0
            time.sleep(0.5)
    finally:
        if bar is not None:
            bar.close()
    raise KvpsError(f"node {args.id} was not drained within {args.timeout:.0f} s")


def _meta(urls: list[str], token: str) -> dict | None:
    """``GET /v1/meta`` from the first of ``urls`` that answers; None if none does. The endpoint
    may be the node being drained (a Kubernetes preStop hook asks its own pod): it exits once it is
    removed, maybe before this command has seen it removed, so the other nodes are asked too."""
    for url in urls:
        try:
            return _request("GET", f"{url}/v1/meta", token)
        except RetryableError:
            continue
    return None


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvps node", description="grow or shrink a running cluster")
    sub = p.add_subparsers(dest="action", required=True)
    j = sub.add_parser("join", help="add a node to a running cluster and run it (foreground)")
    j.add_argument("--seed", required=True, help="admin URL of any node of the cluster")
    j.add_argument("--port", type=int, required=True, help="admin port; shard ports follow it")
    j.add_argument("--data-dir", required=True)
    j.add_argument("--host", default="127.0.0.1", help="address the other nodes reach this one at")
    j.add_argument("--bind", help="listen on this address (e.g. 0.0.0.0 in a container) instead of --host")
    j.add_argument("--zone", default="", help="this node's failure domain (a rack, a zone): a shard never "
                   "keeps two replicas in one zone while another can take one")
    j.add_argument("--secret-file", help="the cluster secret, e.g. a mounted Secret: not sent over the join")
    j.add_argument("--token", default=os.environ.get("KVPS_TOKEN"))
    j.add_argument("--wait", type=float, default=120.0,
                   help="seconds to keep retrying while the seed is unreachable or busy")
    d = sub.add_parser("drain", help="move a node's replicas away, then remove it")
    d.add_argument("id", type=int)
    d.add_argument("--endpoint", default=os.environ.get("KVPS_ENDPOINT", DEFAULT_ENDPOINT))
    d.add_argument("--token", default=os.environ.get("KVPS_TOKEN"))
    d.add_argument("--no-wait", action="store_true")
    d.add_argument("--timeout", type=float, default=3600.0)
    args = p.parse_args(argv)
    try:
        return join(args) if args.action == "join" else drain(args)
    except KvpsError as exc:
        print(f"kvps node {args.action}: {type(exc).__name__}: {' '.join(exc.message.split())[:600]}",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
