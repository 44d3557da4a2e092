"""kvps/raft/ stays a package of small modules, one concept each, that its docstring names."""
from __future__ import annotations

import importlib
import re
from pathlib import Path


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

