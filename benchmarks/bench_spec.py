"""MTP speculative decoding on the bundled model: acceptance and decode speed, side by side in one run.

For K = 1..3: mean acceptance length (tokens per verify step: 1 + accepted drafts) and the
acceptance rate of each draft position (accepted at position i / verify steps). Then decode
tokens/s (after every request's first token: prefill is TTFT, not decode) without speculation,
with MTP at a fixed K and with adaptive MTP (up to --k-max drafts, chosen per step by
worker/spec_decode/policy.py), at batch 1, 4, 16 and 32, plus the ratios, the acceptance and how often
the adaptive policy chose each k.

    python benchmarks/bench_spec.py [--model DIR] [--new-tokens 128] [--temperature 0]
    python benchmarks/bench_spec.py --skip-acceptance --ablate hold_decisions=0   # does a knob pay?
"""
from __future__ import annotations

import argparse
import itertools
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import resolve_model  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
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


def make_llm(model: str, method: str | None, k: int, batch: int, device: str, policy: str = "fixed",
             **drafter) -> LLM:
    """`drafter`: MTP drafter settings (draft_vocab, mtp_window) for an MTP engine."""
    llm = LLM(model, speculative_method=method, num_speculative_tokens=k, max_num_seqs=max(batch, 1),
              max_model_len=1024, device=device, spec_policy=policy, **(drafter if method else {}))
    llm.generate(prompts_for(llm, 1), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    llm.engine.scheduler.spec_stats.__init__()
    return llm


def acceptance(model: str, k: int, params: SamplingParams, device: str, **drafter):
    llm = make_llm(model, "mtp", k, 16, device, **drafter)
    llm.generate(prompts_for(llm, 16), params)
    stats = llm.engine.scheduler.spec_stats
    llm.shutdown()
    return stats


@dataclass
class Contender:
    label: str
    llm: LLM
    runs: list[tuple[int, float]] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return sum(n for n, _ in self.runs) / sum(t for _, t in self.runs)


TURN_SECONDS = 0.2  # how long one engine steps before the next takes its turn


@dataclass
class InFlight:
    """One contender's batch: requests still waiting for their first token, then decode totals."""
    waiting: set[str]
    decoded: int = 0
    seconds: float = 0.0


def interleaved_round(contenders: list[Contender], prompts: list[list[int]], params: SamplingParams) -> None:
    """Every contender decodes the same batch at the same time, taking turns of TURN_SECONDS of
    engine steps (the order going through every permutation), so that the machine's drift -- on this shared VM its speed
    moves by a third within seconds -- hits every contender alike. A contender's decode time is
    the sum of its own steps after the step that gave every request its first token (the prefill,
    i.e. TTFT, is not decode). Turns are longer than the adaptive policy's 50 ms limit on the gap
    between steps, so another engine's turn is never taken for this engine's overhead, and long
    enough that the first step of a turn, which finds the caches full of another engine's weights,
    is a small share of it."""
    flights = {c.label: InFlight({c.llm.engine.add_request(p, params) for p in prompts}) for c in contenders}
    # The turn order runs through every permutation in turn: the first step of a turn pays for the
    # caches its predecessor filled, and a fixed rotation would have each contender always follow
    # the same one (at batch 16 that cost the one after fixed-K MTP ~5%).
    orders = itertools.cycle(list(itertools.permutations(contenders)))
    running = list(contenders)
    while running:
        for c in [c for c in next(orders) if c in running]:
            engine, flight = c.llm.engine, flights[c.label]
            turn_end = time.perf_counter() + TURN_SECONDS
            while engine.has_unfinished():  # (a turn is at least one step)
                start = time.perf_counter()
                updates = engine.step()
                seconds = time.perf_counter() - start
                if flight.waiting:
                    flight.waiting -= {u.req_id for u in updates if u.new_token_ids}
                else:
                    flight.decoded += sum(len(u.new_token_ids) for u in updates)
                    flight.seconds += seconds
                if start + seconds >= turn_end:
                    break
            if not engine.has_unfinished():
                c.runs.append((flight.decoded, flight.seconds))
                running.remove(c)


WARMUP_ROUNDS = 6  # untimed rounds at most before the timed ones


def speed(contenders: list[Contender], batch: int, rounds: int, params: SamplingParams) -> int:
    """The engines live side by side and decode the same batch at once, taking turns (see
    interleaved_round). Untimed rounds first, until the adaptive policy has measured every k that
    could win at this batch size (SpecPolicy.warmed_up; at most WARMUP_ROUNDS): it waits for
    moments with little MTP backfill to pay, which a 128-token round may not offer, and a
    long-running server pays that warm-up once, not per round. Returns the warm-up rounds run."""
    prompts = prompts_for(contenders[0].llm, batch * (rounds + WARMUP_ROUNDS))
    sampled = params.temperature > 0
    warmup = 0
    while warmup < WARMUP_ROUNDS:
        interleaved_round(contenders, prompts[warmup * batch : (warmup + 1) * batch], params)
        warmup += 1
        if all(c.llm.engine.runner.spec_policy.warmed_up(batch, sampled) for c in contenders):
            break
    for c in contenders:
        c.runs.clear()
        c.llm.engine.scheduler.spec_stats.__init__()
        policy = c.llm.engine.runner.spec_policy
        policy.chosen_k_counts = [0] * len(policy.chosen_k_counts)
    for r in range(warmup, warmup + rounds):
        interleaved_round(contenders, prompts[r * batch : (r + 1) * batch], params)
    return warmup


def median_ratio(a: Contender, base: Contender) -> float:
    ratios = sorted((na / ta) / (nb / tb) for (na, ta), (nb, tb) in zip(a.runs, base.runs))
    return ratios[len(ratios) // 2]


def ablated_llm(model: str, k: int, batch: int, device: str, ablate: dict[str, str], **drafter) -> LLM:
    """An adaptive engine whose SpecPolicy has the `ablate` knobs (field=value) changed: the A/B
    that shows whether a knob earns its keep."""
    llm = make_llm(model, "mtp", k, batch, device, "adaptive", **drafter)
    policy = llm.engine.runner.spec_policy
    for name, value in ablate.items():
        setattr(policy, name, type(getattr(policy, name))(value))
    return llm


def report(batch: int, contenders: list[Contender], warmup: int) -> None:
    base, fixed, adaptive = contenders[:3]
    stats = adaptive.llm.engine.scheduler.spec_stats
    policy = adaptive.llm.engine.runner.spec_policy
    total = max(1, sum(policy.chosen_k_counts))
    chosen = " ".join(f"{k}:{n / total:.2f}" for k, n in enumerate(policy.chosen_k_counts))
    per_pos = " ".join(f"{n / max(1, stats.num_drafts):.2f}" for n in stats.accepted_per_pos) or "-"
    print(f"{batch:>5} {base.rate:>9.1f} {fixed.rate:>9.1f} {adaptive.rate:>9.1f} "
          f"{fixed.rate / base.rate:>6.2f}x {median_ratio(fixed, base):>6.2f}x "
          f"{adaptive.rate / base.rate:>6.2f}x {median_ratio(adaptive, base):>6.2f}x "
          f"{stats.mean_acceptance_length:>7.2f} {per_pos:>10}  {chosen}", flush=True)
    for ablated in contenders[3:]:
        print(f"{'':>5} {ablated.label}: {ablated.rate:.1f} tok/s, {ablated.rate / base.rate:.2f}x base "
              f"(median {median_ratio(ablated, base):.2f}x), median {median_ratio(ablated, adaptive):.2f}x adaptive",
              flush=True)
    logging.getLogger("bench_spec").info("b=%d (%d untimed rounds) policy: %s", batch, warmup, policy.summary())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--k-fixed", type=int, default=2, help="K of the fixed-K contender")
    ap.add_argument("--k-max", type=int, default=2, help="most drafts the adaptive policy may choose")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--batches", default="1,4,16,32")
    ap.add_argument("--skip-acceptance", action="store_true")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: like one engine process here)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=0, help="timed rounds per batch (0: 12 at batch 1, 6 at 4, else 5)")
    ap.add_argument("--draft-vocab", default="auto", help="MTP draft vocabulary: auto | full | a file")
    ap.add_argument("--mtp-window", type=int, default=EngineConfig.mtp_window,
                    help="positions the MTP layer attends (0: all)")
    ap.add_argument("--ablate", action="append", default=[], metavar="FIELD=VALUE",
                    help="also run adaptive with this SpecPolicy field changed (repeatable: one contender for all)")
    ap.add_argument("-v", "--verbose", action="store_true", help="log the policy's cost table per batch")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    torch.set_num_threads(args.threads)
    model = resolve_model(args.model)
    drafter = resolve_draft_dtype("auto", "float32", args.device)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.new_tokens, ignore_eos=True)
    print(f"model: {model} | {args.device} | temperature {args.temperature}, {args.new_tokens} new tokens | "
          f"torch threads: {args.threads} | target float32, MTP drafter {drafter}, draft vocab {args.draft_vocab}, "
          f"MTP window {args.mtp_window or 'all'}")
    drafter_args = dict(draft_vocab=args.draft_vocab, mtp_window=args.mtp_window)
    ablate = dict(item.split("=", 1) for item in args.ablate)
    if not args.skip_acceptance:
        print(f"\n{'K':>2} {'accept len':>11} {'per-position acceptance':>28}")
        for k in (1, 2, 3):
            stats = acceptance(model, k, params, args.device, **drafter_args)
            per_pos = " ".join(f"{n / stats.num_drafts:.2f}" for n in stats.accepted_per_pos)
            print(f"{k:>2} {stats.mean_acceptance_length:>11.2f} {per_pos:>28}")
    print(f"\ndecode tok/s; ratios to no speculation (overall, median of rounds); adaptive = up to K={args.k_max}: "
          "its acceptance length, per-position acceptance and share of steps per chosen k")
    print(f"{'batch':>5} {'no-spec':>9} {f'K={args.k_fixed}':>9} {'adaptive':>9} {'fixed/base':>14} "
          f"{'adaptive/base':>14} {'acc len':>7} {'per pos':>10}  chosen k")
    for batch in (int(b) for b in args.batches.split(",")):
        rounds = args.rounds or {1: 12, 4: 6}.get(batch, 5)
        contenders = [Contender("base", make_llm(model, None, 1, batch, args.device)),
                      Contender("fixed", make_llm(model, "mtp", args.k_fixed, batch, args.device, **drafter_args)),
                      Contender("adaptive", make_llm(model, "mtp", args.k_max, batch, args.device, "adaptive",
                                                     **drafter_args))]
        if ablate:
            label = "adaptive with " + ", ".join(f"{k}={v}" for k, v in ablate.items())
            contenders.append(Contender(label, ablated_llm(model, args.k_max, batch, args.device, ablate,
                                                           **drafter_args)))
        report(batch, contenders, speed(contenders, batch, rounds, params))
        for c in contenders:
            c.llm.shutdown()


if __name__ == "__main__":
    main()
