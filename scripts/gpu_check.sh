#!/usr/bin/env bash
# One prepared run on a GPU machine (never part of CI): the CUDA-path tests and a short benchmark.
# Uses that machine's own python3 (torch + triton + transformers preinstalled); nothing is installed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PDSERVE_DEBUG_INVARIANTS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
# That machine has no network, and its python lacks some of the engine's own dependencies: they come
# as wheels carried in .whl/ (gitignored), filled on the CPU box with `pip download --only-binary=:all:
# --python-version 3.12 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d .whl` of
# $DEPS, then of $NODEPS with --no-deps (xgrammar's own requirements would pull a CUDA torch).
DEPS="msgspec xxhash pyzmq prometheus_client pytest-timeout hypothesis ninja fastapi uvicorn httpx"
NODEPS="xgrammar apache-tvm-ffi"
if [ -d .whl ]; then
    python3 -m pip install -q --break-system-packages --no-index --find-links .whl $DEPS
    python3 -m pip install -q --break-system-packages --no-index --find-links .whl --no-deps $NODEPS
fi
nvidia-smi -L
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_cuda.py tests/test_attention.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
# Offline throughput on a mid-size random Qwen2 (no weights can be fetched there).
python3 - <<'PY'
import torch, transformers
cfg = transformers.Qwen2Config(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                               num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096)
torch.manual_seed(0)
transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained("/tmp/qwen2-mid")
PY
python3 benchmarks/bench_offline.py --model /tmp/qwen2-mid --device cuda --num-prompts 64 --new-tokens 128 2>&1 | grep -v Loading | tee "$OUT/gpu_bench.log"
python3 benchmarks/bench_offline.py --model /tmp/qwen2-mid --device cuda --dtype bfloat16 --num-prompts 64 --new-tokens 128 2>&1 | grep -v Loading | tee -a "$OUT/gpu_bench.log"
# Greedy exactness at real size (issue 46): a random 0.5B-class Qwen3 in fp32, bf16 and int8 weights on CUDA
# against transformers fp32 on the same weights (on CUDA bf16 is bf16 arithmetic: agreement, not exactness).
python3 scripts/make_random_checkpoint.py /tmp/q06 --preset qwen3-0.6b >/dev/null
python3 benchmarks/check_realsize.py /tmp/q06 --device cuda 2>&1 | grep '^{' | tee "$OUT/gpu_realsize.log"
