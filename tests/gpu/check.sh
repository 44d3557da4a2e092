#!/usr/bin/env bash
# The GPU checks of kvps_client.torch, in at most five minutes: copies on non-default streams while
# the default stream is busy, the pinned pool, AMP (autocast + GradScaler on CUDA), bf16, sparse
# embedding gradients and kvps Embedding lookups on the GPU, and (with two GPUs) a model split
# over both and no stray CUDA context on GPU 0. It runs tests/client/test_torch_cuda.py against a local
# cluster that the tests start and stop themselves.
#
#   tests/gpu/check.sh                  # with this checkout's .venv (make install)
#   PYTHON=/path/to/python tests/gpu/check.sh
#
# torch must be a CUDA build: `make install` installs the CPU wheel, so on a GPU machine point
# PYTHON at an environment whose torch sees the GPU (and has this checkout installed:
# `pip install -e .`). The script fails, instead of skipping everything, when no GPU is usable.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}

command -v nvidia-smi >/dev/null && nvidia-smi -L || echo "nvidia-smi: not found (going on)"
"$PY" - <<'PYEOF'
import sys
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, available: {torch.cuda.is_available()}, "
      f"devices: {torch.cuda.device_count()}")
if not torch.cuda.is_available():
    sys.exit("no usable GPU for this torch (a CPU build, or no device): nothing would be checked")
for i in range(torch.cuda.device_count()):
    print(f"  cuda:{i} {torch.cuda.get_device_name(i)}")
PYEOF

start=$(date +%s)
timeout 300 "$PY" -m pytest -q -p no:cacheprovider -rs tests/client/test_torch_cuda.py "$@"
echo "GPU checks passed in $(( $(date +%s) - start )) s"
