"""Which drafts for sampled requests: greedy drafts, or drafts drawn from the drafter's distribution?

Runs the bundled model with MTP (fixed K) at a temperature and compares, at the first draft
position of every verify step (where every variant sees the same prefix and so the same
target distribution p and draft distribution q):

- greedy drafts (argmax q), verified by rejection sampling with a one-hot q: accepted with
  probability p(argmax q) -- the engine's verify-by-sampling accepts them exactly as often;
- independent drafts d ~ q with q passed to the standard rejection sampler: accepted with
  probability sum_v min(p(v), q(v));
- coupled drafts (the engine's `DraftMode.COUPLED`): d drawn from q with the very noise the
  verifier samples that output position with; accepted when the two draws agree (counted).

Then the end-to-end acceptance length of the three modes the engine implements, the third being
`DraftMode.INDEPENDENT` (the default: independent drafts for unseeded requests, drawn and verified in
C++). The first-position probe watches the Python draft path, so the GREEDY and COUPLED runs take it
(the same drafts as the C++ chain's) and the INDEPENDENT run shows only its end-to-end figures.

    python benchmarks/bench_draft_sampling.py [--temperature 1.0] [--top-p 1.0]
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.bench_spec import prompts_for  # noqa: E402
from benchmarks.common import resolve_model  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from worker.spec_decode.drafter import DraftMode  # noqa: E402


class FirstPositionProbe:
    """Hooks the drafter (q at draft 0, per slot) and the verify step (p at window position 0)."""

    def __init__(self, llm: LLM, params: SamplingParams) -> None:
        self.runner, self.params = llm.engine.runner, params
        self.q0: dict[int, torch.Tensor] = {}
        self.sums = {"greedy": 0.0, "independent": 0.0, "coupled": 0.0}
        self.count = 0
        self.batch = None
        drafter, runner = self.runner.drafter, self.runner
        pick, sample, sampler_call = drafter._pick, runner.verifier.sample, runner.verifier.sampler.forward

        def probe_pick(h, slots, j, draft_meta, walk=None):
            if j == 0:
                logits = drafter.model.compute_draft_logits(h)
                for row, slot in enumerate(slots.tolist()):
                    self.q0[slot] = self._dist(logits[row])
            return pick(h, slots, j, draft_meta, walk)

        def probe_sample(batch, hidden):
            self.batch = batch
            try:
                return sample(batch, hidden)
            finally:
                self.batch = None

        def probe_sampler(logits, meta):
            out = sampler_call(logits, meta)
            if self.batch is not None:
                self._observe(logits, out.sampled_token_ids)
            return out

        drafter._pick, runner.verifier.sample, runner.verifier.sampler.forward = probe_pick, probe_sample, probe_sampler

    def _dist(self, logits: torch.Tensor) -> torch.Tensor:
        # The request's temperature and top-p, as the sampler applies them (no penalties here).
        from worker.sample.sampler import SamplingMetadata
        meta = SamplingMetadata.from_lists([self.params.temperature], top_p=[self.params.top_p])
        return self.runner.verifier.sampler.compute_probs(logits.float().unsqueeze(0), meta)[0]

    def _observe(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        batch = self.batch
        rows = np.nonzero(batch.samples)[0]
        ks = batch.num_drafts[rows]
        starts = np.concatenate([[0], np.cumsum(ks + 1)[:-1]])
        for slot, k, start in zip(batch.slots[rows].tolist(), ks.tolist(), starts.tolist()):
            q = self.q0.get(slot)
            if not k or q is None:
                continue
            p = self._dist(logits[start])
            draft = int(self.runner.states.draft_tokens_np[slot, 0])
            self.sums["greedy"] += float(p[int(q.argmax())])
            self.sums["independent"] += float(torch.minimum(p, q).sum())
            self.sums["coupled"] += float(int(targets[start]) == draft)
            self.count += 1


def run(model: str, mode: DraftMode, params: SamplingParams, k: int, n: int) -> tuple[dict, float, list[float]]:
    llm = LLM(model, speculative_method="mtp", num_speculative_tokens=k, max_num_seqs=n, max_model_len=1024,
              spec_policy="fixed")
    llm.engine.runner.drafter.mode = mode
    llm.engine.runner.drafter.fused_chain = mode is DraftMode.INDEPENDENT  # (the probe hooks the Python path)
    probe = FirstPositionProbe(llm, params)
    llm.generate(prompts_for(llm, n), params)
    stats = llm.engine.scheduler.spec_stats
    per_pos = [a / stats.num_drafts for a in stats.accepted_per_pos]
    return {key: v / max(1, probe.count) for key, v in probe.sums.items()}, stats.mean_acceptance_length, per_pos


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    model = resolve_model(args.model)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.new_tokens,
                            ignore_eos=True, seed=None)
    print(f"model {model} | T={args.temperature} top_p={args.top_p} | K={args.k} | {args.requests} requests x "
          f"{args.new_tokens} tokens")
    print(f"{'engine drafts':>14} {'P(accept draft 1): greedy':>26} {'independent':>12} {'coupled':>8} "
          f"{'accept len':>11} {'per position':>14}")
    for mode in DraftMode:
        first, length, per_pos = run(model, mode, params, args.k, args.requests)
        probe = (f"{first['greedy']:>26.3f} {first['independent']:>12.3f} {first['coupled']:>8.3f}"
                 if mode is not DraftMode.INDEPENDENT else f"{'-':>26} {'-':>12} {'-':>8}")
        print(f"{mode.value:>14} {probe} {length:>11.2f} {' '.join(f'{a:.2f}' for a in per_pos):>14}")


if __name__ == "__main__":
    main()
