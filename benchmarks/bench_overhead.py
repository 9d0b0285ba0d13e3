"""What a served decode step costs beyond the model: the engine loop, the front end, the detokenizer, ZMQ.

Starts `pdserve serve` (colocated by default, no speculation), keeps `--concurrency` (32)
streaming requests running with `pdserve bench`, and reads the engine's own timers from
`/metrics` before and after:

- loop turn  : one turn of the engine loop that ran a step (receive, step, send, heartbeat);
- engine step: schedule + runner + update inside it;
- runner     : inputs, model forward, sampling (the part that is the model).

"outside the runner" is the share of a loop turn spent elsewhere. The same batch is then run
offline (`engine.LLM`, same threads, no server) and the served runner time is compared with it:
that ratio is what the front end and the load generator cost the model, sharing the CPU.

    python benchmarks/bench_overhead.py [--concurrency 32] [--mode colocated] [--rounds 3]
"""
from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_serving import parse_prometheus  # noqa: E402
from benchmarks.compare import free_port, wait_healthy  # noqa: E402
from server.procs import start_tied, stop_process_group  # noqa: E402

TIMERS = ("engine_steps_total", "engine_loop_busy_seconds_total", "engine_step_seconds_total",
          "engine_forward_seconds_total")


def scrape(port: int) -> dict[str, float]:
    values = parse_prometheus(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text)
    return {t: values.get(f"pdserve:{t}", 0.0) for t in TIMERS}


def served(args: argparse.Namespace) -> dict[str, float]:
    port = free_port()
    env = dict(os.environ, PDSERVE_LOG_LEVEL="WARNING")
    env.pop("PDSERVE_DEBUG_INVARIANTS", None)
    log = tempfile.NamedTemporaryFile("w", prefix="pdserve-overhead-", suffix=".log", delete=False)
    proc = start_tied([sys.executable, "-m", "server.cli", "serve", "--port", str(port), "--mode", args.mode,
                       "--speculative-method", "none", *args.serve_args], cwd=REPO, env=env, stdout=log,
                      stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(proc, port)
        bench = [sys.executable, "-m", "server.cli", "bench", "--port", str(port), "--num-prompts",
                 str(args.concurrency * 2), "--max-concurrency", str(args.concurrency), "--random-input-len",
                 str(args.input_len), "--random-output-len", str(args.output_len), "--random-range-ratio", "0",
                 "--ignore-eos", "--disable-tqdm"]
        subprocess.run(bench[:6] + ["--num-prompts", "4", *bench[8:]], cwd=REPO, check=True, capture_output=True)
        before = scrape(port)
        subprocess.run(bench, cwd=REPO, check=True, capture_output=True, timeout=1800)
        after = scrape(port)
    finally:
        stop_process_group(proc)
        log.close()
    d = {k: after[k] - before[k] for k in TIMERS}
    steps = max(d["engine_steps_total"], 1.0)
    return {"steps": steps, "loop_ms": d["engine_loop_busy_seconds_total"] / steps * 1e3,
            "step_ms": d["engine_step_seconds_total"] / steps * 1e3,
            "runner_ms": d["engine_forward_seconds_total"] / steps * 1e3}


def offline(args: argparse.Namespace) -> float:
    """Mean runner time (ms) of decode steps at the same batch, without a server."""
    import torch

    from engine import LLM
    from engine.types import SamplingParams

    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(5, 4000, args.input_len).tolist() for _ in range(args.concurrency)]
    llm = LLM(max_num_seqs=args.concurrency, num_threads=args.threads, speculative_method=None)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    times = llm.engine.step_times
    llm.generate(prompts, params)  # warm
    start_steps, start_s = times.steps, times.forward_s
    llm.generate(prompts, params)
    llm.shutdown()
    return (times.forward_s - start_s) / (times.steps - start_steps) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--mode", default="colocated", choices=["colocated", "pd"])
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the offline run (match the server's)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "overhead.txt"))
    ap.add_argument("serve_args", nargs="*", help="extra `pdserve serve` flags (after --)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    rows = []
    for _ in range(args.rounds):  # alternate served and offline so drift hits both alike
        rows.append((served(args), offline(args)))
    s = {k: float(np.median([r[0][k] for r in rows])) for k in rows[0][0]}
    off = float(np.median([r[1] for r in rows]))
    lines = [
        f"bench_overhead: {args.mode}, {args.concurrency} concurrent streams, {args.input_len} in / {args.output_len} "
        f"out, no speculation, {os.cpu_count()} cores; median of {args.rounds} rounds; serve flags {args.serve_args}",
        f"served decode step: loop turn {s['loop_ms']:.2f} ms, engine step {s['step_ms']:.2f} ms, "
        f"runner {s['runner_ms']:.2f} ms ({s['steps']:.0f} steps per round)",
        f"share of a loop turn outside the runner: {1 - s['runner_ms'] / s['loop_ms']:.1%} "
        f"(outside the engine step: {1 - s['step_ms'] / s['loop_ms']:.1%})",
        f"offline runner time at the same batch: {off:.2f} ms -> served / offline: {s['runner_ms'] / off:.2f}x",
        f"front end + load generator cost on the served step: {s['loop_ms'] / off - 1:.1%} of the offline runner time",
    ]
    text = "\n".join(lines)
    print(text)
    Path(args.out).write_text(text + "\n" + time.strftime("measured %Y-%m-%d %H:%M UTC\n", time.gmtime()))


if __name__ == "__main__":
    main()
