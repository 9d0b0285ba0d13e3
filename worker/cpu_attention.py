"""The C++ attention kernels, built at engine start: paged attention for decode and verify rows
(`worker/csrc/paged_attention.cpp`) and causal attention of a prompt over its own tokens for
prefill (`worker/csrc/prefill_attention.cpp`).

The model runner asks for it while the engine starts (a build inside a step would stall the
loop for seconds, and the front end would take the silent engine for dead); `worker/cpp_build.py`
builds each once and caches the library. Where one cannot be built the engine attends with the
torch reference (paged) or SDPA (prefill).
"""
from __future__ import annotations

import functools

import torch

from worker import cpp_build

# -ffast-math lets GCC reassociate the dot products (it vectorises them); the kernel relies on
# -inf for masked keys, so finite-math stays off.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fno-finite-math-only"]


@functools.cache
def available() -> bool:
    """Build (or load the cached build of) the paged kernel; False where that fails."""
    return cpp_build.build("paged_attention.cpp", CFLAGS, "paged attention")


@functools.cache
def prefill_available() -> bool:
    """Build (or load the cached build of) the prefill kernel; False where that fails (without AVX2 it
    calls the BLAS torch links, `sgemm_`, which a build of torch may not export)."""
    return cpp_build.build("prefill_attention.cpp", CFLAGS, "prefill attention")


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    query_start: torch.Tensor, query_len: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                    sliding_window: int | None, scale: float, out: torch.Tensor) -> None:
    if not available():
        raise RuntimeError("the C++ paged attention kernel could not be built (see the warning above)")
    torch.ops.pdserve_cpu.paged_attention(q, k_cache, v_cache, block_table, query_start, query_len, seq_lens,
                                          block_size, sliding_window or 0, scale, out)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """out = causal attention of q [T, H, D] over k, v [T, Hkv, D] (the same T tokens), fp32."""
    if not prefill_available():
        raise RuntimeError("the C++ prefill attention kernel could not be built (see the warning above)")
    torch.ops.pdserve_prefill.prefill_attention(q, k, v, scale, out)
