"""``kvps snapshot create|list|restore|drop`` and ``kvps export --snapshot ID`` (talk to a node's
``/v1/snapshots``; an export from a snapshot downloads every shard's file from a replica that has
it and checks it against the digest the snapshot committed)."""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvps.errors import KvpsError
from kvps.service.http import request, request_json

__all__ = ["add_parser", "export_snapshot", "format_list", "run", "snapshot_state_dict"]

DEFAULT_ENDPOINT = "http://127.0.0.1:7100"


def add_parser(sub: Any) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--endpoint", default=os.environ.get("KVPS_ENDPOINT", DEFAULT_ENDPOINT))
    common.add_argument("--token", default=os.environ.get("KVPS_TOKEN"))
    common.add_argument("--cafile", default=os.environ.get("KVPS_CAFILE"))
    sp = sub.add_parser("snapshot", help="cluster-wide snapshots: create, list, restore, drop")
    ops = sp.add_subparsers(dest="op", required=True)
    create = ops.add_parser("create", parents=[common], help="take a consistent snapshot of every shard now")
    create.add_argument("--label", default="")
    create.add_argument("--json", action="store_true")
    ls = ops.add_parser("list", parents=[common], help="complete snapshots, oldest first")
    ls.add_argument("--json", action="store_true")
    ls.add_argument("--all", action="store_true", help="also unfinished ones")
    restore = ops.add_parser("restore", parents=[common], help="put every key back as it was in a snapshot")
    which = restore.add_mutually_exclusive_group(required=True)
    which.add_argument("id", nargs="?")
    which.add_argument("--at", help="the newest snapshot at or before this time "
                                    "(Unix time or ISO 8601, UTC unless a zone is given)")
    restore.add_argument("--json", action="store_true")
    drop = ops.add_parser("drop", parents=[common], help="delete a snapshot (its files on every replica)")
    drop.add_argument("id")


def _request(args: argparse.Namespace, method: str, path: str, body: dict | None = None,
             timeout: float = 3600.0) -> Any:
    return request_json(method, args.endpoint.rstrip("/") + path, body, token=args.token,
                        timeout=timeout, cafile=args.cafile)


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


def format_list(snaps: list[dict]) -> str:
    lines = [f"{'id':<24}  {'time (UTC)':<23}  {'size':>10}  {'keys':>5}  label"]
    for s in snaps:
        flag = "" if s.get("complete", True) else "  (incomplete)"
        lines.append(f"{s['id']:<24}  {_when(s['time']):<23}  {s['size'] / 2**20:>8.1f}Mi  "
                     f"{s['keys']:>5}  {s['label']}{flag}")
    if not snaps:
        lines.append("(no snapshots)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.op == "create":
        started = time.monotonic()
        print("taking a snapshot of every shard ...", file=sys.stderr, flush=True)
        snap = _request(args, "POST", "/v1/snapshots", {"label": args.label})
        if args.json:
            print(json.dumps(snap, indent=2))
        else:
            print(f"snapshot {snap['id']} at {_when(snap['time'])}: {snap['size'] / 2**20:.1f} MiB, "
                  f"{snap['keys']} keys, {snap['shards']} shards "
                  f"({time.monotonic() - started:.2f} s)")
    elif args.op == "list":
        snaps = _request(args, "GET", "/v1/snapshots" + ("?all=1" if args.all else ""))["snapshots"]
        print(json.dumps(snaps, indent=2) if args.json else format_list(snaps))
    elif args.op == "restore":
        print("restoring: every replica checks its file first ...", file=sys.stderr, flush=True)
        if args.at is not None:
            out = _request(args, "POST", "/v1/snapshots/restore", {"at": args.at})
        else:
            out = _request(args, "POST", f"/v1/snapshots/{args.id}/restore")
        if args.json:
            print(json.dumps(out, indent=2))
        else:
            print(f"restored snapshot {out['restored']} ({_when(out['time'])}, {out['keys']} keys"
                  + (f", {out['fetched_files']} file(s) fetched by replicas that lacked them"
                     if out["fetched_files"] else "") + ")")
    elif args.op == "drop":
        out = _request(args, "DELETE", f"/v1/snapshots/{args.id}")
        print(f"snapshot {args.id} {'dropped' if out['dropped'] else 'was not there'}")
    return 0


# ---- kvps export --snapshot ID ---------------------------------------------------------------

def snapshot_state_dict(args: argparse.Namespace, snap_id: str) -> dict[str, np.ndarray]:
    """Every key of snapshot ``snap_id`` as arrays (the layout of ``Client.state_dict``)."""
    from kvps.replica import snapshot_store
    from kvps.placement import DenseLayout
    from kvps.shard import DenseKey, ShardState

    snaps = _request(args, "GET", "/v1/snapshots")["snapshots"]
    snap = next((s for s in snaps if s["id"] == snap_id), None)
    if snap is None:
        raise KvpsError(f"no complete snapshot {snap_id!r}")
    cmap = _request(args, "GET", "/v1/cluster", timeout=10.0)
    dense: dict[str, tuple[DenseLayout, dict[int, np.ndarray]]] = {}
    tables: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for shard in sorted(cmap["shards"], key=lambda s: s["id"]):
        sid = shard["id"]
        data = _download(args, snap_id, sid, [r["data_url"] for r in shard["replicas"]])
        f = snapshot_store.read_bytes(data, shard=sid, snap_id=snap_id, digest=snap["digests"][str(sid)])
        state = ShardState.restore(f.frame)
        for key, entry in state._keys.items():
            if isinstance(entry, DenseKey):
                _, blocks = dense.setdefault(key, (entry.layout, {}))
                blocks.update({b: blk.value for b, blk in entry.blocks.items()})
            else:
                ids, rows = state.stored_rows(key)
                tables.setdefault(key, []).append((ids, rows))
        print(f"  shard {sid}: {len(data) / 2**20:.1f} MiB verified", file=sys.stderr, flush=True)
    out: dict[str, np.ndarray] = {}
    for key, (layout, blocks) in sorted(dense.items()):
        if sorted(blocks) != list(range(layout.n_blocks)):
            raise KvpsError(f"snapshot {snap_id}: key {key!r} is missing blocks")
        out[key] = layout.assemble([blocks[b] for b in range(layout.n_blocks)])
    for key, parts in sorted(tables.items()):
        ids = np.concatenate([p[0] for p in parts])
        rows = np.concatenate([p[1] for p in parts])
        order = np.argsort(ids, kind="stable")
        out[key], out[key + ".ids"] = rows[order], ids[order]
    return out


def _download(args: argparse.Namespace, snap_id: str, shard: int, urls: list[str]) -> bytes:
    errors = []
    for url in urls:
        try:
            return request("GET", f"{url}/v1/snapshots/{snap_id}/file", token=args.token,
                           timeout=600, cafile=args.cafile)
        except KvpsError as exc:
            errors.append(f"{url}: {exc.message}")
    raise KvpsError(f"snapshot {snap_id}: no replica of shard {shard} sent its file ({'; '.join(errors)})")


def export_snapshot(args: argparse.Namespace) -> int:
    import torch

    state = snapshot_state_dict(args, args.snapshot)
    tensors = {k: torch.from_numpy(np.array(v, copy=True)) for k, v in state.items()}
    tmp = Path(args.path + ".tmp")
    torch.save(tensors, tmp)
    os.replace(tmp, args.path)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    print(f"exported snapshot {args.snapshot}: {len(tensors)} tensors ({total / 2**20:.1f} MiB) "
          f"to {args.path}")
    return 0
