"""MTP speculative decoding on the bundled model: acceptance and decode speed, side by side in one run.

For K = 1..3: mean acceptance length (tokens per verify step: 1 + accepted drafts) and the
acceptance rate of each draft position (accepted at position i / verify steps). Then decode
tokens/s (after every request's first token: prefill is TTFT, not decode) with MTP (K=2 by
default) vs without, at batch 1 and batch 16, greedy.

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
from worker.model_loader import resolve_draft_dtype  # noqa: E402

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


def make_llm(model: str, method: str | None, k: int, batch: int, device: str) -> LLM:
    llm = LLM(model, speculative_method=method, num_speculative_tokens=k, max_num_seqs=max(batch, 1),
              max_model_len=1024, device=device)
    llm.generate(prompts_for(llm, 1), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    llm.engine.scheduler.spec_stats.__init__()
    return llm


def timed_round(llm: LLM, prompts: list[list[int]], new_tokens: int) -> tuple[int, float]:
    """Decode tokens and seconds for one batch: from the step that has given every request its
    first token (the prefill, i.e. TTFT, is not decode) to the last token."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    pending = {engine.add_request(p, params) for p in prompts}
    start, decoded = None, 0
    while engine.has_unfinished():
        updates = engine.step()
        if start is None:
            pending -= {u.req_id for u in updates if u.new_token_ids}
            if not pending:
                start = time.perf_counter()
            continue
        decoded += sum(len(u.new_token_ids) for u in updates)
    return decoded, time.perf_counter() - start


def acceptance(model: str, k: int, new_tokens: int, device: str):
    llm = make_llm(model, "mtp", k, 16, device)
    llm.generate(prompts_for(llm, 16), SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True))
    stats = llm.engine.scheduler.spec_stats
    llm.shutdown()
    return stats


def speed(model: str, k: int, batch: int, rounds: int, new_tokens: int, device: str) -> dict:
    """Decode tok/s without and with MTP. The two engines live side by side and take turns on the
    same batch, round by round, so drift in the machine's speed (a shared VM) hits both alike; the
    median of the per-round ratios is also reported, as it shrugs off a round that a hiccup hit."""
    base, spec = make_llm(model, None, 1, batch, device), make_llm(model, "mtp", k, batch, device)
    prompts = prompts_for(base, batch * rounds)
    runs: dict[int, list[tuple[int, float]]] = {id(base): [], id(spec): []}
    for r in range(rounds):
        chunk = prompts[r * batch : (r + 1) * batch]
        for llm in (base, spec) if r % 2 == 0 else (spec, base):
            runs[id(llm)].append(timed_round(llm, chunk, new_tokens))
    stats = spec.engine.scheduler.spec_stats
    b, s = runs[id(base)], runs[id(spec)]
    base.shutdown()
    spec.shutdown()
    rate = lambda rs: sum(n for n, _ in rs) / sum(t for _, t in rs)  # noqa: E731
    ratios = sorted((ns / ts) / (nb / tb) for (nb, tb), (ns, ts) in zip(b, s))
    return {"base": rate(b), "spec": rate(s), "median_ratio": ratios[len(ratios) // 2], "stats": stats}


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
    drafter = resolve_draft_dtype("auto", "float32", args.device)
    print(f"model: {model} | {args.device} | greedy, {args.new_tokens} new tokens | torch threads: {args.threads}"
          f" | target float32, MTP drafter {drafter}")
    print(f"\n{'K':>2} {'accept len':>11} {'per-position acceptance':>28}")
    for k in (1, 2, 3):
        stats = acceptance(model, k, args.new_tokens, args.device)
        per_pos = " ".join(f"{n / stats.num_drafts:.2f}" for n in stats.accepted_per_pos)
        print(f"{k:>2} {stats.mean_acceptance_length:>11.2f} {per_pos:>28}")
    print(f"\n{'batch':>5} {'no-spec decode tok/s':>21} {f'MTP K={args.k_speed} decode tok/s':>23} "
          f"{'speed-up':>9} {'median of rounds':>17} {'accept len':>11}")
    for batch, rounds in ((1, 32), (16, 2)):
        r = speed(model, args.k_speed, batch, rounds, args.new_tokens, args.device)
        print(f"{batch:>5} {r['base']:>21.1f} {r['spec']:>23.1f} {r['spec'] / r['base']:>8.2f}x "
              f"{r['median_ratio']:>16.2f}x {r['stats'].mean_acceptance_length:>11.2f}")


if __name__ == "__main__":
    main()
