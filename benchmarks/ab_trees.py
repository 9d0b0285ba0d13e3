"""Before/after: two checkouts of pdserve measured side by side on this machine, alternating.

A change that should not move speed (a refactor) is shown not to by running both trees in one
session, in turns (A B, then B A, ...), so that whatever else the machine does falls on both alike.
Each round measures, for each tree:

- serving: that tree's `pdserve serve` with its defaults (the bundled model, MTP, its layout for this host) under
  `pdserve bench` from this checkout (the same client for both), random prompts, a fixed number of
  requests in flight, streaming, greedy, `ignore_eos`, after an unrecorded warm-up -> output tok/s,
  TTFT p50, ITL p50;
- offline speculation: that tree's `benchmarks/bench_spec.py` (decode tok/s without speculation,
  fixed K and adaptive, at the given batch sizes) -> its adaptive/no-spec and fixed/no-spec ratios.

The report gives each tree's median over the rounds and the after/before ratio, beside the spread
of the before tree's own rounds (the noise floor of this run). Each round is appended to
`--history` (JSON lines) as it is measured.

    python benchmarks/ab_trees.py BEFORE_TREE AFTER_TREE [--rounds 3] [--out benchmarks/results/ab.md]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import bench_serving  # noqa: E402
from benchmarks.compare import free_port, wait_healthy  # noqa: E402
from engine.config import DEFAULT_MODEL_DIR  # noqa: E402
from server.procs import start_tied, stop_process_group  # noqa: E402

logger = logging.getLogger("ab_trees")
SPEC_ROW = re.compile(r"^\s*(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x\s+([\d.]+)x\s+([\d.]+)x\s+([\d.]+)x")


def tree_commit(tree: Path) -> str:
    run = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         check=False)
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, check=False).stdout.strip()
    return (run.stdout.strip() or "unknown") + ("+dirty" if dirty else "")


def tree_env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree), "PDSERVE_LOG_LEVEL": "WARNING"}


def serving(tree: Path, args: argparse.Namespace, seed: int, log: Path) -> dict[str, float]:
    """One tree's `pdserve serve` (defaults) under `pdserve bench`; the server is stopped after."""
    port = free_port()
    with log.open("w") as f:
        proc = start_tied([sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
                          cwd=tree, env=tree_env(tree), stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(proc, port, timeout=300)
        flags = ["--port", str(port), "--tokenizer", str(DEFAULT_MODEL_DIR), "--dataset-name", "random",
                 "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
                 "--random-range-ratio", "0.25", "--max-concurrency", str(args.concurrency), "--ignore-eos",
                 "--request-rate", "inf", "--temperature", "0", "--disable-tqdm", "--percentiles", "50,99"]
        with contextlib.redirect_stdout(io.StringIO()):  # the warm-up: other prompts, short outputs
            bench_serving.benchmark(bench_serving.parse_args(
                [*flags, "--num-prompts", str(args.concurrency), "--seed", str(seed + 1000)]))
            r = bench_serving.benchmark(bench_serving.parse_args(
                [*flags, "--num-prompts", str(args.num_prompts), "--seed", str(seed), "--skip-initial-test"]))
        return {"tok_s": r["output_throughput"], "ttft_p50_ms": r["p50_ttft_ms"], "itl_p50_ms": r["p50_itl_ms"],
                "failed": r["failed"]}
    finally:
        stop_process_group(proc)


def spec_offline(tree: Path, args: argparse.Namespace, log: Path) -> dict[str, float]:
    """That tree's bench_spec.py: per batch, adaptive/no-spec and fixed/no-spec (medians of its rounds)."""
    argv = [sys.executable, str(tree / "benchmarks" / "bench_spec.py"), "--skip-acceptance", "--batches",
            args.spec_batches, "--rounds", str(args.spec_rounds), "--temperature", str(args.spec_temperature)]
    run = subprocess.run(argv, cwd=tree, env=tree_env(tree), capture_output=True, text=True, timeout=1800, check=False)
    log.write_text(run.stdout + run.stderr)
    out: dict[str, float] = {}
    for line in run.stdout.splitlines():
        if m := SPEC_ROW.match(line):
            batch = m.group(1)
            out[f"b{batch}_nospec_tok_s"] = float(m.group(2))
            out[f"b{batch}_fixed_ratio"] = float(m.group(6))
            out[f"b{batch}_adaptive_ratio"] = float(m.group(8))
    if not out:
        raise RuntimeError(f"bench_spec.py in {tree} printed no table (exit {run.returncode}); see {log}")
    return out


def report(rows: list[dict], trees: dict[str, str], args: argparse.Namespace) -> str:
    keys = sorted({k for r in rows for k in r["values"]})
    med = {(name, k): statistics.median(vals) for name in trees for k in keys
           if (vals := [r["values"][k] for r in rows if r["tree"] == name and k in r["values"]])}
    spread = {k: (min(v), max(v)) for k in keys
              if (v := [r["values"][k] for r in rows if r["tree"] == "before" and k in r["values"]])}
    lines = [
        "# Before/after on the same machine (benchmarks/ab_trees.py)", "",
        f"- before: `{trees['before']}` at `{tree_commit(Path(trees['before']))}`; after: `{trees['after']}` at "
        f"`{tree_commit(Path(trees['after']))}`",
        f"- {len(rows) // 2} round(s), trees alternating (A B, B A, ...); each cell: median over the rounds",
        f"- serving: each tree's `pdserve serve` defaults (bundled model, MTP, its layout here), `pdserve bench` "
        f"from the "
        f"after tree: {args.num_prompts} random prompts of ~{args.input_len} tokens, {args.output_len} new, "
        f"{args.concurrency} in flight, greedy, ignore_eos, after a warm-up",
        f"- offline speculation: each tree's `bench_spec.py --skip-acceptance --batches {args.spec_batches} "
        f"--rounds {args.spec_rounds} --temperature {args.spec_temperature:g}` (1 torch thread): decode tok/s "
        "without speculation and the ratios of "
        "fixed K=2 and adaptive to it",
        "- noise floor: the lowest–highest of the before tree's own rounds", "",
        "| metric | before | after | after / before | before's rounds (low–high) |", "|---|---:|---:|---:|---|",
    ]
    for k in keys:
        b, a = med.get(("before", k)), med.get(("after", k))
        ratio = f"{a / b:.3f}" if a is not None and b else "—"
        lo, hi = spread.get(k, (None, None))
        lines.append(f"| {k} | {b if b is None else round(b, 3)} | {a if a is None else round(a, 3)} | {ratio} | "
                     + (f"{lo:.3f}–{hi:.3f}" if lo is not None else "—") + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--parts", default="serving,spec")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=12)
    ap.add_argument("--input-len", type=int, default=300)
    ap.add_argument("--output-len", type=int, default=112)
    ap.add_argument("--spec-batches", default="1,4,16")
    ap.add_argument("--spec-rounds", type=int, default=2)
    ap.add_argument("--spec-temperature", type=float, default=0.0)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "ab.md")
    ap.add_argument("--history", type=Path, default=REPO / "benchmarks" / "results" / "ab_runs.jsonl")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp") / f"pdserve-ab-{os.getpid()}")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args.work_dir.mkdir(parents=True, exist_ok=True)
    trees = {"before": str(args.before.resolve()), "after": str(args.after.resolve())}
    run_id, rows = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()), []
    for rnd in range(args.rounds):
        for name in ("before", "after") if rnd % 2 == 0 else ("after", "before"):
            tree, values = Path(trees[name]), {}
            if "serving" in args.parts:
                values |= serving(tree, args, rnd, args.work_dir / f"{name}-r{rnd}-serve.log")
            if "spec" in args.parts:
                values |= spec_offline(tree, args, args.work_dir / f"{name}-r{rnd}-spec.log")
            row = {"run": run_id, "round": rnd, "tree": name, "path": trees[name], "commit": tree_commit(tree),
                   "load": os.getloadavg()[0], "values": values}
            logger.info("%s", json.dumps(row))
            rows.append(row)
            with args.history.open("a") as f:
                f.write(json.dumps(row) + "\n")
    text = report(rows, trees, args)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
