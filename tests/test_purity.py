"""The pure core imports no I/O, clock, randomness or threads (STYLE §1).

Two checks: importing each module in a fresh interpreter leaves the forbidden modules out of
``sys.modules`` (transitive imports included); and no pure module imports ``time`` itself (numpy
loads ``time`` on its own, so ``sys.modules`` cannot tell).
"""
from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys

import pytest

PURE = [
    "kvps.errors", "kvps.config", "kvps.placement", "kvps.optimizer", "kvps.initializer",
    "kvps.command", "kvps.shard", "kvps.table", "kvps.applied", "kvps.merge", "kvps.clocks",
    "kvps.delta.frame", "kvps.delta.codec", "kvps.history", "kvps.assignment", "kvps.meta", "kvps.hyper",
]
FORBIDDEN = ["pysyncobj", "aiohttp", "asyncio", "socket", "random", "threading"]


def test_pure_modules_pull_in_nothing_forbidden():
    code = (
        "import importlib, json, sys\n"
        f"out = {{}}\n"
        f"for name in {PURE!r}:\n"
        "    importlib.import_module(name)\n"
        f"    out[name] = sorted(m for m in {FORBIDDEN!r} if m in sys.modules)\n"
        "print(json.dumps(out))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    assert found == {name: [] for name in PURE}  # the first module to pull one in is named


def test_the_check_would_notice():
    """Guard against a vacuous test: importing an adapter-only module does show up."""
    code = "import sys, asyncio; print('asyncio' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "True"


@pytest.mark.parametrize("name", PURE)
def test_no_direct_import_of_clock_or_io(name):
    path = importlib.util.find_spec(name).origin
    tree = ast.parse(open(path, encoding="utf-8").read())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module.split(".")[0])
    assert not imported & {*FORBIDDEN, "time"}, f"{name} imports {sorted(imported & {*FORBIDDEN, 'time'})}"
