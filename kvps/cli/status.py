"""``kvps status``: shards, leaders, terms, lag and health as a table (``--json`` for scripts).
A ``read`` token is enough (``--token`` or ``$KVPS_TOKEN``)."""
from __future__ import annotations

import argparse
import json

from kvps.service.http import request_json

__all__ = ["format_status", "run"]


def format_status(cmap: dict) -> str:
    """One line per shard: leader, term, the worst follower lag, health, then every replica; the
    nodes' wire data-plane addresses; the nodes and how many shards are healthy."""
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
    # where each node serves the binary data plane (kvps.delta.wire), from its replicas' entries
    wire = {r["node"]: r["wire"] for shard in cmap["shards"] for r in shard["replicas"] if r.get("wire")}
    if wire:
        lines.append("wire: " + ", ".join(f"node {n} {wire[n]}" for n in sorted(wire)))
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


def run(args: argparse.Namespace) -> int:
    cmap = request_json("GET", args.endpoint.rstrip("/") + "/v1/cluster", token=args.token,
                        timeout=3.0, cafile=args.cafile)
    print(json.dumps(cmap, indent=2) if args.json else format_status(cmap))
    return 0
