"""The checks every chaos run ends with (hashicorp/raft's fuzzy tests end every scenario alike).

Pure functions of what the run recorded: no I/O, no clocks.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from kvps_chaos.linearizability import Operation, RegisterModel, check_per_key

__all__ = [
    "availability", "counter_check", "failovers", "linearizability", "loss_falls",
    "monotonic_reads", "percentile", "raft_log_findings",
]

SHARD_FAULTS = frozenset({"kill-leader", "pause-leader", "partition-leader", "isolate-follower",
                          "wipe-replica"})


def counter_check(tallies: dict[str, Any], final: dict[str, tuple[float, int]] | None) -> dict[str, Any]:
    """acked <= value <= acked + unknown per key; value == version (each push adds 1 and 1).
    ``final`` None: the counters could not be read after the run (verdict unknown)."""
    if final is None:
        return {"keys": {}, "acked": sum(t.acked for t in tallies.values()),
                "unknown": sum(t.unknown for t in tallies.values()), "lost": None,
                "applied_twice": None, "ok": None}
    keys = {}
    for key, t in tallies.items():
        value, version = final[key]
        value = int(value)
        lost = max(0, t.acked - value)
        twice = max(0, value - (t.acked + t.unknown))
        keys[key] = {"acked": t.acked, "unknown": t.unknown, "rejected": t.rejected, "value": value,
                     "version": version, "lost": lost, "applied_twice": twice,
                     "ok": lost == 0 and twice == 0 and value == version}
    return {"keys": keys,
            "acked": sum(k["acked"] for k in keys.values()),
            "unknown": sum(k["unknown"] for k in keys.values()),
            "lost": sum(k["lost"] for k in keys.values()),
            "applied_twice": sum(k["applied_twice"] for k in keys.values()),
            "ok": all(k["ok"] for k in keys.values())}


def linearizability(history: Sequence[Operation], initial: dict[str, tuple[float, int]],
                    budget: int = 2_000_000) -> dict[str, Any]:
    results = check_per_key(history, lambda key: RegisterModel(initial[key]), budget=budget)
    keys = {}
    for key, res in results.items():
        entry: dict[str, Any] = {"verdict": res.verdict, "ok": res.ok, "steps": res.steps,
                                 "ops": sum(1 for op in history if op.key == key)}
        if res.ok is False:
            entry["stuck"] = [_op_dict(op) for op in res.stuck[:10]]
            entry["last_linearized"] = [_op_dict(op) for op in res.best_prefix[-5:]]
        keys[key] = entry
    verdicts = [r.ok for r in results.values()]
    overall = False if False in verdicts else None if None in verdicts else True
    return {"keys": keys, "ok": overall, "ops": len(history),
            "unknown": sum(1 for op in history if math.isinf(op.ret)),
            "verdict": {True: "linearizable", False: "NOT linearizable",
                        None: "unknown (checker budget exceeded)"}[overall]}


def _op_dict(op: Operation) -> dict[str, Any]:
    return {"client": op.client, "input": op.input, "output": op.output, "call": op.call,
            "ret": None if math.isinf(op.ret) else op.ret}


def monotonic_reads(history: Iterable[Operation], counter_versions: dict[str, dict[str, list[int]]],
                    train_versions: dict[str, list[int]]) -> dict[str, Any]:
    """Per client: register versions read never go back; versions returned by a client's
    successive pushes strictly increase (each of its pushes is applied after the previous one)."""
    violations = []
    last: dict[tuple[str, str], int] = {}
    for op in sorted(history, key=lambda o: o.call):
        if op.input[0] != "read" or op.client == "final":
            continue
        k = (str(op.client), op.key)
        version = op.output[1]
        if version < last.get(k, -1):
            violations.append({"client": k[0], "key": op.key, "read": version, "after": last[k]})
        last[k] = max(version, last.get(k, -1))
    series = [(f"{client}:{key}", vs) for key, per in counter_versions.items() for client, vs in per.items()]
    series += list(train_versions.items())
    for name, versions in series:
        for a, b in zip(versions, versions[1:]):
            if b <= a:
                violations.append({"client": name, "version": b, "after": a})
                break
    return {"ok": not violations, "violations": violations[:20], "count": len(violations)}


def availability(records: Iterable[Any], shards: int, start: float, end: float) -> dict[int, float]:
    """Per shard: the longest time with no operation acknowledged (from ``start`` to ``end``)."""
    acks: dict[int, list[float]] = {s: [] for s in range(shards)}
    for r in records:
        if r.ok and r.shard in acks:
            acks[r.shard].append(r.ret)
    out = {}
    for s, times in acks.items():
        points = [start, *sorted(t for t in times if start <= t <= end), end]
        out[s] = max(b - a for a, b in zip(points, points[1:]))
    return out


def failovers(faults: Iterable[dict[str, Any]], records: Sequence[Any], shards: int) -> list[dict]:
    """Per fault: how long after it began every affected shard acknowledged an operation that was
    invoked after it began (the client-visible recovery time)."""
    ok_ops = sorted((r.call, r.ret, r.shard) for r in records if r.ok and r.shard >= 0)
    out = []
    for f in faults:
        affected = [f["shard"]] if f["kind"] in SHARD_FAULTS and f.get("shard") is not None \
            else list(range(shards))
        firsts = []
        for s in affected:
            first = min((ret for call, ret, shard in ok_ops if shard == s and call >= f["start"]),
                        default=None)
            firsts.append(None if first is None else first - f["start"])
        recovery = None if None in firsts else max(firsts, default=None)
        out.append({"kind": f["kind"], "recovery_s": recovery, "shards": affected})
    return out


def loss_falls(evals: Sequence[tuple[float, float]], *, window: int = 3,
               ratio: float = 0.8) -> dict[str, Any]:
    """Training still learns: the mean of the last evaluations is below ``ratio`` x the first."""
    evals = sorted(evals)
    if len(evals) < 2 * window:
        return {"ok": False, "reason": f"only {len(evals)} evaluations", "first": None, "last": None}
    first = statistics.fmean(v for _, v in evals[:window])
    last = statistics.fmean(v for _, v in evals[-window:])
    return {"ok": last < ratio * first, "first": first, "last": last, "evaluations": len(evals)}


def percentile(values: Sequence[float], q: float) -> float | None:
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    idx = min(len(values) - 1, max(0, math.ceil(q / 100 * len(values)) - 1))
    return values[idx]


# What a replica logs when Raft overwrites entries it had already applied: its state machine has
# diverged from the others (an acknowledged write may be lost). It must never happen.
TRUNCATED_APPLIED = "truncating already-applied log entries"


def raft_log_findings(data_dir: Path) -> list[str]:
    """Every replica log line under ``data_dir`` that says applied entries were truncated."""
    found = []
    for path in sorted(data_dir.glob("*/logs/*.log")):
        with open(path, errors="replace") as f:
            found += [f"{path.relative_to(data_dir)}: {line.strip()}" for line in f if TRUNCATED_APPLIED in line]
    return found
