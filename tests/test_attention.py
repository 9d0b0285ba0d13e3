"""Paged attention: the C++ kernel (CPU), the Triton kernel (interpreted on CPU) and the SDPA
prefill paths must agree with the torch reference (dense gather + host-built mask) on any batch:
decode rows, verify rows, fresh and cached-prefix prefill chunks, GQA, odd head dims, sliding window."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from worker import cpu_attention
from worker.attention import PAGED_MAX_QUERY, SPLIT_MIN_QUERY, AttentionContext, allocate_kv_caches
from worker.input_batch import StepLayout

BLOCK = 16


def random_step(rng: np.random.Generator, rows: list[tuple[int, int]], heads: int, kv_heads: int, dim: int,
                dtype: torch.dtype):
    """rows: (tokens cached before the step, tokens this step). Returns caches, layout, q, k, v."""
    num_blocks = 4 + sum(-(-(c + n) // BLOCK) for c, n in rows)
    cache, views = allocate_kv_caches(1, num_blocks, BLOCK, kv_heads, dim, dtype, "cpu")
    cache.normal_()  # stale values everywhere: a kernel that reads past a row's context shows
    perm = rng.permutation(num_blocks)
    max_blocks = max(-(-(c + n) // BLOCK) for c, n in rows) + 1
    table = np.zeros((len(rows), max_blocks), np.int32)
    used = 0
    for r, (c, n) in enumerate(rows):
        need = -(-(c + n) // BLOCK)
        table[r, :need] = perm[used : used + need]
        used += need
    layout = StepLayout(table, np.array([c for c, _ in rows], np.int32), np.array([n for _, n in rows], np.int32))
    t = int(layout.query_start_loc[-1])
    q = torch.randn(t, heads + 2 * kv_heads, dim, dtype=dtype)  # q is a strided view, as in the model
    k, v = torch.randn(t, kv_heads, dim, dtype=dtype), torch.randn(t, kv_heads, dim, dtype=dtype)
    return cache, views, layout, q[:, :heads], k, v


def attend(backend: str, cache, views, layout, q, k, v, window):
    cache = cache.clone()  # each backend writes this step's K/V into its own copy
    views = [(cache[0, 0].view(-1, *views[0][0].shape[1:]), cache[0, 1].view(-1, *views[0][1].shape[1:]))]
    ctx = AttentionContext(views, layout, BLOCK, torch.device("cpu"), window, backend=backend)
    return ctx.attend(0, q, k, v)


CASES = {
    "decode": [(37, 1), (0, 1), (200, 1), (15, 1), (16, 1)],
    "verify": [(40, 3), (17, 3), (99, 5), (1, 2)],
    "fresh prefill": [(0, 40), (0, 17)],
    # The C++ prefill kernel's query blocks (64 positions) and key blocks (128 keys), and their edges.
    "long fresh prefill": [(0, 200), (0, 129), (0, 64), (0, 65)],
    "prefix prefill": [(32, 30), (48, 17)],
    "long prefix prefill": [(40, 300), (100, 260)],  # the log-sum-exp merge (SPLIT_MIN_QUERY)
    "mixed": [(70, 1), (0, 33), (21, 3), (64, 20), (5, 1), (40, 260)],
}


@pytest.mark.parametrize("case", list(CASES))
# 64, 32 and 128 take the vector slot walk (AVX-512, or AVX2 in test_other_builds_match_reference) with groups
# of 2, 4 and an odd 3, a task several KV heads; 24 the generic path. 8 KV heads of 128 make a slot a page.
@pytest.mark.parametrize("heads,kv_heads,dim,window", [(4, 2, 64, None), (6, 6, 24, None), (4, 1, 32, 24),
                                                     (6, 2, 64, 10), (8, 2, 128, None), (16, 8, 128, None),
                                                     (24, 8, 128, 20)])
def test_cpp_kernel_matches_reference(case, heads, kv_heads, dim, window):
    if not cpu_attention.available():
        pytest.fail("the C++ paged attention kernel did not build (a C++ compiler and ninja are set up by make)")
    rng = np.random.default_rng(hash((case, heads, dim)) % 2**32)
    step = random_step(rng, CASES[case], heads, kv_heads, dim, torch.float32)
    ref = attend("torch", *step, window)
    out = attend("cpp", *step, window)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_cpp_kernel_bf16():
    rng = np.random.default_rng(1)
    step = random_step(rng, CASES["mixed"], 4, 2, 64, torch.bfloat16)
    ref = attend("torch", *step, None).float()
    out = attend("cpp", *step, None).float()
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


def test_long_rows_leave_the_paged_kernel():
    rng = np.random.default_rng(2)
    n, big = PAGED_MAX_QUERY + 1, SPLIT_MIN_QUERY
    _, views, layout, *_ = random_step(rng, [(0, n), (10, 1), (40, n), (40, big)], 4, 2, 64, torch.float32)
    ctx = AttentionContext(views, layout, BLOCK, torch.device("cpu"), None, backend="cpp")
    assert [(r.start, r.end) for r in ctx.prefill_rows] == [(0, n), (n + 1, 2 * n + 1), (2 * n + 1, 2 * n + 1 + big)]
    fresh, chunk, long_chunk = ctx.prefill_rows
    assert fresh.mask is None and fresh.kv_slots is None  # nothing cached before it: causal over its own K/V
    assert chunk.mask is not None and chunk.kv_slots.shape == (40 + n,)  # a short chunk after a prefix: masked
    # A long one: no [q, kv] mask on CPU, the prefix's 40 slots, merged by log-sum-exp.
    assert long_chunk.mask is None and long_chunk.kv_slots.shape == (40,)
    windowed = AttentionContext(views, layout, BLOCK, torch.device("cpu"), 24, backend="cpp").prefill_rows[2]
    assert windowed.mask is not None and windowed.kv_slots.shape == (40 + big,)  # a window past the context: masked


def _run_triton_case(out_path: str) -> None:
    """Child process: TRITON_INTERPRET must be set before triton is imported."""
    rng = np.random.default_rng(3)
    results = {}
    for case, rows in CASES.items():
        for heads, kv_heads, dim, window in [(4, 2, 64, None), (6, 3, 24, 20)]:
            step = random_step(rng, rows, heads, kv_heads, dim, torch.float32)
            ref = attend("torch", *step, window)
            out = attend("triton", *step, window)
            results[f"{case}/{dim}/{window}"] = float((out - ref).abs().max())
    torch.save(results, out_path)


def test_triton_kernel_matches_reference_interpreted(tmp_path):
    out = tmp_path / "triton.pt"
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), str(out)], env=env, capture_output=True,
                          text=True, timeout=600, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = torch.load(out)
    assert len(errors) == 2 * len(CASES)
    assert max(errors.values()) < 1e-4, errors


# The kernel built without AVX-512: its AVX2 path, which the host's own build (-march=native) skips
# on a CPU that has AVX-512.
# The kernels built without AVX-512 (their AVX2 paths) and without either (their scalar paths), which
# the host's own build (-march=native) skips on a CPU that has AVX-512.
BUILDS = {"avx2": ["-mno-avx512f"], "scalar": ["-mno-avx512f", "-mno-avx2", "-mno-fma"]}
AVX2_SHAPES = [(4, 2, 64, None), (4, 1, 32, 24), (16, 8, 128, None), (24, 8, 128, 20)]
BUILD_CASES = ("decode", "verify", "mixed", "long fresh prefill")


def _run_build_case(build: str, out_path: str) -> None:
    """Child process: the build under test registers the ops before the host's build can."""
    from worker import cpp_build

    flags = [*cpu_attention.CFLAGS, *BUILDS[build]]
    for source in ("paged_attention.cpp", "prefill_attention.cpp"):
        assert cpp_build.build(source, flags, f"{source} ({build} build)"), f"no {build} build of {source}"
    # (the ops registered above, not the host's builds)
    cpu_attention.available = cpu_attention.prefill_available = lambda: True
    rng = np.random.default_rng(4)
    results = {}
    for case in BUILD_CASES:
        for heads, kv_heads, dim, window in AVX2_SHAPES:
            step = random_step(rng, CASES[case], heads, kv_heads, dim, torch.float32)
            diff = attend("cpp", *step, window) - attend("torch", *step, window)
            results[f"{case}/{heads}/{kv_heads}/{dim}/{window}"] = float(diff.abs().max())
    torch.save(results, out_path)


@pytest.mark.parametrize("build", list(BUILDS))
def test_other_builds_match_reference(tmp_path, build):
    if build == "avx2" and "avx2" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("the CPU has no AVX2")
    out = tmp_path / f"{build}.pt"
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), build, str(out)], env=env,
                          capture_output=True, text=True, timeout=600, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = torch.load(out)
    assert len(errors) == len(BUILD_CASES) * len(AVX2_SHAPES)
    assert max(errors.values()) < 2e-5, errors


# (tokens, heads, KV heads, head_dim): a prompt of many query and key blocks; one whose packed keys and
# values exceed what a thread keeps between calls (kKeptFloats), so the kernel allocates for the call.
LONG_PROMPTS = [(1000, 16, 8, 128), (2100, 64, 64, 64)]


@pytest.mark.parametrize("t,heads,kv_heads,dim", LONG_PROMPTS)
def test_prefill_kernel_matches_sdpa_on_a_long_prompt(t, heads, kv_heads, dim):
    """q a strided view of a fused QKV projection (as in the model), against SDPA (causal, GQA)."""
    if not cpu_attention.prefill_available():
        pytest.fail("the C++ prefill attention kernel did not build")
    torch.manual_seed(5)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim)
    q = qkv[:, : heads * dim].view(t, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(t, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(t, kv_heads, dim)
    out = torch.empty(t, heads, dim)
    cpu_attention.prefill_attention(q, k, v, dim ** -0.5, out)

    def heads_first(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(0, 1).unsqueeze(0)

    ref = torch.nn.functional.scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v),
                                                           is_causal=True, enable_gqa=True)[0].transpose(0, 1)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


if __name__ == "__main__":
    if sys.argv[1] in BUILDS:
        _run_build_case(sys.argv[1], sys.argv[2])
    else:
        _run_triton_case(sys.argv[1])
