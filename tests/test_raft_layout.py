"""kvps/raft/ stays a package of small modules, one concept each, that its docstring names."""
from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

import kvps.raft

RAFT = Path(kvps.raft.__file__).parent
MODULES = sorted(p.stem for p in RAFT.glob("*.py") if p.stem != "__init__")
LIMIT, HARD_LIMIT = 450, 600  # lines; one module may pass LIMIT if its docstring says why


def test_the_package_docstring_lists_every_module_once():
    listed = re.findall(r"^\* ``(\w+)`` -- ", kvps.raft.__doc__, re.M)
    assert sorted(listed) == MODULES


def test_modules_stay_small():
    sizes = {name: len((RAFT / f"{name}.py").read_text().splitlines()) for name in MODULES}
    over = sorted(name for name, lines in sizes.items() if lines > LIMIT)
    assert len(over) <= 1, over
    for name in over:
        assert sizes[name] <= HARD_LIMIT, (name, sizes[name])
        head = (importlib.import_module(f"kvps.raft.{name}").__doc__ or "")[:600]
        assert "lines" in head, f"kvps.raft.{name} passes {LIMIT} lines without saying why at its top"


@pytest.mark.parametrize("name", ["__init__", *MODULES])
def test_all_is_sorted_and_names_what_exists(name):
    module = importlib.import_module("kvps.raft" if name == "__init__" else f"kvps.raft.{name}")
    exported = list(module.__all__)
    assert exported == sorted(exported, key=lambda n: (not n.isupper(), n)), "sorted: constants first"
    assert all(hasattr(module, n) for n in exported)
    tree = ast.parse((RAFT / f"{name}.py").read_text())
    defined = {node.name for node in tree.body
               if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_")}
    assert defined <= set(exported), sorted(defined - set(exported))
