# kvps: `make demo` and `make test` are the two commands a new machine needs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed

.PHONY: install chaos-deps test test-fast demo bench chaos clean

install: $(STAMP)

# torch is pinned to the CPU build that installs from the local wheel; a looser spec pulls a
# multi-GB CUDA build. The stamp makes `make install` idempotent and cheap when nothing changed.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[test,plots,bench]"
	touch $(STAMP)

# kvps chaos puts every node in its own network namespace and injects partitions, loss and delay
# with nftables; without them (not root, no apt) it runs on loopback with process faults only.
# Best effort, and a no-op when nft is already there.
chaos-deps:
	@if [ "$$(id -u)" = 0 ] && ! command -v nft >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then \
	  (apt-get install -y -q nftables iproute2 >/dev/null 2>&1 || \
	   (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q nftables iproute2 >/dev/null 2>&1)) || \
	  echo "nftables not installed: kvps chaos will run in loopback mode"; fi

test: install chaos-deps
	$(VENV)/bin/pytest -q

test-fast: install
	$(VENV)/bin/pytest -q -m "not cluster"

demo: install
	$(VENV)/bin/kvps demo --out demo-out

# kvps against Redis (primary + 2 replicas) and a PyTorch RPC server, side by side; a full run
# takes ~9 min. The Redis peer needs Debian's redis-server: installed here when missing (as root);
# if that fails the bench skips Redis with a line saying so. BENCH_ARGS=--quick for a short run.
BENCH_ARGS ?=
bench: install
	@command -v redis-server >/dev/null 2>&1 || { \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server >/dev/null 2>&1 || \
	  { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server >/dev/null 2>&1; } || \
	  echo "make bench: could not install redis-server; the Redis peer will be skipped"; }
	$(PIP) install -q -e ".[bench]"
	$(VENV)/bin/kvps bench --out bench-out $(BENCH_ARGS)

# A chaos run under training (DURATION=600 for the soak); report in chaos-out/.
chaos: install chaos-deps
	$(VENV)/bin/kvps chaos --duration $(or $(DURATION),120) --out chaos-out

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis demo-out chaos-out
