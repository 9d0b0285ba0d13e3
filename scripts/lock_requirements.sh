#!/usr/bin/env bash
# Rewrite requirements.lock from the venv `make test` built: the exact versions every later
# `make` installs (pip constraints). torch is pinned by scripts/install_torch.sh instead, its
# build (CPU or CUDA) depending on the machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
{
    echo "# Versions \`make test\` installs (pip constraints: pyproject.toml says what is needed, this file which"
    echo "# version). torch comes from scripts/install_torch.sh. Regenerate: scripts/lock_requirements.sh"
    "$PY" -m pip freeze --exclude-editable | grep -v -e "^torch==" -e "^pdserve"
} > requirements.lock
