#!/usr/bin/env bash
# Build llama.cpp's `llama-server` from source, and a venv for its checkpoint converter, for
# benchmarks/bench_peers.py only (llama.cpp is the CPU anchor among the peers).
#
#     scripts/install_llama_cpp.sh [PREFIX]     (default: $PDSERVE_LLAMA_CPP or ~/.cache/pdserve/llama.cpp-$VERSION)
#
# The sources come from PyPI, the only registry this project's machines reach: the sdist of
# llama-cpp-python vendors llama.cpp whole (vendor/llama.cpp: CMake build, convert_hf_to_gguf.py,
# gguf-py). Its CHANGELOG names the llama.cpp commit each release vendors; that commit is written to
# PREFIX/LLAMA_CPP_COMMIT (the sdist has no .git, so the binary's own build info says "unknown").
#
# PREFIX/bin/llama-server            the server, built for this CPU (GGML_NATIVE)
# PREFIX/src                         the llama.cpp sources (convert_hf_to_gguf.py lives here)
# PREFIX/gguf-venv                   python for the converter: ./gguf-py, torch (CPU), transformers, sentencepiece
#
# Nothing here is a dependency of pdserve nor of `make test`. Idempotent: a stamp records a finished
# install of this exact version; rerunning is a no-op.
set -euo pipefail

VERSION=0.3.36   # llama-cpp-python; vendors ggml-org/llama.cpp@0c1e57098
TORCH_VERSION=2.13.0+cpu
PREFIX=${1:-${PDSERVE_LLAMA_CPP:-$HOME/.cache/pdserve/llama.cpp-$VERSION}}
PYTHON=${PYTHON:-python3}
JOBS=${JOBS:-$(nproc)}
STAMP="$PREFIX/.installed-$VERSION"
VENV="$PREFIX/gguf-venv"
# GGML_NATIVE builds for this CPU's instruction sets; a machine with others (this project's machines
# vary between AVX2 and AVX-512) needs its own build, so the binary is stamped with the CPU's flags.
CPU_FLAGS=$(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2 | tr ' ' '\n' | sort | tr '\n' ' ' | sed 's/^ *//;s/ *$//')

log() { echo "install_llama_cpp: $*" >&2; }

if [ -f "$PREFIX/bin/CPU_FLAGS" ] && [ "$(cat "$PREFIX/bin/CPU_FLAGS")" != "$CPU_FLAGS" ]; then
    log "llama-server was built for another CPU: rebuilding for this one"
    rm -rf "$PREFIX/bin" "$PREFIX/build" "$STAMP"
fi
if [ -f "$STAMP" ] && [ -x "$PREFIX/bin/llama-server" ] && "$VENV/bin/python" -c "import gguf, torch, transformers" 2>/dev/null; then
    log "llama.cpp (llama-cpp-python $VERSION) already installed in $PREFIX"
    exit 0
fi
mkdir -p "$PREFIX"

# 1. The sources: the sdist only (--no-binary), nothing of it is built or installed by pip.
if [ ! -f "$PREFIX/src/CMakeLists.txt" ]; then
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    "$PYTHON" -m pip download -q --no-deps --no-binary :all: -d "$tmp" "llama-cpp-python==$VERSION"
    tar -xzf "$tmp"/llama_cpp_python-"$VERSION".tar.gz -C "$tmp"
    rm -rf "$PREFIX/src"
    mv "$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp" "$PREFIX/src"
    # "feat: update llama.cpp to ggml-org/llama.cpp@<commit>" under this release's heading.
    sed -n "/^## \[$VERSION\]/,/^## \[/p" "$tmp/llama_cpp_python-$VERSION/CHANGELOG.md" \
        | grep -o 'llama.cpp@[0-9a-f]*' | head -1 | cut -d@ -f2 > "$PREFIX/LLAMA_CPP_COMMIT"
    log "llama.cpp sources: commit $(cat "$PREFIX/LLAMA_CPP_COMMIT") (from llama-cpp-python $VERSION)"
fi

# 2. llama-server. No OpenSSL (the server talks plain HTTP on 127.0.0.1) and no prebuilt web UI
# (which CMake would fetch from the network). GGML_NATIVE builds for this machine's SIMD (AVX2/AVX-512).
# An unstamped binary (an interrupted install) is rebuilt: incrementally, from the build directory.
if [ ! -x "$PREFIX/bin/llama-server" ] || [ ! -f "$PREFIX/bin/CPU_FLAGS" ]; then
    cmake -S "$PREFIX/src" -B "$PREFIX/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
        -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DBUILD_SHARED_LIBS=OFF >/dev/null
    cmake --build "$PREFIX/build" --target llama-server -j "$JOBS" -- --no-print-directory >/dev/null
    mkdir -p "$PREFIX/bin"
    cp "$PREFIX/build/bin/llama-server" "$PREFIX/bin/llama-server"
    echo "$CPU_FLAGS" > "$PREFIX/bin/CPU_FLAGS"
fi

# 3. The converter's venv: llama.cpp's own gguf-py (from the same sources, so converter and library
# agree), torch's CPU build (a bare `torch` from PyPI would be a multi-GB CUDA build), transformers
# for the tokenizer (5.x: the bundled tokenizer_config.json is in its format, as pdserve's venv has it),
# sentencepiece as the converter's requirements list.
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    "$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION" \
        || "$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION" --extra-index-url https://download.pytorch.org/whl/cpu
fi
"$VENV/bin/python" -m pip install -q "$PREFIX/src/gguf-py" "transformers==5.25.0" sentencepiece "protobuf>=4.21" "torch==$TORCH_VERSION"

"$PREFIX/bin/llama-server" --version 2>&1 | tail -2 >&2
"$VENV/bin/python" "$PREFIX/src/convert_hf_to_gguf.py" --help >/dev/null
touch "$STAMP"
log "done: $PREFIX"
