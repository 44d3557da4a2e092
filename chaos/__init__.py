"""kvps_chaos: fault injection and checks for kvps clusters.

    from kvps_chaos import ChaosOptions, run_chaos
    report = run_chaos(ChaosOptions(duration=120, seed=7, out=Path("chaos-out")))
    assert report["ok"], report["failures"]

``kvps chaos`` is the command-line front end (``kvps_chaos.cli``); ``kvps_chaos.linearizability``
is the history checker, usable on its own. Names are imported on first use, so the helper
processes (``python -m kvps_chaos.proxy``, ``python -m kvps_chaos.training``) load only what they need.
"""
from importlib import import_module
from typing import Any

__all__ = [
    "ChaosOptions", "CheckResult", "Operation", "RegisterModel", "UNKNOWN", "check",
    "check_per_key", "run_chaos",
]

_HOME = {"ChaosOptions": "runner", "run_chaos": "runner"}


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'kvps_chaos' has no attribute {name!r}")
    return getattr(import_module(f"kvps_chaos.{_HOME.get(name, 'linearizability')}"), name)
