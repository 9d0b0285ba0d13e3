"""Every fp32 linear of a checkpoint at decode-sized inputs, each way tune_linears chooses between:
our kernel (its weight in panels, worker/csrc/panel_linear.h), MKL's F.linear on the plain weight
and oneDNN's packed weight.

One pass runs every linear of the model once, in model order, as a decode step does: the weights
come from memory, not cache. Each row count times the three ways in turn, the order rotated
rep by rep; a way's figure is the median pass of --reps, with the weight bytes read per second.

    python scripts/make_random_checkpoint.py /tmp/q06 --preset qwen3-0.6b
    python benchmarks/bench_decode_linears.py /tmp/q06 --threads 2
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WAYS = {"ours (panels)": "kernel", "MKL F.linear": "plain", "oneDNN packed": "packed"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,4,8,16,32,64")
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from engine.config import ModelConfig
    from worker import model_loader
    from worker.models import linear as L

    if not L.linear_kernels_available():
        sys.exit("our linear kernels could not be built here")
    # Every way needs its copy of each weight: no tuning, which would free the copies it never runs.
    L.tune_linears = lambda linears, shared=None: None
    model = model_loader.load_model(args.model, ModelConfig.from_dir(args.model), "float32", "cpu", max_positions=64)
    lins = [m for m in model.modules() if isinstance(m, L.Linear) and m.packed is not None]
    weight_bytes = sum(lin.in_features * lin.out_features * 4 for lin in lins)
    print(f"{args.model}: {len(lins)} linears, {weight_bytes / 1e9:.2f} GB of fp32 weights, {args.threads} threads")
    print(f"{'rows':>4} " + " ".join(f"{name:>26}" for name in WAYS) + "  ours / best library")
    names = list(WAYS)
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {lin.in_features: torch.randn(rows, lin.in_features) for lin in lins}
            passes: dict[str, list[float]] = {name: [] for name in names}
            for rep in range(args.reps):
                for name in names[rep % 3:] + names[:rep % 3]:
                    for lin in lins:
                        L._use(lin, WAYS[name])
                    start = time.perf_counter()
                    for lin in lins:
                        lin(xs[lin.in_features])
                    passes[name].append(time.perf_counter() - start)
            ms = {name: statistics.median(t) * 1e3 for name, t in passes.items()}
            cells = " ".join(f"{ms[n]:9.2f} ms {weight_bytes / ms[n] / 1e6:6.1f} GB/s  " for n in names)
            print(f"{rows:>4} {cells} {min(ms[names[1]], ms[names[2]]) / ms[names[0]]:.2f}x", flush=True)


if __name__ == "__main__":
    main()
