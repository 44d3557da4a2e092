"""kvps_chaos: fault injection and checks for kvps clusters.

    from kvps_chaos import ChaosOptions, run_chaos
    report = run_chaos(ChaosOptions(duration=120, seed=7, out=Path("chaos-out")))
    assert report["ok"], report["failures"]

``kvps chaos`` is the command-line front end (``kvps_chaos.cli``); ``kvps_chaos.linearizability``
is the history checker, usable on its own.
"""
from kvps_chaos.linearizability import UNKNOWN, CheckResult, Operation, RegisterModel, check, check_per_key
from kvps_chaos.runner import ChaosOptions, run_chaos

__all__ = [
    "UNKNOWN",
    "ChaosOptions",
    "CheckResult",
    "Operation",
    "RegisterModel",
    "check",
    "check_per_key",
    "run_chaos",
]
