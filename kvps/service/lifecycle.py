"""What every kvps process does the same way at its edges: log lines, stopping on a signal, and
the tuning of a process that hosts replicas (GIL switch interval, cyclic collector, malloc)."""
from __future__ import annotations

import asyncio
import ctypes
import gc
import json
import logging
import signal
import sys
import time

__all__ = ["GC_THRESHOLDS", "GcClock", "GcCollector", "HeapTrimmer", "MALLOC_SETTINGS", "freeze_heap", "gc_clock",
           "heap_trimmer", "setup_logging", "stop_event", "tune_for_replicas"]

# glibc returns every freed MB-sized buffer to the kernel (mmap threshold) and page-faults it
# back on the next command; keeping them in the heap cut the leader's CPU per committed GiB by
# ~40% in benchmarks/raft_raw.py (against --glibc-malloc). Bounded: at most ~128 MiB idle per process.
# As environment variables (a replica process's) and as mallopt(3) parameters (a running process).
MALLOC_SETTINGS = {"MMAP_THRESHOLD": 16 << 20, "TRIM_THRESHOLD": 128 << 20, "TOP_PAD": 16 << 20}
_MALLOPT = {"TRIM_THRESHOLD": -1, "TOP_PAD": -2, "MMAP_THRESHOLD": -3}  # <malloc.h> M_* values

# The cyclic collector's thresholds in a process hosting replicas. A request or command naming
# 10,000 small keys decodes into ~50,000 short-lived containers; at CPython's default (700, 10, 10)
# every 700 of them ran a young collection, survivors were promoted, and full collections over the
# whole replica state followed: ~2.3 s of collection per node in a 25 s many-small-keys run (B7),
# 0.15 s with these. Nearly all of those objects die by reference counting; the collector is only
# for cycles, which the replica code does not make in its hot paths.
GC_THRESHOLDS = (50_000, 20, 100)

log = logging.getLogger("kvps.service")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                 "fordblks", "keepcost")]


class HeapTrimmer:
    """Gives free heap pages back to the kernel once more than ``budget`` bytes of the heap are
    free, at most once per ``period`` seconds. The malloc settings above keep up to 128 MiB of freed
    heap on purpose (recycled push buffers); a capped table growing toward its cap, and then
    evicting on every push, frees row-sized arrays, and that kept heap put a replica's RSS
    60-90 MiB past the cap's bytes + 64 MiB (a 64 MiB budget trimmed once a second, keeping the
    top pad, still left it at the bound's edge: 199-218 MiB against 212.8). Called only where a
    table with a cap or a time-to-live added or evicted rows (``RowsChurned``): other processes
    never trim (glibc only)."""

    def __init__(self, budget: int = 32 << 20, period: float = 0.25) -> None:
        self.budget, self.period = budget, period
        self.trims = 0
        self._next = 0.0
        try:
            libc = ctypes.CDLL("libc.so.6")
            self._info, self._trim = libc.mallinfo2, libc.malloc_trim
        except (OSError, AttributeError):
            self._info = self._trim = None
        else:
            self._info.restype = _MallInfo2
            self._trim.argtypes = [ctypes.c_size_t]

    def free_bytes(self) -> int:
        """Bytes of the main heap and arenas that are free (0 off glibc)."""
        return int(self._info().fordblks) if self._info is not None else 0

    def maybe_trim(self) -> bool:
        """Trim if the period has passed and more than ``budget`` bytes are free; whether it did."""
        now = time.monotonic()
        if self._info is None or now < self._next:
            return False
        self._next = now + self.period
        if self.free_bytes() <= self.budget:
            return False
        self._trim(0)
        self.trims += 1
        return True


heap_trimmer = HeapTrimmer()  # the process's


class GcClock:
    """Seconds and collections of the cyclic collector, per generation, in this process (for
    ``kvps_gc_seconds_total`` / ``kvps_gc_collections_total``)."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.collections = [0, 0, 0]
        self._started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            generation = info["generation"]
            self.seconds[generation] += time.perf_counter() - self._started
            self.collections[generation] += 1


gc_clock = GcClock()


class GcCollector:
    """``gc_clock`` as Prometheus counters labelled with ``labels`` (a process's ``node`` and
    ``process``) and ``generation``; register it in one registry of the process: the figures are
    the whole process's, whatever registry shows them."""

    def __init__(self, labels: dict[str, str]) -> None:
        self._labels = labels

    def collect(self):
        from prometheus_client.core import CounterMetricFamily
        names = [*self._labels, "generation"]
        seconds = CounterMetricFamily("kvps_gc_seconds", "Time in the cyclic garbage collector", labels=names)
        runs = CounterMetricFamily("kvps_gc_collections", "Cyclic garbage collections", labels=names)
        for generation in range(3):
            values = [*self._labels.values(), str(generation)]
            seconds.add_metric(values, gc_clock.seconds[generation])
            runs.add_metric(values, gc_clock.collections[generation])
        return [seconds, runs]


def freeze_heap() -> None:
    """Move everything alive now (modules, classes, configuration: what start-up made) out of the
    collector's sight: a full collection then walks only what was made since."""
    gc.collect()
    gc.freeze()


def tune_for_replicas() -> None:
    """What a process hosting replicas sets before it starts them: a short GIL switch interval
    (the Raft thread and the event loop hand over constantly; at the default 5 ms each hand-over
    can stall a commit by 5 ms), the collector's thresholds and clock, and glibc's malloc settings
    above (best effort off glibc)."""
    sys.setswitchinterval(0.0005)
    gc.set_threshold(*GC_THRESHOLDS)
    if gc_clock not in gc.callbacks:
        gc.callbacks.append(gc_clock)
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    for name, value in MALLOC_SETTINGS.items():
        if libc.mallopt(_MALLOPT[name], value) != 1:
            log.warning("mallopt(M_%s, %d) refused", name, value)


class _JsonFormatter(logging.Formatter):
    """One JSON object per line, for log shippers."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": round(record.created, 6), "level": record.levelname, "logger": record.name,
                 "pid": record.process, "msg": record.getMessage()}
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(level: str, fmt: str) -> None:
    """``fmt``: "json" (one object per line) or "text"."""
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"))
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler])


def stop_event() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM (call inside the running loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop
