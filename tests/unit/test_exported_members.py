"""Every module says what it exports: ``__all__`` exists, is sorted, names only what the module has,
and lists every public function and class the module defines (httpx's
``tests/test_exported_members.py`` is the model). A name left out is private by accident; an
unsorted list hides a duplicate. Package faces (``__init__.py``) re-export; they are checked too."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"kvps": ROOT / "kvps", "kvps_client": ROOT / "clients", "kvps_chaos": ROOT / "chaos"}
NOT_MODULES = {"__main__"}  # run as scripts, export nothing


def _modules() -> list[tuple[str, Path]]:
    out = []
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] in NOT_MODULES:
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out.append((".".join([package, *parts]), path))
    return out


def _defined(path: Path) -> set[str]:
    """Public functions and classes defined at the module's top level."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {node.name for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and not node.name.startswith("_")}


MODULES = _modules()


def test_every_module_is_found():
    names = {name for name, _ in MODULES}
    assert {"kvps.shard", "kvps.replica.replica", "kvps.raft.group", "kvps_client", "kvps_chaos.runner"} <= names


@pytest.mark.parametrize("name, path", MODULES, ids=[n for n, _ in MODULES])
def test_all_is_sorted_complete_and_true(name, path):
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", None)
    defined = _defined(path)
    if exported is None:
        assert not defined, f"{name} defines {sorted(defined)} but has no __all__"
        return
    assert list(exported) == sorted(exported), f"{name}.__all__ is not sorted"
    assert len(set(exported)) == len(exported), f"{name}.__all__ names something twice"
    missing = [n for n in exported if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names {missing}, which the module lacks"
    left_out = sorted(defined - set(exported))
    assert not left_out, f"{name} defines {left_out} without exporting them (make them _private?)"
