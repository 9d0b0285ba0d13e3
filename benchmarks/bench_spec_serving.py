"""MTP through the server: PD with adaptive MTP (`make serve` where the host has cores for both engines) vs
PD without speculation.

Two workloads, each at temperature 0 and 1, measured with `pdserve bench` on the same requests:
- `batch1`: one request at a time, in-domain prompts (8-line openings cut from the Python standard
  library, the bundled model's training domain), 96 new tokens;
- `load16`: 16 concurrent streams of random prompts, ~256 in / 128 out.
Both servers run side by side (an idle one takes ~2% of a core) and take turns workload by workload,
the order alternating, so each pair of measurements is seconds apart: on this shared VM the speed
moves by a third within a minute. The ratio is the median of the per-round ratios; tok/s are
medians of rounds. The MTP server's policy keeps what it measured from round to round, as a
long-running `make serve` does; a first, untimed round (`--warmup-rounds`) runs every workload once
on every server, so that the timed rounds see the steady state (the policy's warm-up measurements,
the prefix cache of the repeated prompts). The warm-up round's ratio is reported too: what a fresh
server pays in its first minute. Writes `benchmarks/results/spec_serving.md` (the table; a hand-written
"What it means" section below it is kept) and appends the run's numbers to `spec_serving_runs.jsonl`
beside it (a `--quick` run only prints its table).

A server's speed also depends on its start: an A/A of one code in two slots of one run measured
1.07x and 0.99x at load16, and one pair of servers is one draw of that. So the pair is started
afresh `--lifetimes` times (the start order alternating), each time for the untimed and the timed
rounds: the default, 6 lifetimes of 1 timed round, is 6 draws.

    python benchmarks/bench_spec_serving.py [--lifetimes 6] [--rounds 1] [--warmup-rounds 1] [--quick]
                                            [--workloads load16] [--baseline REV] [--noise-floor]

`--baseline REV` also serves the default (MTP) of another commit, from a git worktree, turn by turn
with the other two: a change to speculation measured against the code before it in the same minutes.
`--noise-floor` serves without speculation in the MTP server's place as well: the ratios two identical
servers measure, against which a ratio near 1.0 is to be read.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import bench_serving  # noqa: E402
from benchmarks.compare import free_port, stdlib_sharegpt, wait_healthy  # noqa: E402
from engine.config import DEFAULT_MODEL_DIR  # noqa: E402
from server.procs import start_tied, stop_process_group  # noqa: E402

# PD on any host (`--mode auto` would serve colocated on a small one): what the results file has measured.
SERVERS = {"mtp": ["--mode", "pd"], "none": ["--mode", "pd", "--speculative-method", "none"]}
BASELINE = "baseline"  # the --baseline revision's default server
READING = "## What it means"  # the hand-written reading of the table, kept when the table is rewritten


def workloads(data: Path, quick: bool) -> dict[str, list[str]]:
    n1, n16 = (4, 16) if quick else (16, 64)
    return {
        "batch1": ["--max-concurrency", "1", "--num-prompts", str(n1), "--dataset-name", "sharegpt",
                   "--dataset-path", str(data), "--sharegpt-output-len", "96"],
        "load16": ["--max-concurrency", "16", "--num-prompts", str(n16), "--dataset-name", "random",
                   "--random-input-len", "256", "--random-output-len", "128", "--random-range-ratio", "0.25"],
    }


def start(flags: list[str], log: Path, repo: Path = REPO) -> tuple[subprocess.Popen, int]:
    """`pdserve serve` of the code in `repo` with `flags`, on a free port."""
    port = free_port()
    env = {**os.environ, "PDSERVE_LOG_LEVEL": "WARNING"}
    env.pop("PDSERVE_DEBUG_INVARIANTS", None)
    with log.open("w") as f:
        proc = start_tied([sys.executable, "-m", "server.cli", "serve", "--port", str(port), *flags],
                          cwd=repo, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, port


def run_load(port: int, flags: list[str], temp: float, warm_up: bool = False) -> dict[str, float]:
    common = ["--port", str(port), "--tokenizer", str(DEFAULT_MODEL_DIR), "--temperature", str(temp),
              "--ignore-eos", "--disable-tqdm", "--seed", "0", *flags]
    if warm_up:  # the later flag wins: a short warm-up
        bench_serving.benchmark(bench_serving.parse_args([*common, "--num-prompts", "2"]))
    r = bench_serving.benchmark(bench_serving.parse_args(common))
    spec = r.get("spec_decode") or {}
    return {"tok_s": r["output_throughput"], "itl_p50": r["median_itl_ms"], "ttft_p50": r["median_ttft_ms"],
            "accept_len": spec.get("acceptance_length") or float("nan"), "failed": r["failed"],
            "chosen_k": spec.get("chosen_k") or []}


def chosen_k(per_round) -> str:
    """'k:share ...', the mean over rounds of each k's share of the decode steps."""
    shares = [s for s in per_round if s]
    if not shares:
        return "-"
    return " ".join(f"{k}:{statistics.mean(s[k] for s in shares):.2f}" for k in range(len(shares[0])))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=1, help="timed rounds per server lifetime")
    ap.add_argument("--warmup-rounds", type=int, default=1, help="untimed rounds first (reported apart)")
    ap.add_argument("--lifetimes", type=int, default=6,
                    help="start the servers afresh this many times, each time for --warmup-rounds + --rounds")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--workloads", default="batch1,load16", help="which of batch1, load16")
    ap.add_argument("--baseline", help="a git revision whose default (MTP) server also runs")
    ap.add_argument("--noise-floor", action="store_true",
                    help="serve without speculation in the MTP server's place too: what two identical servers measure")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "spec_serving.md"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    work = Path(tempfile.mkdtemp(prefix="pdserve-spec-serving-"))
    loads = workloads(stdlib_sharegpt(work / "stdlib.json", 64, 8, seed=0), args.quick)
    loads = {name: loads[name] for name in args.workloads.split(",")}
    servers = {name: (SERVERS["none"] if args.noise_floor else flags, REPO) for name, flags in SERVERS.items()}
    if args.baseline:
        tree = work / "baseline"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), args.baseline], check=True)
        servers[BASELINE] = ([], tree)
    names = list(servers)
    warmup, rounds, lifetimes = (0, 1, 1) if args.quick else (args.warmup_rounds, args.rounds, args.lifetimes)
    # Per server: the rounds of each lifetime, untimed (warm) and timed.
    warm: dict[str, list[dict[str, dict[str, float]]]] = {s: [] for s in servers}
    runs: dict[str, list[dict[str, dict[str, float]]]] = {s: [] for s in servers}
    try:
        for life in range(lifetimes):
            # One at a time (engines tune their kernels as they start), the order rotating by lifetime.
            procs = {}
            for server in names[life % len(names):] + names[: life % len(names)]:
                flags, repo = servers[server]
                procs[server] = start(flags, work / f"{server}.log", repo)
                wait_healthy(*procs[server])
            try:
                for i in range(warmup + rounds):
                    into = warm if i < warmup else runs
                    for server in servers:
                        into[server].append({})
                    for j, (name, flags) in enumerate(loads.items()):
                        for t, temp in enumerate((0.0, 1.0)):
                            turn = (life + i + j + t) % len(names)  # who goes first rotates
                            for server in names[turn:] + names[:turn]:
                                into[server][-1][f"{name} T={temp:g}"] = run_load(procs[server][1], flags, temp,
                                                                                   warm_up=i == 0)
            finally:
                for proc, _ in procs.values():
                    stop_process_group(proc)
    finally:
        if args.baseline:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)
    keys = list(runs["mtp"][0])

    def med(server: str, key: str, field: str) -> float:
        # (a round without a single verify step has no acceptance length: nan, which median cannot order)
        values = [r[key][field] for r in runs[server] if not math.isnan(r[key][field])]
        return statistics.median(values) if values else float("nan")

    def ratios(key: str, server: str = "mtp", rounds=runs) -> list[float]:
        return [m[key]["tok_s"] / n[key]["tok_s"] for m, n in zip(rounds[server], rounds["none"])]

    lines = [f"# MTP through the server (`benchmarks/bench_spec_serving.py`, "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", "",
             f"{os.cpu_count()} cores; `pdserve serve` defaults (1 prefill + 1 decode engine) with and without "
             f"`--speculative-method none`, taking turns workload by workload; {lifetimes} server lifetime(s) "
             f"(the servers started afresh), each of {rounds} timed round(s) after {warmup} untimed; MTP / no spec "
             f"is the median of the per-round ratios.",
             *(["", "**Noise floor: the 'MTP' server runs without speculation too.**"] if args.noise_floor else []), "",
             "| workload | no spec tok/s | MTP tok/s | MTP / no spec | per round | warm-up round | "
             "ITL p50 no spec / MTP (ms) | TTFT p50 no spec / MTP (ms) | MTP acceptance length | "
             "MTP steps by k chosen (mean share) | failed |",
             "|---|---:|---:|---:|---|---|---:|---:|---:|---|---:|"]
    record = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit(), "cores": os.cpu_count(),
              "lifetimes": lifetimes, "timed_rounds": rounds, "warmup_rounds": warmup,
              "noise_floor": args.noise_floor, "workloads": {}}
    for key in keys:
        base, mtp = med("none", key, "tok_s"), med("mtp", key, "tok_s")
        failed = sum(r[key]["failed"] for s in runs for r in runs[s])
        record["workloads"][key] = {
            "no_spec_tok_s": base, "mtp_tok_s": mtp, "ratio": statistics.median(ratios(key)),
            "per_round": ratios(key), "warmup_round": ratios(key, rounds=warm),
            "itl_p50_ms": [med("none", key, "itl_p50"), med("mtp", key, "itl_p50")],
            "ttft_p50_ms": [med("none", key, "ttft_p50"), med("mtp", key, "ttft_p50")],
            "acceptance_length": None if math.isnan(accept := med("mtp", key, "accept_len")) else accept,
            "chosen_k": chosen_k(r[key]["chosen_k"] for r in runs["mtp"]), "failed": failed}
        lines.append(f"| {key} | {base:.1f} | {mtp:.1f} | {statistics.median(ratios(key)):.2f}x | "
                     f"{' '.join(f'{r:.2f}' for r in ratios(key))} | "
                     f"{' '.join(f'{r:.2f}' for r in ratios(key, rounds=warm)) or '-'} | "
                     f"{med('none', key, 'itl_p50'):.1f} / "
                     f"{med('mtp', key, 'itl_p50'):.1f} | {med('none', key, 'ttft_p50'):.1f} / "
                     f"{med('mtp', key, 'ttft_p50'):.1f} | {med('mtp', key, 'accept_len'):.2f} | "
                     f"{chosen_k(r[key]['chosen_k'] for r in runs['mtp'])} | {failed} |")
    if args.baseline:
        lines += ["", f"The default (MTP) of `{args.baseline}` in the same turns, against the same no-spec server:", "",
                  f"| workload | MTP@{args.baseline} tok/s | MTP@{args.baseline} / no spec | per round | "
                  "acceptance length | steps by k chosen (mean share) |",
                  "|---|---:|---:|---|---:|---|"]
        lines += [f"| {key} | {med(BASELINE, key, 'tok_s'):.1f} | {statistics.median(ratios(key, BASELINE)):.2f}x | "
                  f"{' '.join(f'{r:.2f}' for r in ratios(key, BASELINE))} | {med(BASELINE, key, 'accept_len'):.2f} | "
                  f"{chosen_k(r[key]['chosen_k'] for r in runs[BASELINE])} |" for key in keys]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.quick:
        return
    out = Path(args.out)
    before = out.read_text() if out.exists() else ""
    if READING in before:
        text += "\n" + before[before.index(READING):]
    out.write_text(text)
    with out.with_name(out.stem + "_runs.jsonl").open("a") as runs_file:
        runs_file.write(json.dumps(record) + "\n")


def commit() -> str:
    """HEAD's short hash, with `+` when the working tree differs from it."""
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(REPO), "diff", "--quiet", "HEAD"]).returncode != 0
    return head.stdout.strip() + ("+" if dirty else "")


if __name__ == "__main__":
    main()
