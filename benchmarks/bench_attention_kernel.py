"""The C++ paged-attention kernel, one thread: its vector path (AVX-512 or AVX2) against its generic one.

The same source is built twice, once for the host (`-march=native`: the AVX-512 path where the CPU
has it, else the AVX2 one) and once with AVX-512 and AVX2 turned off (the generic, auto-vectorised
path), each in its own process (both register the same op name), on this model's shapes (4 query
heads, 2 KV heads, head dim 64, 16-token blocks, blocks scattered through the cache). Rounds
alternate the two builds; the median per call is printed, with the output difference.

    python benchmarks/bench_attention_kernel.py [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CASES = {"decode b16 ctx~350": (16, 1, 350), "verify b16 (1+3) ctx~350": (16, 4, 350),
         "decode b16 ctx~1500": (16, 1, 1500)}
HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 64, 16


def measure(flags: list[str]) -> dict[str, tuple[float, list[float]]]:
    """In this process: build with `flags`, time each case; returns seconds per call and a checksum row."""
    import numpy as np
    import torch

    from worker import cpp_build

    torch.set_num_threads(1)
    # The engine's builder: one cached build per flag set, and no hang on a lock a killed build left.
    assert cpp_build.build("paged_attention.cpp", flags, "paged attention"), "the kernel did not build"
    out = {}
    for name, (batch, q_len, ctx) in CASES.items():
        rng, gen = np.random.default_rng(0), torch.Generator().manual_seed(0)
        lens = rng.integers(ctx - 50, ctx + 50, size=batch)
        blocks = (lens + BLOCK - 1) // BLOCK
        order = torch.randperm(int(blocks.sum()), generator=gen).int()
        table = torch.zeros(batch, int(blocks.max()), dtype=torch.int32)
        for b, start in enumerate(np.cumsum(blocks) - blocks):
            table[b, :blocks[b]] = order[start:start + blocks[b]]
        slots = int(blocks.sum()) * BLOCK
        k, v = (torch.randn(slots, KV_HEADS, DIM, generator=gen) for _ in range(2))
        q = torch.randn(batch * q_len, HEADS, DIM, generator=gen)
        args = (q, k, v, table, torch.arange(batch, dtype=torch.int32) * q_len,
                torch.full((batch,), q_len, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32), BLOCK, 0,
                DIM ** -0.5, torch.empty_like(q))
        op = torch.ops.pdserve_cpu.paged_attention
        op(*args)
        start, calls = time.perf_counter(), 30
        for _ in range(calls):
            op(*args)
        out[name] = ((time.perf_counter() - start) / calls, args[-1][0, 0, :8].tolist())
    return out


def run_build(flags: list[str]) -> dict:
    code = f"import sys, json; sys.path.insert(0, {str(REPO)!r}); from benchmarks.bench_attention_kernel import " \
           f"measure; print(json.dumps(measure({flags!r})))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from worker.cpu_attention import CFLAGS

    builds = {"native": CFLAGS, "generic": CFLAGS + ["-mno-avx512f", "-mno-avx2", "-mno-fma"]}
    flags = Path("/proc/cpuinfo").read_text().split()
    path = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags and "fma" in flags else "generic"
    times: dict[str, dict[str, list[float]]] = {b: {c: [] for c in CASES} for b in builds}
    rows: dict[str, dict] = {}
    for _ in range(args.rounds):
        for build, flags in builds.items():
            rows[build] = run_build(flags)
            for case, (seconds, _) in rows[build].items():
                times[build][case].append(seconds)
    print(f"paged attention, 1 thread, heads {HEADS}/{KV_HEADS}, dim {DIM}, median of {args.rounds} alternating "
          f"rounds; the native build takes the {path} path")
    for case in CASES:
        g, a = (statistics.median(times[b][case]) * 1e6 for b in ("generic", "native"))
        diff = max(abs(x - y) for x, y in zip(rows["generic"][case][1], rows["native"][case][1]))
        print(f"  {case:26s} generic {g:7.0f} us   {path} {a:7.0f} us   generic/{path} {g / a:4.2f}x   "
              f"max|diff| {diff:.1e}")


if __name__ == "__main__":
    main()
