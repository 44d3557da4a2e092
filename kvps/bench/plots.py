"""PNG plots of a results dict (matplotlib, headless). Imported only when matplotlib is there."""
from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

__all__ = ["write_plots"]

MB = 1e6
LABELS = {"kvps": "kvps (3 replicas)", "kvps_procs0": "kvps, process\nper replica",
          "kvps_procs1": "kvps, replicas\nin node process", "redis": "Redis + 2 replicas",
          "rpc": "PyTorch RPC (1 copy)", "inmem": "in-memory"}


def write_plots(results: dict, out: Path) -> list[str]:
    written = []
    if "b1" in results:
        written.append(_b1(results["b1"], out / "b1_steps.png"))
    if "b2" in results:
        written.append(_b2(results["b2"], out / "b2_throughput.png"))
    if "b3" in results and results["b3"].get("kill_to_commit_s"):
        written.append(_b3(results["b3"], out / "b3_failover.png"))
    if "b4" in results:
        written.append(_b4(results["b4"], out / "b4_pulls.png"))
    if "b6" in results:
        written.append(_b6(results["b6"], out / "b6_sparse_rows.png"))
    if "b7" in results:
        written.append(_b7(results["b7"], out / "b7_small_keys.png"))
    return []  # nothing skipped


def _b1(b1: dict, path: Path) -> Path:
    colors = {"kvps": "#2a7", "kvps_procs0": "#5c9", "kvps_procs1": "#5c9", "redis": "#c33",
              "rpc": "#36c", "inmem": "#999"}
    names = [n for n in colors if n in b1["systems"]]
    values = [b1["systems"][n]["steps_per_s"] for n in names]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    bars = ax.bar([LABELS[n] for n in names], values, color=[colors[n] for n in names])
    ax.bar_label(bars, fmt="%.2f")
    ax.set_ylabel("steps/s (all workers)")
    ax.set_title("B1: pull + push of the whole model")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _b2(b2: dict, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, style in (("batched", "-o"), ("single", "--s")):
        table = b2.get(mode) or {}
        sizes = sorted(table, key=int)
        for system, color in (("kvps", "#2a7"), ("redis", "#c33")):
            pts = [(int(s), table[s][system]["bytes_per_s"] / MB) for s in sizes if system in table[s]]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color,
                        label=f"{LABELS[system]}, {mode}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("payload bytes")
    ax.set_ylabel("MB/s replicated")
    ax.set_title("B2: replicated writes, one writer")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _b3(b3: dict, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 3.5))
    times = b3["kill_to_commit_s"]
    stalls = [s for s in b3.get("stall_s", []) if s is not None and not math.isnan(s)]
    ax.plot(range(1, len(times) + 1), times, "o-", color="#2a7", label="kill → first commit")
    if stalls:
        ax.plot(range(1, len(stalls) + 1), stalls, "s--", color="#36c", label="training stall")
    ax.axhline(0.5, color="#999", lw=0.8, ls=":")
    ax.axhline(1.5, color="#c33", lw=0.8, ls=":")
    ax.set_xlabel("kill #")
    ax.set_ylabel("seconds")
    ax.set_title("B3: leader kill -9 under load")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _b4(b4: dict, path: Path) -> Path:
    cases = list(b4["cases"])
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.5))
    a1.bar(cases, [b4["cases"][c]["bytes"] / MB for c in cases], color="#2a7")
    a1.set_ylabel("MB received")
    a2.bar(cases, [b4["cases"][c]["ms_p50"] for c in cases], color="#36c")
    a2.set_ylabel("ms")
    for ax in (a1, a2):
        ax.tick_params(axis="x", rotation=30, labelsize=8)
    fig.suptitle("B4: pulls, full vs incremental")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _b6(b6: dict, path: Path) -> Path:
    names = [n for n in ("kvps", "redis", "rpc") if n in b6["systems"]]
    values = [b6["systems"][n]["rows_per_s"] for n in names]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    bars = ax.bar([LABELS[n] for n in names], values, color=["#2a7", "#c33", "#36c"][:len(names)])
    ax.bar_label(bars, fmt="%.0f")
    ax.set_ylabel("rows/s pulled + pushed (all workers)")
    ax.set_title(f"B6: Zipf(s={b6['workload']['zipf_s']}) embedding rows, dim {b6['workload']['dim']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _b7(b7: dict, path: Path) -> Path:
    names = [n for n in ("kvps", "redis") if n in b7["systems"]]
    parts = ("create_s", "pull_s", "push_s")
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(names)
    for i, (name, color) in enumerate(zip(names, ["#2a7", "#c33"])):
        xs = [j + i * width for j in range(len(parts))]
        bars = ax.bar(xs, [b7["systems"][name][p] for p in parts], width, label=LABELS[name], color=color)
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(parts))],
                  ["create all", "pull all", "push all"])
    ax.set_ylabel("seconds (lower is better)")
    w = b7["workload"]
    ax.set_title(f"B7: {w['keys']:,} keys of {w['key_bytes']:,} bytes")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
