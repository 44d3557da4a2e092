"""What every kvps process does the same way at its edges: log lines, and stopping on a signal."""
from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import signal
import sys

__all__ = ["MALLOC_SETTINGS", "setup_logging", "stop_event", "tune_for_replicas"]

# glibc returns every freed MB-sized buffer to the kernel (mmap threshold) and page-faults it
# back on the next command; keeping them in the heap cut the leader's CPU per committed GiB by
# ~40% in benchmarks/raft_raw.py --tune-malloc. Bounded: at most ~128 MiB idle per process.
# As environment variables (a replica process's) and as mallopt(3) parameters (a running process).
MALLOC_SETTINGS = {"MMAP_THRESHOLD": 16 << 20, "TRIM_THRESHOLD": 128 << 20, "TOP_PAD": 16 << 20}
_MALLOPT = {"TRIM_THRESHOLD": -1, "TOP_PAD": -2, "MMAP_THRESHOLD": -3}  # <malloc.h> M_* values

log = logging.getLogger("kvps.service")


def tune_for_replicas() -> None:
    """What a process hosting replicas sets before it starts them: a short GIL switch interval
    (the Raft thread and the event loop hand over constantly; at the default 5 ms each hand-over
    can stall a commit by 5 ms) and glibc's malloc settings above (best effort off glibc)."""
    sys.setswitchinterval(0.0005)
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
