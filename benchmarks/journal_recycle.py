"""The journal in a steady append + compaction loop: page faults and time per appended MiB.

    .venv/bin/python benchmarks/journal_recycle.py                      # this checkout's journal
    PYTHONPATH=/work/main .venv/bin/python benchmarks/journal_recycle.py  # another checkout's

Appends ``--command-mib`` commands (the same bytes object every time, so only the journal's own
memory is measured), and every ``--compact-mib`` calls ``deleteEntriesTo`` keeping the last
``--keep`` entries, as pysyncobj does after a compaction. After ``--warmup-mib`` it measures
``--measure-mib``: minor page faults (``/proc/self/stat`` minflt, all threads), wall and CPU
seconds (all threads: the old journal's rewriter, the new one's segment worker) per MiB, and how
much the page cache grew (``/proc/meminfo`` Cached) and how many pages the kernel allocated
(``/proc/vmstat`` pgalloc: page cache pages are not the process's page faults), both machine-wide
and noisy on a shared machine. At the end of the
measured span it waits for the journal's background work (a pending rewrite, segments to free).
Prints one JSON line, labelled with the journal found (``segments`` or ``single-file``).

Measured here (2026-12, 2 shared cores, ext4 with discard; 1 MiB commands, compaction every
64 MiB keeping 8, 1 GiB measured after 512 MiB, two runs each):

    journal       fsync     minflt/MiB  pgalloc/MiB  wall ms/MiB  cpu ms/MiB  sys ms/MiB
    single-file   never     0.0         556-574      4.2-4.6      1.06-1.14   1.00-1.10
    segments      never     0.0         7            0.41-0.80    0.18-0.19   0.13-0.15
    single-file   interval  0.0         535-585      3.1-5.2      1.05-1.08   0.99-1.05
    segments      interval  0.0         21-37        0.45-0.50    0.22-0.23   0.18

minflt stays 0 for both: the journal writes with pwritev, so its fresh memory is page cache the
kernel allocates (pgalloc: ~2 pages per appended 4 KiB page for the single-file journal, the
append and the compaction's copy into a new file), not faults of the process.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import tempfile
import time
from pathlib import Path

import kvps.raft.journal
from kvps.raft.journal import RaftJournal

MiB = 1 << 20


def minflt() -> int:
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])  # field 10: minflt


def cached_kib() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Cached:"):
                return int(line.split()[1])
    return 0


def pgalloc() -> int:
    """Pages the kernel allocated, machine-wide (``/proc/vmstat``: page cache pages included,
    which the process's minflt does not count; noisy on a shared machine)."""
    with open("/proc/vmstat") as f:
        return sum(int(line.split()[1]) for line in f if line.startswith("pgalloc_"))


def settle(j: RaftJournal) -> None:
    for name in ("_settle", "_wait_rewritten"):  # the segment worker, or the old rewriter
        if hasattr(j, name):
            getattr(j, name)()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--command-mib", type=float, default=1.0)
    ap.add_argument("--compact-mib", type=int, default=64)
    ap.add_argument("--keep", type=int, default=8)
    ap.add_argument("--warmup-mib", type=int, default=512)
    ap.add_argument("--measure-mib", type=int, default=1024)
    ap.add_argument("--segment-mib", type=int, default=64)
    ap.add_argument("--fsync", default="never", choices=["never", "interval", "always"])
    ap.add_argument("--dir", default=None, help="where the journal goes (default: a temp dir)")
    args = ap.parse_args()

    params = inspect.signature(RaftJournal).parameters
    kwargs = {"fsync": args.fsync}
    if "segment_bytes" in params:
        kwargs["segment_bytes"] = args.segment_mib * MiB
    kind = "segments" if "segment_bytes" in params else "single-file"
    command = os.urandom(int(args.command_mib * MiB))
    per_compaction = max(1, int(args.compact_mib / args.command_mib))
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="kvps-journal-bench-") as d:
        j = RaftJournal(Path(d) / "raft.journal", **kwargs)
        index = 0

        def run(mib: int) -> None:
            nonlocal index
            for _ in range(int(mib / args.command_mib)):
                index += 1
                j.add(command, index, 1)
                if index % per_compaction == 0:
                    j.deleteEntriesTo(len(j) - args.keep)

        run(args.warmup_mib)
        settle(j)
        f0, c0, a0, w0 = minflt(), cached_kib(), pgalloc(), time.perf_counter()
        t0 = os.times()
        run(args.measure_mib)
        settle(j)
        t1 = os.times()
        wall = time.perf_counter() - w0
        faults, cached, allocated = minflt() - f0, cached_kib() - c0, pgalloc() - a0
        files = sorted(p.name for p in Path(d).iterdir())
        j._destroy()
    cpu = (t1.user - t0.user) + (t1.system - t0.system)
    print(json.dumps({
        "journal": kind, "fsync": args.fsync, "measured_mib": args.measure_mib,
        "minflt_per_mib": round(faults / args.measure_mib, 1),
        "pgalloc_per_mib": round(allocated / args.measure_mib, 1),  # 256 = every MiB fresh
        "wall_ms_per_mib": round(1000 * wall / args.measure_mib, 3),
        "cpu_ms_per_mib": round(1000 * cpu / args.measure_mib, 3),
        "sys_ms_per_mib": round(1000 * (t1.system - t0.system) / args.measure_mib, 3),
        "page_cache_growth_mib": round(cached / 1024, 1),
        "files": len(files), "module": kvps.raft.journal.__file__,
    }))


if __name__ == "__main__":
    main()
