"""MTP speculative decoding on the bundled model: acceptance and decode speed, side by side in one run.

For K = 1..3: mean acceptance length (tokens per verify step: 1 + accepted drafts) and the
acceptance rate of each draft position (accepted at position i / verify steps). Then decode
output tokens/s with MTP (K=2 by default) vs without, at batch 1 and batch 16, greedy.

    python benchmarks/bench_spec.py [--model DIR] [--new-tokens 128]
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import resolve_model  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

PROMPTS = [
    "def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main():\n", "class Stack:\n    def __init__(self):\n",
    "    def __repr__(self):\n        return", "for i in range(10):\n", "with open(path) as f:\n",
    "    try:\n        import", "def _check_arg(name, value):\n    if", "# Copyright",
    "    @property\n    def name(self):\n", "if __name__ == '__main__':\n", "    raise ValueError(",
    "def parse_args(argv=None):\n    parser = argparse.", "        for key, value in", "    def close(self):\n",
    "The with statement",
]


def prompts_for(llm: LLM, n: int) -> list[list[int]]:
    if llm.tokenizer is None:  # a random test checkpoint: token ids
        import random
        rng = random.Random(0)
        return [[rng.randrange(10, 300) for _ in range(16)] for _ in range(n)]
    return [llm.tokenizer.encode(PROMPTS[i % len(PROMPTS)]) for i in range(n)]


def run(model: str, method: str | None, k: int, batch: int, new_tokens: int, rounds: int,
        device: str = "cpu") -> tuple[float, object]:
    llm = LLM(model, speculative_method=method, num_speculative_tokens=k, max_num_seqs=max(batch, 1),
              max_model_len=1024, device=device)
    prompts = prompts_for(llm, batch * rounds)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    llm.engine.scheduler.spec_stats.__init__()
    start = time.perf_counter()
    produced = 0
    for r in range(rounds):
        outs = llm.generate(prompts[r * batch : (r + 1) * batch], params)
        produced += sum(len(o.token_ids) for o in outs)
    elapsed = time.perf_counter() - start
    stats = llm.engine.scheduler.spec_stats
    llm.shutdown()
    return produced / elapsed, stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--k-speed", type=int, default=2, help="K for the speed comparison")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: like one engine process here)")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    model = resolve_model(args.model)
    print(f"model: {model} | {args.device} | greedy, {args.new_tokens} new tokens | torch threads: {args.threads}")
    print(f"\n{'K':>2} {'accept len':>11} {'per-position acceptance':>28}")
    for k in (1, 2, 3):
        _, stats = run(model, "mtp", k, 16, args.new_tokens, 1, args.device)
        per_pos = " ".join(f"{n / stats.num_drafts:.2f}" for n in stats.accepted_per_pos)
        print(f"{k:>2} {stats.mean_acceptance_length:>11.2f} {per_pos:>28}")
    print(f"\n{'batch':>5} {'no-spec tok/s':>14} {f'MTP K={args.k_speed} tok/s':>16} {'speed-up':>9}")
    for batch, rounds in ((1, 4), (16, 1)):
        base, _ = run(model, None, 1, batch, args.new_tokens, rounds, args.device)
        spec, _ = run(model, "mtp", args.k_speed, batch, args.new_tokens, rounds, args.device)
        print(f"{batch:>5} {base:>14.1f} {spec:>16.1f} {spec / base:>8.2f}x")


if __name__ == "__main__":
    main()
