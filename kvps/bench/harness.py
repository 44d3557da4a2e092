"""Timed multi-process workloads: start workers, release them together, count steps in a window.

Every worker is a ``spawn``-ed process (no inherited sockets, locks or torch thread pools). It sets
itself up, reports ``ready``, waits for the common ``go`` time, then runs steps until the window
closes and reports each step's (start, end) in ``time.monotonic()`` (CLOCK_MONOTONIC, shared by all
processes on Linux). Steps/s counts the *overlap* of every step with the measuring window, so a
step that straddles the window's edge counts for the fraction inside it: at ~1 step/s per worker a
plain "completed in the window" count would be off by up to one step per worker.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "StepWindow", "Window", "page_cache_bytes", "process_usage", "run_workers", "steps_in_window",
    "summarize", "worker_loop",
]


@dataclass(frozen=True)
class Window:
    """When the workers start (``go``), start counting (``go + warmup``) and stop."""

    go: float
    warmup: float
    seconds: float

    @property
    def start(self) -> float:
        return self.go + self.warmup

    @property
    def end(self) -> float:
        return self.start + self.seconds


@dataclass
class StepWindow:
    """What one worker reports: its steps' (start, end) times and counters of its own."""

    steps: list[tuple[float, float]] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)
    error: str | None = None


def steps_in_window(steps: list[tuple[float, float]], start: float, end: float) -> float:
    """Steps inside ``[start, end]``, a straddling step counted by the fraction inside."""
    total = 0.0
    for s, e in steps:
        if e <= s:
            continue
        overlap = min(e, end) - max(s, start)
        if overlap > 0:
            total += overlap / (e - s)
    return total


def worker_loop(step: Callable[[], Any], window: Window, out: StepWindow) -> None:
    """Run ``step`` from ``window.go`` until a step ends after ``window.end``."""
    delay = window.go - time.monotonic()
    if delay > 0:
        time.sleep(delay)
    cpu0 = _own_cpu()
    try:
        _steps(step, window, out)
    finally:
        out.counters["cpu_s"] = _own_cpu() - cpu0


def _own_cpu() -> float:
    t = os.times()
    return t.user + t.system


def _steps(step: Callable[[], Any], window: Window, out: StepWindow) -> None:
    while True:
        t0 = time.monotonic()
        step()
        t1 = time.monotonic()
        out.steps.append((t0, t1))
        if t1 >= window.end:
            return


def _entry(target: Callable, args: tuple, ready: mp.Queue, go: mp.Queue, results: mp.Queue,
           rank: int) -> None:
    """Process entry: ``target(rank, *args)`` returns ``run(window) -> StepWindow``."""
    try:
        run = target(rank, *args)
    except BaseException:  # noqa: BLE001  report set-up failures to the parent instead of hanging it
        ready.put((rank, traceback.format_exc()))
        return
    ready.put((rank, None))
    window = go.get()
    try:
        report = run(window)
    except BaseException:  # noqa: BLE001  the parent re-raises it with the traceback
        report = StepWindow(error=traceback.format_exc())
    results.put((rank, report))


def run_workers(target: Callable, args: tuple, n: int, *, warmup: float, seconds: float,
                setup_timeout: float = 120.0,
                server: Callable[[], dict[str, float]] | None = None) -> list[StepWindow]:
    """Start ``n`` spawn-ed workers running ``target(rank, *args)``; return their reports.

    ``target`` must be a module-level function that sets the worker up and returns a function
    ``run(window) -> StepWindow``. Raises ``RuntimeError`` with the first worker's traceback when
    one fails; always terminates the processes it started. ``server()`` (``process_usage`` of the
    system's server processes) and the machine's page cache are sampled at the window's start and
    end; the differences land in every report's ``counters`` as ``server_cpu_s``,
    ``server_minflt`` and ``page_cache_bytes`` (``server()``'s over the warm-up, sampled when the
    workers start, as ``warmup_server_<name>``).
    """
    ctx = mp.get_context("spawn")
    ready, go, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(target, args, ready, go, results, rank), daemon=True)
             for rank in range(n)]
    try:
        for p in procs:
            p.start()
        for _ in range(n):
            rank, err = _get(ready, setup_timeout, procs, "worker set-up")
            if err:
                raise RuntimeError(f"worker {rank} failed to set up:\n{err}")
        window = Window(go=time.monotonic() + 0.2, warmup=warmup, seconds=seconds)
        for _ in range(n):
            go.put(window)
        samples: list[dict[str, float]] = []
        sample = lambda: samples.append({**server(), "page_cache_bytes": page_cache_bytes()})  # noqa: E731
        timers = [threading.Timer(max(0.0, t - time.monotonic()), sample)
                  for t in (window.go, window.start, window.end)] if server else []
        for t in timers:
            t.start()
        reports: dict[int, StepWindow] = {}
        for _ in range(n):
            rank, rep = _get(results, warmup + seconds + setup_timeout, procs, "worker results")
            if rep.error:
                raise RuntimeError(f"worker {rank} failed:\n{rep.error}")
            reports[rank] = rep
        for t in timers:
            t.join()
        for rep in reports.values():
            rep.counters["window_start"] = window.start
            rep.counters["window_end"] = window.end
            if len(samples) == 3:
                go, start, end = samples
                rep.counters.update({f"server_{k}" if k != "page_cache_bytes" else k: end[k] - v
                                     for k, v in start.items()})
                rep.counters.update({f"warmup_server_{k}": start[k] - v for k, v in go.items()
                                     if k != "page_cache_bytes"})
        return [reports[r] for r in range(n)]
    finally:
        for p in procs:
            if p.pid is None:  # never started
                continue
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()


def process_usage(match: Callable[[int, int, int], bool]) -> dict[str, float]:
    """CPU seconds (user + system, ``cpu_s``), minor page faults (``minflt``: pages the
    processes touched for the first time, DESIGN §11) and the number (``processes``) of the live
    processes for which ``match(pid, ppid, sid)``; ``cpu_live_s``: the CPU of their live
    threads, in nanoseconds from ``/proc/PID/task/*/schedstat`` (``cpu_s`` counts in clock ticks,
    10 ms, too coarse for an idle cluster over a short window; it also counts exited threads,
    which ``cpu_live_s`` does not)."""
    ticks = faults = count = live_ns = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if match(int(name), int(fields[1]), int(fields[3])):
            ticks += int(fields[11]) + int(fields[12])
            faults += int(fields[7])
            count += 1
            live_ns += _threads_cpu_ns(name)
    return {"cpu_s": ticks / os.sysconf("SC_CLK_TCK"), "minflt": faults, "processes": count,
            "cpu_live_s": live_ns / 1e9}


def _threads_cpu_ns(pid: str) -> int:
    """Nanoseconds on a CPU of process ``pid``'s live threads (0 where schedstat is missing)."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):  # gone meanwhile, or no schedstat
            continue
    return total


def page_cache_bytes() -> int:
    """The machine's page cache (``Cached`` in /proc/meminfo): what a journal grows when it
    writes to pages it never wrote before."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Cached:"):
                return int(line.split()[1]) * 1024
    return 0


def _get(q: mp.Queue, timeout: float, procs: list, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return q.get(timeout=0.5)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"{what}: a worker exited with code {dead[0].exitcode}") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: timed out after {timeout:.0f}s") from None


def summarize(reports: list[StepWindow], bytes_per_step: int) -> dict[str, float]:
    """Steps/s and nominal bytes/s over the window, summed over workers."""
    start = reports[0].counters["window_start"]
    end = reports[0].counters["window_end"]
    steps = sum(steps_in_window(r.steps, start, end) for r in reports)
    seconds = end - start
    lat = sorted(e - s for r in reports for s, e in r.steps if s >= start and e <= end)
    worker_cpu = sum(r.counters.get("cpu_s", 0.0) for r in reports)
    counters = reports[0].counters
    server_cpu = counters.get("server_cpu_s")
    cpu = {}
    if server_cpu is not None and steps > 0:
        # worker CPU covers the whole run (warm-up included); scale it to the window
        run_s = max(e for r in reports for _, e in r.steps) - min(s for r in reports for s, _ in r.steps)
        cpu = {"server_cpu_s_per_step": server_cpu / steps,
               "worker_cpu_s_per_step": worker_cpu * (seconds / run_s) / steps if run_s > 0 else float("nan"),
               "server_minflt_per_step": counters.get("server_minflt", 0) / steps,
               "page_cache_mib_per_step": counters.get("page_cache_bytes", 0) / steps / (1 << 20)}
    return {**cpu,
        "steps_per_s": steps / seconds,
        "bytes_per_s": steps * bytes_per_step / seconds,
        "steps_in_window": steps,
        "window_s": seconds,
        "step_ms_p50": 1000 * lat[len(lat) // 2] if lat else float("nan"),
        "step_ms_max": 1000 * lat[-1] if lat else float("nan"),
    }
