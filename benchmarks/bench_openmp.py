"""A decode step's time under each way OpenMP threads can wait (server/openmp.py).

One engine process per (wait setting, batch size), the settings taking turns round after round
(this box's speed moves by phase; neighbours in time compare best): a batch of 200-token prompts
prefilled, then --steps decode steps, each `EngineCore.step` timed; a run's figure is its median
step. The settings:
- `passive`: OMP_WAIT_POLICY=PASSIVE, a thread sleeps as soon as a parallel region ends;
- `bounded` (pdserve's default): GOMP_SPINCOUNT=server.openmp.SPIN_COUNT, then sleeps;
- `active`: OMP_WAIT_POLICY=ACTIVE, spins without bound.
Nothing else may run on the box meanwhile.

    python scripts/make_random_checkpoint.py /tmp/q06 --preset qwen3-0.6b
    python benchmarks/bench_openmp.py /tmp/q06 [--threads 2] [--batches 1 8] [--rounds 3] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from server.openmp import SPIN_COUNT  # noqa: E402

SETTINGS = {
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "bounded": {"GOMP_SPINCOUNT": str(SPIN_COUNT)},
    "active": {"OMP_WAIT_POLICY": "ACTIVE"},
}
PROMPT_TOKENS = 200


def child(model: str, threads: int, batch: int, steps: int) -> float:
    """Median decode step (ms) of `batch` requests on one engine (in this process)."""
    from engine import LLM, SamplingParams

    llm = LLM(model, num_threads=threads, enable_prefix_caching=False)
    engine, rng = llm.engine, random.Random(0)
    vocab = llm.engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    prompt = lambda: [rng.randrange(vocab) for _ in range(PROMPT_TOKENS)]  # noqa: E731
    llm.generate([prompt()], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    ids = {engine.add_request(prompt(), params) for _ in range(batch)}
    started: set[str] = set()
    while started != ids:  # prefill: until every request has its first token
        started |= {u.req_id for u in engine.step() if u.new_token_ids}
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--out", type=Path, help="write openmp.md and append openmp_runs.jsonl here")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)  # batch size, in this process
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps({"ms": child(args.model, args.threads, args.child, args.steps)}))
        return

    ms: dict[tuple[str, int], list[float]] = {}
    for rnd in range(args.rounds):
        order = list(SETTINGS) if rnd % 2 == 0 else list(reversed(SETTINGS))
        for name in order:
            for batch in args.batches:
                env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
                argv = [sys.executable, __file__, args.model, "--threads", str(args.threads), "--steps",
                        str(args.steps), "--child", str(batch)]
                out = subprocess.run(argv, env=env | SETTINGS[name], capture_output=True, text=True, timeout=900,
                                     check=True)
                step = json.loads(out.stdout.strip().splitlines()[-1])["ms"]
                ms.setdefault((name, batch), []).append(step)
                print(f"round {rnd + 1}: {name}, batch {batch}: {step:.1f} ms", flush=True)

    lines = [f"# OpenMP wait and decode step time (`benchmarks/bench_openmp.py`, "
             f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC)", "",
             f"{os.cpu_count()} cores, {args.threads} torch threads, model `{Path(args.model).name}`, "
             f"{PROMPT_TOKENS}-token prompts; the median decode step of each run, median (and range) of "
             f"{args.rounds} rounds, the settings taking turns. " + " ".join(
                 f"`{k}`: {' '.join(f'{a}={b}' for a, b in v.items())}." for k, v in SETTINGS.items()), "",
             "| batch | " + " | ".join(f"{n} (ms)" for n in SETTINGS) + " | bounded / passive |",
             "|---:|" + "---:|" * (len(SETTINGS) + 1)]
    for batch in args.batches:
        med = {n: statistics.median(ms[n, batch]) for n in SETTINGS}
        cells = [f"{med[n]:.1f} ({min(ms[n, batch]):.0f}–{max(ms[n, batch]):.0f})" for n in SETTINGS]
        lines.append(f"| {batch} | " + " | ".join(cells) + f" | {med['bounded'] / med['passive']:.2f} |")
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "openmp.md").write_text("\n".join(lines) + "\n")
        with (args.out / "openmp_runs.jsonl").open("a") as f:
            f.write(json.dumps({"when": datetime.now(UTC).isoformat(timespec="seconds"),
                                "model": Path(args.model).name, "threads": args.threads,
                                "ms": {f"{n} b{b}": v for (n, b), v in ms.items()}}) + "\n")


if __name__ == "__main__":
    main()
