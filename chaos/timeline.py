"""``timeline.png``: throughput and latency per shard over time, fault spans, leader changes."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

__all__ = ["plot"]


def plot(report: dict[str, Any], path: Path) -> None:
    tl = report["timeline"]
    bin_s = tl["bin_s"]
    fig, (ax_tp, ax_lat) = plt.subplots(2, 1, figsize=(13, 7), sharex=True)
    colors = {}
    for name, s in tl["series"].items():
        xs = [i * bin_s for i in range(len(s["acked"]))]
        line, = ax_tp.plot(xs, [a / bin_s for a in s["acked"]], lw=1, label=name)
        colors[name] = line.get_color()
        fx = [x for x, f in zip(xs, s["failed"]) if f]
        ax_tp.plot(fx, [0] * len(fx), "x", color=line.get_color(), ms=4)
        pts = [(x, v) for x, v in zip(xs, s["p50_ms"]) if v is not None]
        if pts:
            ax_lat.plot(*zip(*pts), lw=1, color=line.get_color(), label=f"{name} p50")
        pts = [(x, v) for x, v in zip(xs, s["max_ms"]) if v is not None]
        if pts:
            ax_lat.plot(*zip(*pts), lw=0.5, ls=":", color=line.get_color())
    kinds = sorted({f["kind"] for f in report["faults"]})
    shade = {k: plt.get_cmap("tab10")(i % 10) for i, k in enumerate(kinds)}
    for ax in (ax_tp, ax_lat):
        for f in report["faults"]:
            end = f["ready"] if f["ready"] is not None else f["end"] or f["start"]
            ax.axvspan(f["start"], end, color=shade[f["kind"]], alpha=0.15, lw=0)
        for e in report["leader_changes"]:
            shard = f"shard {e['shard']}"
            ax.axvline(e["t"], color=colors.get(shard, "grey"), lw=0.6, ls="--", alpha=0.7)
    if len(report["faults"]) <= 30:  # beyond that the labels overlap: the legend says it
        top = ax_tp.get_ylim()[1]
        for f in report["faults"]:
            ax_tp.text(f["start"], top * 0.98, f["kind"], rotation=90, va="top", fontsize=7)
    handles = [plt.Rectangle((0, 0), 1, 1, color=shade[k], alpha=0.4) for k in kinds]
    if handles:
        ax_lat.legend(handles, kinds, loc="upper right", fontsize=7, ncol=5, title="faults (until serving)")
    ax_tp.set_ylabel("ops acknowledged / s  (x: failed)")
    ax_lat.set_ylabel("latency ms (p50 solid, max dotted)")
    ax_lat.set_yscale("log")
    ax_lat.set_xlabel("seconds since the workload started  (shaded: a fault until healed and every "
                      "shard serving; dashed: leader change)")
    ax_tp.legend(loc="upper right", fontsize=7, ncol=3)
    ax_tp.set_title(f"kvps chaos, seed {report['seed']}: {'PASSED' if report['ok'] else 'FAILED'}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
