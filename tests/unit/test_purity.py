"""The layers of STYLE §1 and their import directions.

- The pure core (every module directly in ``kvps/`` and in ``kvps/delta/``, found by globbing, not
  by a list) imports no I/O, clock, randomness or threads: importing each in a fresh interpreter
  leaves the forbidden modules out of ``sys.modules`` (transitive imports included), and none
  imports ``time`` or ``random`` itself (numpy loads ``time`` on its own, so ``sys.modules``
  cannot tell).
- Imports point one way: the core imports no adapter; the replica host imports nothing of the
  node, the command line or the tools above it; the client imports only the core (of ``kvps``).
  Checked on every import statement of every module, function-level imports included.
"""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ["aiohttp", "asyncio", "pysyncobj", "random", "socket", "subprocess", "threading"]


def _modules(folder: str, package: str) -> list[str]:
    return sorted(f"{package}.{p.stem}" if p.stem != "__init__" else package
                  for p in (ROOT / folder).glob("*.py"))


PURE = _modules("kvps", "kvps") + _modules("kvps/delta", "kvps.delta")
ADAPTERS = ("kvps.raft", "kvps.replica", "kvps.node", "kvps.service", "kvps.cli", "kvps.demo",
            "kvps.bench", "kvps_client", "kvps_chaos")


def _path(module: str) -> Path:
    parts = module.split(".")
    base = ROOT / "/".join(parts)
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def _imports(path: Path) -> set[str]:
    """Every module named by an import statement in ``path`` (absolute names)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{alias.name}" for alias in node.names}
    return out


def _under(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def test_the_pure_core_is_found_by_globbing():
    assert {"kvps.shard", "kvps.command", "kvps.delta.frame", "kvps.clocks"} <= set(PURE)
    assert not any(_under(m, ADAPTERS) for m in PURE)


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
def test_no_direct_import_of_clock_io_or_adapters(name):
    roots = {m.split(".")[0] for m in _imports(_path(name))}
    assert not roots & {*FORBIDDEN, "time"}, f"{name} imports {sorted(roots & {*FORBIDDEN, 'time'})}"
    adapters = sorted(m for m in _imports(_path(name)) if _under(m, ADAPTERS))
    assert not adapters, f"{name} (pure core) imports {adapters}"


def _package_imports(folder: str) -> dict[str, set[str]]:
    return {str(p.relative_to(ROOT)): _imports(p) for p in sorted((ROOT / folder).rglob("*.py"))}


@pytest.mark.parametrize("folder, banned", [
    ("kvps/replica", ("kvps.node", "kvps.cli", "kvps.demo", "kvps.bench", "kvps_chaos")),
    ("kvps/raft", ("kvps.replica", "kvps.node", "kvps.service", "kvps.cli", "kvps.demo",
                   "kvps.bench", "kvps_client", "kvps_chaos")),
    ("kvps/service", ("kvps.raft", "kvps.replica", "kvps.node", "kvps.cli", "kvps.demo",
                      "kvps.bench", "kvps_client", "kvps_chaos")),
    ("clients", ADAPTERS[:-2] + ("kvps_chaos",)),
])
def test_imports_point_one_way(folder, banned):
    wrong = {f: sorted(m for m in names if _under(m, banned))
             for f, names in _package_imports(folder).items()}
    assert {f: m for f, m in wrong.items() if m} == {}
