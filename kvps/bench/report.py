"""From a results dict to ``results.json``, ``results.md`` and PNG plots.

``derive()`` adds what is computed from the raw figures: kvps as a fraction of the machine's
limits (B5) and the targets of issue #8 with met / missed.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

__all__ = ["b1_limit", "derive", "render_markdown", "write_outputs"]

MB = 1e6
MiB = 1 << 20

# (name, what, section path, threshold, comparison)
TARGETS = (
    ("b1_vs_redis", "B1 kvps steps/s ≥ 1.0 × Redis", ("b1", "ratio_vs_redis"), 1.0, ">="),
    ("b1_vs_rpc", "B1 kvps steps/s ≥ 0.25 × unreplicated RPC server", ("b1", "ratio_vs_rpc"), 0.25, ">="),
    ("b2_1mib_vs_redis", "B2 kvps bytes/s ≥ 0.3 × Redis at 1 MiB (batched)",
     ("b2", "batched", str(MiB), "ratio_vs_redis"), 0.3, ">="),
    ("b1_tcp_vs_redis", "B1 kvps with shared memory off (TCP only) ≥ 0.7 × Redis",
     ("b1", "tcp_ratio_vs_redis"), 0.7, ">="),
    ("b1_vs_redis_half", "B1 kvps steps/s ≥ 0.5 × Redis", ("b1", "ratio_vs_redis"), 0.5, ">="),
    ("b1_server_cpu", "B1 kvps server CPU ≤ 400 ms per step",
     ("b1", "systems", "kvps", "server_cpu_s_per_step"), 0.4, "<="),
    ("b1_server_faults", "B1 kvps server minor page faults ≤ 2,000 per step",
     ("b1", "systems", "kvps", "server_minflt_per_step"), 2000, "<="),
    ("b1_page_cache", "B1 page-cache growth ≤ 1 MiB per step (kvps)",
     ("b1", "systems", "kvps", "page_cache_mib_per_step"), 1.0, "<="),
    ("b1_elections", "B1 kvps elections with no fault = 0", ("b1", "systems", "kvps", "role_changes"), 0, "<="),
    ("b1_retries", "B1 kvps client retries = 0", ("b1", "systems", "kvps", "client_retries"), 0, "<="),
    ("b0_idle", "B0 idle settled cluster ≤ 0.05 cores (replicas in the node's process)",
     ("b0", "procs_1", "cores"), 0.05, "<="),
    ("b3_p50", "B3 kill → first commit p50 ≤ 0.5 s", ("b3", "p50_s"), 0.5, "<="),
    ("b3_max", "B3 kill → first commit max ≤ 1.5 s", ("b3", "max_s"), 1.5, "<="),
    ("b7_vs_redis", "B7 small keys, pull all + push all ≥ 1.0 × Redis", ("b7", "ratio_vs_redis"), 1.0, ">="),
    ("b7_create", "B7 kvps creating the keys ≤ 2 s", ("b7", "systems", "kvps", "create_s"), 2.0, "<="),
)


def _get(d: Any, path: tuple) -> Any:
    for part in path:
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d


def derive(results: dict) -> dict:
    b5 = results.get("b5")
    if b5:
        frac: dict[str, float] = {}
        kv_b1 = _get(results, ("b1", "systems", "kvps", "bytes_per_s"))
        kv_b2 = _get(results, ("b2", "batched", str(MiB), "kvps", "bytes_per_s"))
        for name, value in (("b1_bytes_per_s", kv_b1), ("b2_1mib_bytes_per_s", kv_b2)):
            if value:
                frac[f"{name}_of_loopback"] = value / b5["loopback_bytes_per_s"]
                frac[f"{name}_of_memcpy"] = value / b5["memcpy_bytes_per_s"]
        b5["kvps_fraction"] = frac
        b1 = results.get("b1")
        model = _get(results, ("meta", "model", "bytes"))
        if b1 and model:
            b1["limit"] = b1_limit(model, b5["loopback_bytes_per_s"], b5["memcpy_bytes_per_s"],
                                   results["meta"].get("cpus") or 1)
            for sys_ in b1["systems"].values():
                sys_["fraction_of_limit"] = sys_["steps_per_s"] / b1["limit"]["steps_per_s"]
    targets = []
    for name, what, path, threshold, op in TARGETS:
        value = _get(results, path)
        met = None if value is None or (isinstance(value, float) and math.isnan(value)) else (
            value >= threshold if op == ">=" else value <= threshold)
        targets.append({"name": name, "target": what, "measured": value, "threshold": threshold,
                        "met": met})
    results["targets"] = targets
    return results


# Bytes one B1 step must move with kvps's semantics, in units of the model's size M: over loopback
# TCP, the push to the leader, the leader's appends to two followers and the pull back (4 M); in
# memory, three journal writes (3 M), three SGD applies (each reads the gradient and the value and
# writes the value: 1.5 M of memcpy-equivalent traffic apiece, 4.5 M), one checksum pass per hop
# (client → leader, leader → each follower: 3 M) and the leader encoding the pull (1 M).
LIMIT_LOOPBACK_MODELS = 4.0
LIMIT_MEMORY_MODELS = 3.0 + 4.5 + 3.0 + 1.0
LIMIT_FORMULA = ("L = cores / (4 M / loopback + 11.5 M / memcpy): M = model bytes; 4 M over loopback "
                 "(push to the leader, two follower appends, the pull), 11.5 M through memory "
                 "(3 journal writes, 3 SGD applies at 1.5 M each, 3 checksum passes, 1 pull encode); "
                 "every core busy, nothing else: an upper bound for any system with these semantics")


def b1_limit(model_bytes: int, loopback: float, memcpy: float, cores: int) -> dict[str, Any]:
    """The physical limit L of B1 steps/s on this machine (``LIMIT_FORMULA``)."""
    seconds = (LIMIT_LOOPBACK_MODELS * model_bytes / loopback
               + LIMIT_MEMORY_MODELS * model_bytes / memcpy)  # core-seconds per step
    return {"steps_per_s": cores / seconds, "core_ms_per_step": 1000 * seconds,
            "formula": LIMIT_FORMULA, "cores": cores}


# ---- markdown -----------------------------------------------------------------------------------

def _f(x: Any, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def _ms(x: Any) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{1000 * x:.0f}"


def _mb(x: Any) -> str:
    return "–" if x is None else f"{x / MB:,.0f}"


def _size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // 1024} KiB"


def _pressure_md(m: dict) -> str:
    """``; waiting on io 8.6 % → 9.4 %, ...`` (5-minute averages at start and end), if known."""
    start, end = m.get("pressure_start") or {}, m.get("pressure_end") or {}
    shown = [f"{k} {start[k]:.1f} % → {end[k]:.1f} %" if k in end else f"{k} {start[k]:.1f} %"
             for k in ("io", "memory") if k in start]
    return "; tasks waiting on " + ", ".join(shown) + " (5-min averages, start → end)" if shown else ""


def render_markdown(r: dict) -> str:
    m = r["meta"]
    out = [f"# kvps bench — {m['plan']} run",
           "",
           (f"{m['started']} → {m.get('finished', '?')}; {m['cpus']} CPUs, Python {m['python']}; "
           f"load average at start {m['load_avg_start']}{_pressure_md(m)}. The machine is shared and "
           "noisy: compare the ratios (measured side by side in this run), not the absolutes."),
           ""]
    if r.get("skipped"):
        out += ["**Skipped:** " + "; ".join(f"{k}: {v}" for k, v in r["skipped"].items()), ""]
    out += _targets_md(r)
    if "b0" in r:
        out += _b0_md(r)
    if "b1" in r:
        out += _b1_md(r)
    if "b2" in r:
        out += _b2_md(r)
    if "b3" in r:
        out += _b3_md(r["b3"])
    if "b4" in r:
        out += _b4_md(r["b4"])
    if "b5" in r:
        out += _b5_md(r["b5"])
    if "b6" in r:
        out += _b6_md(r["b6"])
    if "b7" in r:
        out += _b7_md(r["b7"])
    return "\n".join(out) + "\n"


def _b6_md(b6: dict) -> list[str]:
    w = b6["workload"]
    rows = ["## B6 — sparse rows, Zipf ids (recommendation lookups)", "",
            (f"{w['workers']} workers; each step draws {w['lookups']} ids from Zipf(s={w['zipf_s']}) over "
             f"{w['rows']:,} rows of {w['dim']} float32, deduplicated (mean {w['rows_per_step']:.0f} rows), "
             "pulls them and pushes one gradient row each. kvps: `pull_rows` + `push_rows` (SGD on the "
             "leaders, 3 replicas); Redis: hash fields, `HMGET` then pipelined `HSET` + `WAIT 2`; "
             "RPC: one unreplicated server, `index_add_` under a lock."), "",
            "| system | rows/s | steps/s | step p50 ms | kvps / system |", "|---|---:|---:|---:|---:|"]
    for name, sys_ in b6["systems"].items():
        ratio = "–" if name == "kvps" else _f(b6.get(f"ratio_vs_{name}"))
        rows.append(f"| {name} | {sys_['rows_per_s']:,.0f} | {_f(sys_['steps_per_s'])} | "
                    f"{_f(sys_['step_ms_p50'], 1)} | {ratio} |")
    kv = b6["systems"].get("kvps")
    if kv and "pushes_per_entry" in kv:
        rows += ["", (f"kvps server CPU per step: {_f(kv['server_cpu_s_per_step'] * 1000, 1)} ms; push requests "
                      f"merged per Raft entry: {_f(kv['pushes_per_entry'])}; replica role changes: "
                      f"{kv.get('role_changes', '–')} (in the warm-up: {kv.get('role_changes_warmup', '–')}).")]
    return rows + [""]


def _b7_md(b7: dict) -> list[str]:
    w = b7["workload"]
    rows = ["## B7 — many small keys", "",
            (f"{w['keys']:,} dense keys of {w['key_bytes']:,} bytes; created once, then {w['rounds']} rounds of "
             "pull every key + push every key, one client. kvps: `create_many`, `pull`, `push` (Add, "
             "exactly once on 3 replicas); Redis: pipelined `SET`s + `WAIT 2`, pipelined `GET`s. Seconds: "
             "medians over the rounds."), "",
            "| system | create s | pull s | push s | round s | first pull s | kvps / system |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for name, sys_ in b7["systems"].items():
        ratio = "–" if name == "kvps" else _f(b7.get(f"ratio_vs_{name}"))
        rows.append(f"| {name} | {_f(sys_['create_s'])} | {_f(sys_['pull_s'], 3)} | {_f(sys_['push_s'], 3)} | "
                    f"{_f(sys_['round_s'], 3)} | {_f(sys_.get('first_pull_s'), 3)} | {ratio} |")
    return rows + [""]


def _b0_md(r: dict) -> list[str]:
    c = r["meta"].get("kvps_cluster", {})
    rows = ["## B0 — an idle cluster", "",
            (f"{c.get('nodes', 3)} nodes × {c.get('shards', 8)} shards × 3 replicas, started, "
             + ("leaders spread, " if c.get("spread_wait_s", 1) > 0 else
                "leaders where the elections put them (this plan does not wait for the spread), ")
             + "settled, then nobody calls it: CPU of every kvps process (nodes and replica "
             "processes) over the window, in cores."), "",
            "| replicas run | processes | idle cores | start → every shard served (s) | load |",
            "|---|---:|---:|---:|---:|"]
    where = {0: "one process per replica (`procs = 0`)", 1: "in the node's process (`procs = 1`)"}
    for row in r["b0"].values():
        rows.append(f"| {where[row['procs']]} | {row.get('processes', '–')} | {_f(row['cores'], 3)} | "
                    f"{_f(row.get('ready_s'), 1)} | {_f(row.get('load_avg'), 1)} |")
    return rows + [""]


def _targets_md(r: dict) -> list[str]:
    rows = ["## Targets", "", "| target | measured | met |", "|---|---:|:---:|"]
    for t in r.get("targets", []):
        met = {True: "yes", False: "**no**", None: "not measured"}[t["met"]]
        rows.append(f"| {t['target']} | {_f(t['measured'])} | {met} |")
    return rows + [""]


def _b1_md(r: dict) -> list[str]:
    m, b1 = r["meta"], r["b1"]
    rows = ["## B1 — parameter-server workload",
            "",
            (f"{m['workers']} worker processes; model {m['model']['tensors']} × "
            f"{_size(m['model']['tensor_bytes'])} float32 ({m['model']['bytes'] / MB:.0f} MB); one step = pull "
            "every tensor + push one gradient per tensor, no compute. Steps/s summed over workers; "
            "MB/s = steps × 2 × model size. CPU ms/step: the server processes (replicas and nodes, "
            "redis-servers, the RPC server) and the workers, per step in the window. "
            f"kvps journal fsync policy: `{m.get('kvps_cluster', {}).get('fsync', 'interval')}` "
            "(kvps's default; Redis runs with persistence off)."),
            "",
            "| system | steps/s | of L | MB/s moved | step p50 ms | server CPU ms/step | worker CPU ms/step "
            "| server faults/step | page cache MiB/step | updates lost | load | semantics |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    labels = {"kvps": "kvps (3 replicas, exactly-once)", "redis": "Redis primary + 2 replicas, WAIT 2",
              "rpc": "PyTorch RPC PS (1 copy)", "inmem": "in-memory, 1 process",
              "kvps_fsync_never": "kvps, fsync `never`",
              "kvps_tcp": "kvps, shared-memory pulls off (TCP only: workers on other hosts)",
              "kvps_procs0": "kvps, a process per replica (`procs = 0`)",
              "kvps_procs1": "kvps, replicas in the node's process (`procs = 1`)",
              "redis_aof": "Redis, WAIT 2, `appendonly yes` + `appendfsync everysec` on all three"}
    sem = {"rpc": "unreplicated: a crash loses the model", "inmem": "ceiling: no network, no copies kept"}
    for name in labels:
        s = b1["systems"].get(name)
        if s is None:
            continue
        lost = s.get("updates_lost")
        lost = "–" if lost is None else f"{lost:,} of {s['updates_pushed']:,}"
        rows.append(f"| {labels[name]} | {_f(s['steps_per_s'])} | {_f(s.get('fraction_of_limit'))} | "
                    f"{_mb(s['bytes_per_s'])} | "
                    f"{_f(s.get('step_ms_p50'), 0)} | {_ms(s.get('server_cpu_s_per_step'))} | "
                    f"{_ms(s.get('worker_cpu_s_per_step'))} | {_f(s.get('server_minflt_per_step'), 0)} | "
                    f"{_f(s.get('page_cache_mib_per_step'), 1)} | {lost} | {_f(s.get('load_avg'), 1)} | "
                    f"{s.get('semantics', sem.get(name, ''))} |")
    ratios = ", ".join(f"{k} = {_f(v)}" for k, v in b1.items() if k.startswith("ratio_vs_"))
    rows += ["", f"kvps steps/s ratios: {ratios or '–'}.", ""]
    limit = b1.get("limit")
    if limit:
        rows += [(f"**Physical limit** L = {_f(limit['steps_per_s'])} steps/s "
                  f"({_f(limit['core_ms_per_step'], 0)} core-ms per step), from this run's B5 rates: "
                  f"{limit['formula']}. \"of L\" is each system's steps/s over L."), ""]
    rows += [("Server faults: minor page faults of the server processes per step (pages touched for "
              "the first time: on this VM the dearest thing a server does, DESIGN §11); page cache: "
              "growth of the machine's page cache per step (a journal writing fresh pages). Updates "
              "lost: pushes whose gradient is missing from the final values (solved from them by "
              "least squares over each worker's fixed gradient), of all pushes the workers made."), ""]
    kv = b1["systems"].get("kvps")
    if kv and kv.get("wire_bytes"):
        rows += [(f"kvps wire bytes in the whole run (client bodies): {kv['wire_bytes'] / MB:,.0f} MB "
                 f"(and {kv.get('ring_bytes', 0) / MB:,.0f} MB in {kv.get('ring_requests', 0):,} push "
                 f"requests through the workers' shared-memory rings); "
                 f"client retries: {kv.get('client_retries', 0)}; replica role changes (elections "
                 f"with no fault injected) during B1: {kv.get('role_changes', '–')} (in its warm-up: "
                 f"{kv.get('role_changes_warmup', '–')}); push requests merged per "
                 f"Raft entry: {_f(kv.get('pushes_per_entry'))}; blocks pulls read from the leaders' "
                 f"shared-memory mirrors: {kv.get('mirror_blocks', 0):,} (shard pulls that went over TCP "
                 f"instead: {kv.get('mirror_fallbacks', 0):,}, by reason: "
                 f"{kv.get('mirror_fallback_reasons') or '–'})."), ""]
    return rows


def _b2_md(r: dict) -> list[str]:
    rows = ["## B2 — raw replicated writes by payload size (one writer, distinct keys)", "",
            ("Batched: ~4 MiB of writes per batch (kvps: one `push` of k keys; Redis: k pipelined SETs "
            "+ `WAIT 2`), one batch outstanding. One at a time: k = 1."), ""]
    for mode, title in (("batched", "batched"), ("single", "one write at a time")):
        table = r["b2"].get(mode) or {}
        if not table:
            continue
        rows += [f"**{title}**", "",
                 "| size | k | kvps MB/s | Redis MB/s | kvps / Redis | kvps batch p50 ms | Redis batch p50 ms |",
                 "|---:|---:|---:|---:|---:|---:|---:|"]
        for size in sorted(table, key=int):
            row = table[size]
            kv, rd = row.get("kvps", {}), row.get("redis", {})
            k = kv.get("batch", rd.get("batch"))
            rows.append(f"| {_size(int(size))} | {k} | {_mb(kv.get('bytes_per_s'))} | {_mb(rd.get('bytes_per_s'))} | "
                        f"{_f(row.get('ratio_vs_redis'))} | {_f(kv.get('batch_ms_p50'), 1)} | "
                        f"{_f(rd.get('batch_ms_p50'), 1)} |")
        rows.append("")
    return rows


def _b3_md(b3: dict) -> list[str]:
    rows = ["## B3 — failover under load", "",
            (f"{b3['kills']} × `kill -9` of a shard leader (shards in turn) while a training loop "
            f"({b3['model']['tensors']} × {_size(b3['model']['tensor_bytes'])}, pull all + push all) runs. "
            "kill → first commit: from the kill to the acknowledgement of a push sent right after it "
            "to the killed shard. Stall: the longest training step overlapping the 5 s after the kill, "
            f"minus the median step before the first kill ({_f(b3['trainer_step_p50_s'] * 1000, 0)} ms)."),
            "",
            "| | p50 | p90 | max |", "|---|---:|---:|---:|",
            f"| kill → first commit (s) | {_f(b3['p50_s'])} | {_f(b3['p90_s'])} | {_f(b3['max_s'])} |",
            f"| training stall (s) | {_f(b3['stall_p50_s'])} | – | {_f(b3['stall_max_s'])} |",
            "",
            "Every kill (s): " + ", ".join(_f(t) for t in b3["kill_to_commit_s"]), ""]
    if b3.get("trainer_error"):
        rows += [f"**Trainer error:** {b3['trainer_error']}", ""]
    return rows


def _b4_md(b4: dict) -> list[str]:
    rows = ["## B4 — pulls: full vs incremental", "",
            f"Model {b4['tensors']} tensors, {b4['model_bytes'] / MB:.0f} MB; median of {b4['repeats']}. "
            "Measured: " + b4["note"] + ".", "",
            "| case | tensors changed | bytes received | of full | time ms |", "|---|---:|---:|---:|---:|"]
    for case, c in b4["cases"].items():
        rows.append(f"| {case} | {c['changed_tensors']} | {c['bytes']:,} | {_f(c['fraction_of_full_bytes'], 3)} | "
                    f"{_f(c['ms_p50'], 1)} |")
    return rows + [""]


def _b5_md(b5: dict) -> list[str]:
    rows = ["## B5 — the machine's limits, same run", "",
            "| limit | MB/s |", "|---|---:|",
            f"| loopback TCP, blocking sockets, 1 MiB writes | {_mb(b5['loopback_bytes_per_s'])} |",
            f"| memcpy (numpy, 64 MiB, 1 thread) | {_mb(b5['memcpy_bytes_per_s'])} |", ""]
    frac = b5.get("kvps_fraction") or {}
    if frac:
        rows += ["kvps as a fraction of them: " + ", ".join(f"{k} = {_f(v, 3)}" for k, v in frac.items()), ""]
    return rows


# ---- files ----------------------------------------------------------------------------------------

def write_outputs(results: dict, out: Path) -> list[str]:
    """Write results.json, results.md and the plots; returns lines about anything skipped."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(_clean(results), indent=2, allow_nan=False) + "\n")
    (out / "results.md").write_text(render_markdown(results))
    try:
        from kvps.bench.plots import write_plots
    except ImportError as exc:
        return [f"plots skipped: {exc} (pip install 'kvps[plots]')"]
    return write_plots(results, out)


def _clean(obj: Any) -> Any:
    """JSON-ready: NaN/inf become null (strict JSON has neither), numpy scalars plain numbers."""
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if hasattr(obj, "item") and not isinstance(obj, (str, bytes)):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj
