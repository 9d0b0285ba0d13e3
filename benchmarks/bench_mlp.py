"""A gated MLP's SiLU and product as oneDNN post-ops (GateUpLinear.silu_and_mul) against the stacked
gate/up GEMM followed by torch's SiLU and product, timed as whole prefills in one engine.

Both ways run in the same process, alternately round by round (each round's time is the faster of
two prefills of distinct random prompts); the printed figures are medians over rounds and the ratio
stacked / fused.

    python benchmarks/bench_mlp.py [--model DIR] [--tokens 200,1400] [--threads 2] [--rounds 4]
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from worker.models.linear import GateUpLinear  # noqa: E402


def stacked(self: GateUpLinear, x: torch.Tensor) -> torch.Tensor:
    gate, up = self(x).chunk(2, dim=-1)
    return F.silu(gate) * up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    parser.add_argument("--tokens", default="200,1400")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    lengths = [int(t) for t in args.tokens.split(",")]
    llm = LLM(args.model, num_threads=args.threads, max_model_len=max(lengths) + 8, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rng = random.Random(0)
    vocab = min(4000, llm.engine.runner.model_cfg.vocab_size)

    def prefill(tokens: int) -> float:
        llm.engine.add_request([rng.randrange(10, vocab) for _ in range(tokens)], params)
        start = time.perf_counter()
        while llm.engine.has_unfinished():
            llm.engine.step()
        return time.perf_counter() - start

    fused = GateUpLinear.silu_and_mul
    ways = {"stacked": stacked, "fused": fused}
    print(f"prefill, model {args.model or 'bundled'}, {args.threads} thread(s), {args.rounds} alternating rounds")
    try:
        for tokens in lengths:
            prefill(tokens)  # warm-up
            times: dict[str, list[float]] = {name: [] for name in ways}
            for r in range(args.rounds):
                for name in list(ways)[:: 1 if r % 2 == 0 else -1]:
                    GateUpLinear.silu_and_mul = ways[name]  # type: ignore[method-assign]
                    times[name].append(min(prefill(tokens) for _ in range(2)))
            a, b = statistics.median(times["stacked"]), statistics.median(times["fused"])
            rounds = " ".join(f"{s / f:.3f}" for s, f in zip(times["stacked"], times["fused"]))
            print(f"  {tokens:5d} tokens: stacked {a * 1e3:8.1f} ms  fused {b * 1e3:8.1f} ms  "
                  f"stacked / fused {a / b:.3f} (rounds: {rounds})")
    finally:
        GateUpLinear.silu_and_mul = fused  # type: ignore[method-assign]


if __name__ == "__main__":
    main()
