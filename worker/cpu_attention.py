"""Builds and loads the C++ paged-attention kernel (`worker/csrc/paged_attention.cpp`).

The model runner asks for it while the engine starts (a build inside a step would stall the
loop for seconds, and the front end would take the silent engine for dead).

torch's extension builder compiles it with the host's C++ compiler (the one Inductor needs too)
into `TORCH_EXTENSIONS_DIR` (default `~/.cache/torch_extensions`), so a restart loads the cached
library instead of compiling again, and two engines starting at once share one build (it holds
a lock). Where it cannot be built the engine says so once and attends with the torch reference.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_attention.cpp"
# -ffast-math lets GCC reassociate the dot products (it vectorises them); the kernel relies on
# -inf for masked keys, so finite-math stays off.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fno-finite-math-only"]


@functools.cache
def available() -> bool:
    """Build (or load the cached build of) the kernel; False where that fails."""
    from torch.utils import cpp_extension

    start = time.monotonic()
    # One build per source text and checkout: two checkouts sharing the extensions folder under
    # one name would rebuild each other's library at every start.
    tag = hashlib.sha256(SOURCE.read_bytes() + str(SOURCE).encode() + str(CFLAGS).encode()).hexdigest()[:12]
    try:
        cpp_extension.load(name=f"pdserve_cpu_attention_{tag}", sources=[str(SOURCE)], is_python_module=False,
                           extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"])
    except Exception as e:  # no compiler, no ninja, a broken toolchain: stay correct, just slower
        logger.warning("C++ paged attention unavailable (%s); using the torch reference", e)
        return False
    logger.info("C++ paged attention ready (%.1f s)", time.monotonic() - start)
    return True


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    query_start: torch.Tensor, query_len: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                    sliding_window: int | None, scale: float, out: torch.Tensor) -> None:
    if not available():
        raise RuntimeError("the C++ paged attention kernel could not be built (see the warning above)")
    torch.ops.pdserve_cpu.paged_attention(q, k_cache, v_cache, block_table, query_start, query_len, seq_lens,
                                          block_size, sliding_window or 0, scale, out)
