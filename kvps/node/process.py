"""Child processes: spawn with a log file, die with the parent, stop a whole process group.

Linux's ``PR_SET_PDEATHSIG`` makes a child receive SIGKILL when the process that started it dies,
so a ``kill -9`` of a node supervisor takes its replicas with it (that is what "a node died"
means), and a killed ``kvps up`` or test never leaves replicas behind.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["python_module_args", "spawn", "stop_process"]

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: best effort only
        pass


def python_module_args(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def spawn(args: Sequence[str], log_path: Path | None, *, new_session: bool = False,
          env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``args``; stdout and stderr append to ``log_path`` (or are inherited)."""
    out = None
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        out = open(log_path, "ab")
    try:
        return subprocess.Popen(
            list(args), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT if out else None,
            preexec_fn=_die_with_parent, start_new_session=new_session,
            env={**os.environ, **(env or {})})
    finally:
        if out is not None:
            out.close()


def stop_process(proc: subprocess.Popen, *, timeout: float = 5.0, group: bool = False) -> None:
    """SIGTERM, wait up to ``timeout``, then SIGKILL. ``group``: signal its process group."""
    if proc.poll() is not None:
        return
    _signal(proc, signal.SIGTERM, group)
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            proc.wait(timeout=0.05)
        except subprocess.TimeoutExpired:
            pass
    if proc.poll() is None:
        _signal(proc, signal.SIGKILL, group)
        proc.wait()
    elif group:
        _signal(proc, signal.SIGKILL, group)  # stragglers in the group


def _signal(proc: subprocess.Popen, sig: int, group: bool) -> None:
    try:
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
    except (ProcessLookupError, PermissionError):
        pass
