"""Eager vs torch.compile'd model forward, side by side in one process, alternating round by round.

Decode-heavy offline generation (prompts of `--prompt-len`, 128 new tokens, greedy, no
speculation) at each batch size, and the prefill of one long prompt (`--prefill-lens`, one
output token: what a prefill instance does); reports tokens/s from CPU time (the process's, so
other load on the machine blurs it less than wall time) and the compiled / eager ratio, median of
`--rounds`. The result decides `EngineConfig.enforce_eager`'s default on this kind of device.

    python benchmarks/bench_compile.py [--batches 1 4 16 32] [--prefill-lens 512 1536] [--rounds 4] [--device cpu]
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import msgspec
import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine import LLM  # noqa: E402
from engine.types import SamplingParams  # noqa: E402


def timed(llm: LLM, prompts: list[list[int]], params: SamplingParams, device: str, tokens: int) -> float:
    """`tokens` per second of one generate call."""
    clock = time.perf_counter if device == "cuda" else time.process_time
    start = clock()
    llm.generate(prompts, params)
    if device == "cuda":
        torch.cuda.synchronize()
    return tokens / (clock() - start)


def compare(engines: dict[str, LLM], prompts: list[list[int]], params: SamplingParams, args: argparse.Namespace,
            tokens: int) -> tuple[float, float]:
    """Median tokens/s of eager and compiled over the rounds, alternating."""
    warm = SamplingParams(temperature=0.0, max_tokens=min(4, params.max_tokens), ignore_eos=True)
    for llm in engines.values():
        llm.generate(prompts[:2], warm)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            rates[name].append(timed(llm, prompts, params, args.device, tokens))
    eager, compiled = (float(np.median(rates[n])) for n in ("eager", "compiled"))
    return eager, compiled


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--prefill-lens", type=int, nargs="*", default=[512, 1536])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "compile.txt"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    # No prefix caching: every prefill round computes its prompt anew.
    engines = {name: LLM(max_num_seqs=max(args.batches), max_model_len=2048, num_threads=args.threads,
                         speculative_method=None, device=args.device, enforce_eager=name == "eager",
                         enable_prefix_caching=False)
               for name in ("eager", "compiled")}
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    lines = [f"bench_compile: {args.device}, {args.threads} thread(s), median of {args.rounds} rounds, tokens/s from "
             f"CPU time on cpu; decode: prompts of {args.prompt_len} tokens, 128 new tokens, greedy (output tok/s); "
             "prefill: one prompt, one output token (prompt tok/s)",
             f"{'step':>14}{'eager':>10}{'compiled':>10}{'ratio':>8}"]
    # (row name, prompts, params, the tokens a run counts: output tokens for decode, prompt tokens for prefill)
    rows = [(f"decode b{b}", [rng.integers(5, 4000, args.prompt_len).tolist() for _ in range(b)], params,
             b * params.max_tokens) for b in args.batches]
    rows += [(f"prefill {n}", [rng.integers(5, 4000, n).tolist()], msgspec.structs.replace(params, max_tokens=1), n)
             for n in args.prefill_lens]
    for name, prompts, p, tokens in rows:
        eager, compiled = compare(engines, prompts, p, args, tokens)
        lines.append(f"{name:>14}{eager:>10.0f}{compiled:>10.0f}{compiled / eager:>7.2f}x")
        print(lines[-1], flush=True)
    graphs = engines["compiled"].engine.runner.forward.num_graphs
    lines.append(f"compiled graphs: {graphs}; measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
