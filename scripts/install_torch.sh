#!/usr/bin/env bash
# Install torch into the given venv python, choosing the CPU build where there is no CUDA.
# A bare `pip install torch` pulls a multi-GB CUDA build, which a CPU box must never get.
set -euo pipefail
PY=${1:?usage: install_torch.sh PYTHON}
VERSION=2.13.0
if "$PY" -c "import torch" 2>/dev/null; then exit 0; fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$PY" -m pip install "torch==$VERSION"
elif "$PY" -m pip install "torch==$VERSION+cpu" 2>/dev/null; then
    :   # the CPU wheel was found locally (find-links) or on a configured index
else
    "$PY" -m pip install "torch==$VERSION" --index-url https://download.pytorch.org/whl/cpu
fi
