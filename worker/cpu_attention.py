"""The C++ paged-attention kernel (`worker/csrc/paged_attention.cpp`), built at engine start.

The model runner asks for it while the engine starts (a build inside a step would stall the
loop for seconds, and the front end would take the silent engine for dead); `worker/cpp_build.py`
builds it once and caches the library. Where it cannot be built the engine attends with the torch
reference.
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
    """Build (or load the cached build of) the kernel; False where that fails."""
    return cpp_build.build("paged_attention.cpp", CFLAGS, "paged attention")


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    query_start: torch.Tensor, query_len: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                    sliding_window: int | None, scale: float, out: torch.Tensor) -> None:
    if not available():
        raise RuntimeError("the C++ paged attention kernel could not be built (see the warning above)")
    torch.ops.pdserve_cpu.paged_attention(q, k_cache, v_cache, block_table, query_start, query_len, seq_lens,
                                          block_size, sliding_window or 0, scale, out)
