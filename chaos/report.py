"""The report of a chaos run: the checks' verdicts, ``report.json``, ``report.md``, ``timeline.png``."""
from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from kvps_chaos import checks
from kvps_chaos.workloads import OpRecord

__all__ = ["build_report", "markdown", "write_report"]

BIN = 1.0  # seconds per timeline bin


def build_report(state: Any, wl: Any, final: dict, convergence: dict, train: dict) -> dict[str, Any]:
    opts, t0 = state.opts, state.workload_start
    records: list[OpRecord] = list(wl.records)
    for name, steps in train.items():
        records += [OpRecord("train", -1, name, s["t0"], s["t1"], s["ok"], s.get("error")) for s in steps]
    faults = [f.to_dict() for f in state.fault_records]
    # the window after a heal ends where the next fault began (its action, which comes before its
    # effect is stamped as "start"): a leader the next fault cuts off is deposed by that fault
    begun = sorted(f["invoked"] if f.get("invoked") is not None else f["start"] for f in faults)
    for f in faults:
        until = next((t for t in begun if t > f["start"]), None)
        late = _late_failover(f, state.leader_events, until=until)
        f["failover_after_heal"] = late is not None if f["kind"] == "partition-leader" else None
        f["elections_after_heal"] = _elections_after_heal(f, state.leader_events, until=until,
                                                          skip=late)
        f["transfers_after_heal"] = _elections_after_heal(f, state.leader_events, until=until,
                                                          transfers=True)
    recoveries = checks.failovers(faults, records, opts.shards)
    for f, r in zip(faults, recoveries):
        f["recovery_s"] = r["recovery_s"]
    counter = checks.counter_check(wl.tally, final)
    lin = checks.linearizability(wl.history, wl.initial)
    mono = checks.monotonic_reads(wl.history, {k: t.versions for k, t in wl.tally.items()},
                                  {n: [s["version"] for s in steps if s["ok"]] for n, steps in train.items()})
    gaps = checks.availability(records, opts.shards, t0, state.workload_end)
    evals = [(s["t0"], s["eval"]) for steps in train.values() for s in steps if "eval" in s]
    loss = checks.loss_falls(evals)
    failures = _failures(counter, lin, convergence, mono, loss, faults)
    if state.raft_findings:
        failures.append(f"{len(state.raft_findings)} replica(s) logged that Raft truncated entries they "
                        f"had applied (diverged state machines): {state.raft_findings[0]}")
    rel = lambda t: None if t is None else round(t - t0, 3)  # noqa: E731 - times relative to the start
    for f in faults:
        for k in ("start", "end", "ready", "invoked"):
            f[k] = rel(f[k])
    times = [r["recovery_s"] for r in recoveries if r["recovery_s"] is not None]
    return {
        "ok": not failures, "failures": failures, "seed": opts.seed, "duration_s": opts.duration,
        "mode": state.mode, "mode_note": state.mode_note, "faults_requested": state.faults,
        "faults_not_run": state.not_run, "unsafe_disable_dedup": opts.unsafe_disable_dedup,
        "replay": opts.replay_command(),
        "faults_by_kind": dict(Counter(f["kind"] for f in faults)), "faults": faults,
        "failover_s": {"p50": checks.percentile(times, 50), "max": max(times, default=None),
                       "by_kind": _by_kind(faults)},
        "counter": counter, "linearizability": lin, "convergence": convergence, "monotonic": mono,
        "availability": {"longest_gap_s": max(gaps.values(), default=None),
                         "per_shard": {str(s): round(g, 3) for s, g in gaps.items()}},
        "training": {**loss, "steps": sum(len(s) for s in train.values()),
                     "failed_steps": sum(1 for s in train.values() for x in s if not x["ok"])},
        "ops": dict(Counter(r.kind for r in records)),
        "failed_ops": dict(Counter(r.kind for r in records if not r.ok)),
        "replies_lost_on_purpose": wl.replies_lost,
        "leader_changes": [{**e, "t": rel(e["t"])} for e in state.leader_events],
        "timeline": _timeline(records, t0, state.workload_end),
        "raft_findings": state.raft_findings,
        "log": state.log_lines,
    }


# A poll of the cluster map can land while a leadership transfer hands over (the old leader has
# stepped down, the new one does not serve yet): "no serving leader" followed this soon by the
# transfer's winner, one term on, is that transfer.
_HANDOVER_S = 1.0


def _classify(events: list[dict]) -> list[str]:
    """One shard's leader events, in order, each as "election", "transfer", "handover" (the
    instant of a transfer's hand-over), "gap" (no serving leader: counted as an election) or
    "return" (the leader and term from before a gap again: nothing new). ``won_by`` belongs to a
    leader for as long as it leads, so a transfer counts only in a term after the last one seen."""
    kinds: list[str] = []
    prev = None  # the last event naming a leader
    for e in events:
        if e["node"] is None:
            kinds.append("gap")
        elif prev is not None and (e["node"], e["term"]) == (prev["node"], prev["term"]):
            kinds.append("return")
        elif e.get("won_by") == "transfer" and (prev is None or (e["term"] or 0) > (prev["term"] or 0)):
            kinds.append("transfer")
        else:
            kinds.append("election")
        if e["node"] is not None:
            prev = e
    prev_term = None
    for i, e in enumerate(events):  # a gap right before a transfer one term on is its hand-over
        nxt = events[i + 1] if i + 1 < len(events) else None
        if (kinds[i] == "gap" and nxt is not None and kinds[i + 1] == "transfer"
                and nxt["t"] - e["t"] <= _HANDOVER_S
                and (prev_term is None or nxt["term"] == prev_term + 1)):
            kinds[i] = "handover"
        if e["node"] is not None:
            prev_term = e["term"]
    return kinds


def _elections_after_heal(fault: dict, events: list[dict], window: float = 3.0,
                         until: float | None = None, transfers: bool = False,
                         skip: dict | None = None) -> int | None:
    """Leader or term changes on a cut shard within ``window`` s after the cut healed, and before
    ``until`` (the next fault's start). Raft with PreVote (``kvps.raft.prevote``; pysyncobj
    0.3.17 has none) has none: a rejoining replica whose term grew while it was cut off would
    otherwise depose a healthy leader.

    A change whose new leader won by a transfer (``won_by``: the previous leader asked, as the
    leader spreader does once leader changes have settled) is no election: it is counted apart
    (``transfers=True``), not hidden, and so is the instant without a serving leader a poll may
    catch while it hands over. Any other moment without a serving leader counts as an election
    (``_classify``). ``skip`` is the cut's own failover when it finished only after the heal
    (``_late_failover``): the election the fault itself causes, reported apart too."""
    if fault["kind"] not in ("partition-leader", "isolate-follower") or fault["end"] is None:
        return None
    last = fault["end"] + window if until is None else min(fault["end"] + window, until)
    mine = [e for e in events if e["shard"] == fault["shard"]]
    wanted = ("transfer",) if transfers else ("election", "gap")
    return sum(1 for e, kind in zip(mine, _classify(mine))
               if e is not skip and fault["end"] - 0.05 <= e["t"] <= last and kind in wanted)


def _late_failover(fault: dict, events: list[dict], window: float = 3.0,
                   until: float | None = None) -> dict | None:
    """The election a leader's partition causes, when the majority side had not finished it
    before the cut healed (a short hold; the first new leader can come ~2 s into the cut): the
    first change on that shard after the heal, before ``until`` (the next fault), to a leader
    other than the cut one in the term after the cut leader's, provided none happened during the
    cut. None when the failover finished in time, or for other faults."""
    if fault["kind"] != "partition-leader" or fault["end"] is None:
        return None
    begun = fault["invoked"] if fault.get("invoked") is not None else fault["start"]
    mine = [e for e in events if e["shard"] == fault["shard"]]
    before = [e for e in mine if e["t"] < begun and e["node"] is not None]
    cut_term = before[-1]["term"] if before else None
    new = [e for e in mine if e["node"] is not None and e["node"] != fault["node"]
           and e.get("won_by") != "transfer"]
    if any(begun <= e["t"] < fault["end"] - 0.05 for e in new):
        return None
    last = fault["end"] + window if until is None else min(fault["end"] + window, until)
    first = next((e for e in new if fault["end"] - 0.05 <= e["t"] <= last), None)
    if first is None or (cut_term is not None and first["term"] != cut_term + 1):
        return None
    return first


def _by_kind(faults: list[dict]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for f in faults:
        out.setdefault(f["kind"], {"n": 0, "times": []})
        out[f["kind"]]["n"] += 1
        if f["recovery_s"] is not None:
            out[f["kind"]]["times"].append(f["recovery_s"])
    return {k: {"n": v["n"], "p50": checks.percentile(v["times"], 50), "max": max(v["times"], default=None)}
            for k, v in out.items()}


def _failures(counter, lin, convergence, mono, loss, faults) -> list[str]:
    out = []
    if counter["lost"]:
        out.append(f"{counter['lost']} acknowledged pushes LOST")
    if counter["applied_twice"]:
        out.append(f"{counter['applied_twice']} pushes APPLIED TWICE")
    if counter["ok"] is None:
        out.append("counters could not be read after the run (no serving leader): verdict unknown")
    elif not counter["ok"] and not (counter["lost"] or counter["applied_twice"]):
        out.append("counter value and version disagree")
    if lin["ok"] is not True:
        out.append(f"register history: {lin['verdict']}")
    if convergence["diverged_shards"]:
        out.append(f"STATE DIVERGENCE on shard(s) {convergence['diverged_shards']}: replicas at the "
                   f"same applied index have different state hashes")
    elif convergence.get("not_serving"):
        out.append(f"the cluster was not serving after the run: {convergence['not_serving']}")
    elif not convergence["converged"]:
        out.append("replicas did not converge (some lag or do not answer) after quiescence")
    if not mono["ok"]:
        out.append(f"{mono['count']} non-monotonic reads / push versions")
    if not loss["ok"]:
        out.append(f"training loss did not fall ({loss.get('first')} -> {loss.get('last')}; "
                   f"{loss.get('reason', '')})")
    out += [f"fault {f['kind']}: {f['error']}" for f in faults if f.get("error")]
    return out


def _timeline(records: list[OpRecord], t0: float, t1: float) -> dict[str, Any]:
    """Per series (shard number or "train") and 1 s bin: ops acknowledged, failed, latency p50/max."""
    n = max(1, math.ceil((t1 - t0) / BIN))
    series: dict[str, dict[str, list]] = {}
    for r in records:
        name = "train" if r.shard < 0 else f"shard {r.shard}"
        b = int((r.ret - t0) / BIN)
        if not 0 <= b < n:
            continue
        s = series.setdefault(name, {"acked": [0] * n, "failed": [0] * n, "lat": [[] for _ in range(n)]})
        s["acked" if r.ok else "failed"][b] += 1
        if r.ok:
            s["lat"][b].append(r.ret - r.call)
    out = {}
    for name, s in sorted(series.items()):
        out[name] = {"acked": s["acked"], "failed": s["failed"],
                     "p50_ms": [round(statistics.median(v) * 1000, 2) if v else None for v in s["lat"]],
                     "max_ms": [round(max(v) * 1000, 2) if v else None for v in s["lat"]]}
    return {"bin_s": BIN, "series": out}


def write_report(report: dict[str, Any], out: Path) -> None:
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "report.md").write_text(markdown(report))
    try:
        from kvps_chaos.timeline import plot
    except ImportError:  # matplotlib is optional ([plots] extra)
        return
    plot(report, out / "timeline.png")


def _rejoins(faults: list[dict]) -> str:
    cuts = [f for f in faults if f.get("elections_after_heal") is not None]
    if not cuts:
        return "no partitions or isolations ran"
    disrupted = sum(1 for f in cuts if f["elections_after_heal"])
    why = " (the leader was deposed right after a heal)" if disrupted else ""
    moved = sum(1 for f in cuts if f.get("transfers_after_heal"))
    also = f"; {moved} more followed by a leadership transfer (leaders spreading)" if moved else ""
    late = sum(1 for f in cuts if f.get("failover_after_heal"))
    if late:
        also += (f"; {late} partitioned leader's failover finished just after the heal "
                 f"(the election the cut itself causes)")
    return f"{disrupted} of {len(cuts)}{why}{also}"


def _fmt(v: Any) -> str:
    return "-" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)


def markdown(r: dict[str, Any]) -> str:
    c, lin, fo = r["counter"], r["linearizability"], r["failover_s"]
    lines = [f"# kvps chaos run: {'PASSED' if r['ok'] else 'FAILED'}", "",
             f"seed {r['seed']}, {r['duration_s']:g} s, mode **{r['mode']}** ({r['mode_note']})  ",
             f"replay: `{r['replay']}`", ""]
    if r["unsafe_disable_dedup"]:
        lines += ["**Deliberately broken build: the duplicate table is disabled.**", ""]
    if r["failures"]:
        lines += ["## Failures", ""] + [f"- {f}" for f in r["failures"]] + [""]
    lines += ["## Summary", "", "| check | result |", "|---|---|",
              f"| faults injected | {sum(r['faults_by_kind'].values())}: "
              + ", ".join(f"{k} ×{v}" for k, v in sorted(r["faults_by_kind"].items())) + " |",
              f"| faults not run | {', '.join(r['faults_not_run']) or 'none'} |",
              f"| failover (client-visible recovery) | p50 {_fmt(fo['p50'])} s, max {_fmt(fo['max'])} s |",
              f"| counter pushes | acked {c['acked']}, unknown outcome {c['unknown']}, "
              f"lost {c['lost']}, applied twice {c['applied_twice']} |",
              f"| register history | {lin['verdict']} ({lin['ops']} ops, {lin['unknown']} unknown outcome) |",
              f"| replica state hashes | {'equal on every shard' if r['convergence']['ok'] else 'NOT equal'} |",
              f"| monotonic reads | {'ok' if r['monotonic']['ok'] else str(r['monotonic']['count']) + ' violations'} |",
              f"| longest availability gap | {_fmt(r['availability']['longest_gap_s'])} s |",
              f"| cuts followed by an election on heal | {_rejoins(r['faults'])} |",
              f"| training loss | {_fmt(r['training'].get('first'))} → {_fmt(r['training'].get('last'))} "
              f"({r['training']['steps']} steps, {r['training']['failed_steps']} failed) |",
              "| operations | " + ", ".join(f"{k} {v}" for k, v in sorted(r["ops"].items())) + " |",
              "", "## Failover by fault kind", "", "| fault | n | p50 (s) | max (s) |", "|---|---|---|---|"]
    lines += [f"| {k} | {v['n']} | {_fmt(v['p50'])} | {_fmt(v['max'])} |" for k, v in sorted(fo["by_kind"].items())]
    lines += ["", "## Faults", "", "| t (s) | fault | shard | node | recovery (s) | detail |", "|---|---|---|---|---|---|"]
    lines += [f"| {_fmt(f['start'])} | {f['kind']} | {_fmt(f['shard'])} | {_fmt(f['node'])} | "
              f"{_fmt(f['recovery_s'])} | {json.dumps(f['detail'])}{' ERROR: ' + f['error'] if f['error'] else ''} |"
              for f in r["faults"]]
    lines += ["", "![timeline](timeline.png)", ""]
    return "\n".join(lines)
