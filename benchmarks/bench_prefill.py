"""One long prefill on one thread, under glibc's malloc and under tcmalloc, in alternating fresh processes.

What a prefill engine spends on a ~1.5k-token prompt (the long-prompt workload of bench_peers.py),
and what the allocator choice of server/allocator.py is worth there. Each round starts one process
per allocator (the order flipped each round); each process times `--reps` prefills of distinct
random prompts after a warm-up one and reports their median. The printed figures are medians over
rounds, plus the ratio glibc / tcmalloc per round.

    python benchmarks/bench_prefill.py [--model DIR] [--tokens 1536] [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from server.allocator import engine_env  # noqa: E402
from server.openmp import openmp_env  # noqa: E402


def child(model: str | None, tokens: int, reps: int) -> None:
    import time

    import numpy as np
    import torch

    from engine import LLM, SamplingParams

    torch.set_num_threads(1)
    llm = LLM(model, max_num_seqs=4, max_model_len=tokens + 8, enable_prefix_caching=False)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for i in range(reps + 1):
        prompt = rng.integers(5, llm.engine.model_config.vocab_size - 1, tokens).tolist()
        start = time.perf_counter()
        llm.generate([prompt], params)
        if i:  # the first one warms up
            times.append(time.perf_counter() - start)
    print(json.dumps({"ms": statistics.median(times) * 1e3}))


def run(allocator: str, args: argparse.Namespace) -> float:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env = engine_env(env) if allocator == "tcmalloc" else {**env, "PDSERVE_MALLOC": "system"}
    env = openmp_env(env)  # as server/cli.py sets it for an engine
    argv = [sys.executable, __file__, "--child", "--tokens", str(args.tokens), "--reps", str(args.reps)]
    if args.model:
        argv += ["--model", args.model]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["ms"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--tokens", type=int, default=1536)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.model, args.tokens, args.reps)
    if engine_env({"PDSERVE_MALLOC": "auto"}).get("LD_PRELOAD") is None:
        sys.exit("no tcmalloc on this system (Debian/Ubuntu: libtcmalloc-minimal4)")
    ms: dict[str, list[float]] = {"glibc": [], "tcmalloc": []}
    for r in range(args.rounds):
        for allocator in (("glibc", "tcmalloc") if r % 2 == 0 else ("tcmalloc", "glibc")):
            ms[allocator].append(run(allocator, args))
    ratios = [g / t for g, t in zip(ms["glibc"], ms["tcmalloc"])]
    print(f"prefill of {args.tokens} tokens, 1 thread, median of {args.reps} per process, {args.rounds} rounds")
    for allocator, values in ms.items():
        rounds = " ".join(f"{v:.1f}" for v in values)
        print(f"  {allocator:9s} {statistics.median(values):7.1f} ms   (rounds: {rounds})")
    print(f"  glibc / tcmalloc: {statistics.median(ratios):.2f}x (rounds: {' '.join(f'{x:.2f}' for x in ratios)})")


if __name__ == "__main__":
    main()
