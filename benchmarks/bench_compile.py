"""Eager vs torch.compile'd model forward, side by side in one process, alternating round by round.

Decode-heavy offline generation (prompts of `--prompt-len`, 128 new tokens, greedy, no
speculation) at each batch size; reports output tok/s from CPU time (the process's, so other
load on the machine blurs it less than wall time) and the compiled / eager ratio, median of
`--rounds`. The result decides `EngineConfig.enforce_eager`'s default on this kind of device.

    python benchmarks/bench_compile.py [--batches 1 4 16 32] [--rounds 4] [--device cpu]
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine import LLM  # noqa: E402
from engine.types import SamplingParams  # noqa: E402


def timed(llm: LLM, prompts: list[list[int]], params: SamplingParams, device: str) -> float:
    clock = time.perf_counter if device == "cuda" else time.process_time
    start = clock()
    llm.generate(prompts, params)
    if device == "cuda":
        torch.cuda.synchronize()
    return len(prompts) * params.max_tokens / (clock() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "compile.txt"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    engines = {name: LLM(max_num_seqs=max(args.batches), max_model_len=2048, num_threads=args.threads,
                         speculative_method=None, device=args.device, enforce_eager=name == "eager")
               for name in ("eager", "compiled")}
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    lines = [f"bench_compile: {args.device}, {args.threads} thread(s), prompts of {args.prompt_len} tokens, "
             f"128 new tokens, greedy; output tok/s (CPU time on cpu), median of {args.rounds} rounds",
             f"{'batch':>6}{'eager':>10}{'compiled':>10}{'ratio':>8}"]
    for batch in args.batches:
        prompts = [rng.integers(5, 4000, args.prompt_len).tolist() for _ in range(batch)]
        for llm in engines.values():
            llm.generate(prompts[:2], warm)
        rates: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, llm in engines.items():
                rates[name].append(timed(llm, prompts, params, args.device))
        eager, compiled = (float(np.median(rates[n])) for n in ("eager", "compiled"))
        lines.append(f"{batch:>6}{eager:>10.0f}{compiled:>10.0f}{compiled / eager:>7.2f}x")
        print(lines[-1], flush=True)
    graphs = engines["compiled"].engine.runner.forward.num_graphs
    lines.append(f"compiled graphs: {graphs}; measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
