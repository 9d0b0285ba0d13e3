"""The MTP drafter's linears at a few rows: fp32 `F.linear` against the bf16-weight kernel (fp32
arithmetic, worker/csrc/bf16_linear.cpp) and against bf16 `F.linear` (oneDNN's bf16 GEMM, where the
CPU has bf16 math). The bundled model's projection shapes, cycled over ~24 MB of weights so that each
call finds its weight out of L2, as a decode step does. Writes benchmarks/results/bf16_linear.txt.

    python benchmarks/bench_bf16_linear.py
"""
from __future__ import annotations

import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from worker.models.linear import bf16_linear_available, native_bf16_cpu  # noqa: E402

SHAPES = [(512, 256), (256, 256), (1408, 256), (256, 704)] * 8  # (out, in) of qkv, o, gate_up, down


def per_call_us(fn, weights: list[torch.Tensor], rows: int, reps: int = 30) -> float:
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
    for _ in range(3):
        for w in weights:
            fn(inputs[w.shape[1]], w)
    start = time.perf_counter()
    for _ in range(reps):
        for w in weights:
            fn(inputs[w.shape[1]], w)
    return (time.perf_counter() - start) / reps / len(weights) * 1e6


def main() -> None:
    torch.set_num_threads(1)
    if not bf16_linear_available():
        sys.exit("the bf16-weight kernel could not be built")
    fp32 = [torch.randn(o, i) for o, i in SHAPES]
    bf16 = [w.bfloat16() for w in fp32]
    lines = [f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, `python benchmarks/bench_bf16_linear.py`, 1 thread, "
             f"native bf16 math: {native_bf16_cpu()}; microseconds per linear (cold in L2), mean of the bundled "
             "model's qkv / o / gate_up / down shapes",
             f"{'rows':>4} {'fp32 F.linear':>14} {'bf16 weight, fp32 math':>23} {'bf16 F.linear':>14}"]
    with torch.inference_mode():
        for rows in (1, 2, 3, 4, 8, 16):
            a = per_call_us(F.linear, fp32, rows)
            b = per_call_us(lambda x, w: torch.ops.pdserve_bf16.linear_bf16w(x, w, None), bf16, rows)
            c = per_call_us(lambda x, w: F.linear(x.bfloat16(), w), bf16, rows)
            lines.append(f"{rows:>4} {a:>14.1f} {b:>23.1f} {c:>14.1f}")
    print("\n".join(lines))
    out = REPO / "benchmarks" / "results" / "bf16_linear.txt"
    old = out.read_text() if out.exists() else ""
    out.write_text("\n".join(lines) + "\n\n" + old)


if __name__ == "__main__":
    main()
