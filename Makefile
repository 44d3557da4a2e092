# kvps: `make demo` and `make test` are the two commands a new machine needs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed

.PHONY: install test test-fast demo bench clean

install: $(STAMP)

# torch is pinned to the CPU build that installs from the local wheel; a looser spec pulls a
# multi-GB CUDA build. The stamp makes `make install` idempotent and cheap when nothing changed.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[test,plots]"
	touch $(STAMP)

test: install
	$(VENV)/bin/pytest -q

test-fast: install
	$(VENV)/bin/pytest -q -m "not cluster"

demo: install
	$(VENV)/bin/kvps demo --out demo-out

bench: install
	$(PY) benchmarks/replicated_push.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis demo-out
