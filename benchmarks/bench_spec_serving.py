"""MTP through the server: `make serve`'s default (PD + adaptive MTP) vs PD without speculation.

Two workloads, each at temperature 0 and 1, measured with `pdserve bench` on the same requests:
- `batch1`: one request at a time, in-domain prompts (8-line openings cut from the Python standard
  library, the bundled model's training domain), 96 new tokens;
- `load16`: 16 concurrent streams of random prompts, ~256 in / 128 out.
The two servers alternate round by round (a fresh server each time); every number is the median
of `--rounds`. Writes `benchmarks/results/spec_serving.md`.

    python benchmarks/bench_spec_serving.py [--rounds 3] [--quick]
"""
from __future__ import annotations

import argparse
import logging
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
from server.procs import stop_process_group  # noqa: E402

SERVERS = {"mtp": [], "none": ["--speculative-method", "none"]}
TITLES = {"mtp": "PD + adaptive MTP (default)", "none": "PD, no speculation"}


def workloads(data: Path, quick: bool) -> dict[str, list[str]]:
    n1, n16 = (4, 16) if quick else (16, 64)
    return {
        "batch1": ["--max-concurrency", "1", "--num-prompts", str(n1), "--dataset-name", "sharegpt",
                   "--dataset-path", str(data), "--sharegpt-output-len", "96"],
        "load16": ["--max-concurrency", "16", "--num-prompts", str(n16), "--dataset-name", "random",
                   "--random-input-len", "256", "--random-output-len", "128", "--random-range-ratio", "0.25"],
    }


def measure(server: str, loads: dict[str, list[str]], log: Path) -> dict[str, dict[str, float]]:
    port = free_port()
    env = {**os.environ, "PDSERVE_LOG_LEVEL": "WARNING"}
    env.pop("PDSERVE_DEBUG_INVARIANTS", None)
    with log.open("w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--port", str(port),
                                 *SERVERS[server]], cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    out: dict[str, dict[str, float]] = {}
    try:
        wait_healthy(proc, port)
        for name, flags in loads.items():
            for temp in (0.0, 1.0):
                common = ["--port", str(port), "--tokenizer", str(DEFAULT_MODEL_DIR), "--temperature", str(temp),
                          "--ignore-eos", "--disable-tqdm", "--seed", "0", *flags]
                warm = [*common, "--num-prompts", "2"]  # the later flag wins: a short warm-up
                bench_serving.benchmark(bench_serving.parse_args(warm))
                r = bench_serving.benchmark(bench_serving.parse_args(common))
                spec = r.get("spec_decode") or {}
                out[f"{name} T={temp:g}"] = {"tok_s": r["output_throughput"], "itl_p50": r["median_itl_ms"],
                                             "accept_len": spec.get("acceptance_length") or float("nan"),
                                             "failed": r["failed"], "chosen_k": spec.get("chosen_k") or []}
    finally:
        stop_process_group(proc)
    return out


def chosen_k(per_round) -> str:
    """'k:share ...', the mean over rounds of each k's share of the decode steps."""
    shares = [s for s in per_round if s]
    if not shares:
        return "-"
    return " ".join(f"{k}:{statistics.mean(s[k] for s in shares):.2f}" for k in range(len(shares[0])))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "spec_serving.md"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    work = Path(tempfile.mkdtemp(prefix="pdserve-spec-serving-"))
    loads = workloads(stdlib_sharegpt(work / "stdlib.json", 64, 8, seed=0), args.quick)
    runs: dict[str, list[dict[str, dict[str, float]]]] = {s: [] for s in SERVERS}
    for i in range(1 if args.quick else args.rounds):
        order = list(SERVERS) if i % 2 == 0 else list(reversed(SERVERS))
        for server in order:
            runs[server].append(measure(server, loads, work / f"{server}-{i}.log"))
    keys = list(runs["mtp"][0])

    def med(server: str, key: str, field: str) -> float:
        return statistics.median(r[key][field] for r in runs[server])

    lines = [f"# MTP through the server (`benchmarks/bench_spec_serving.py`, "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", "",
             f"{os.cpu_count()} cores; `pdserve serve` defaults (1 prefill + 1 decode engine) with and without "
             f"`--speculative-method none`; median of {len(runs['mtp'])} round(s), servers alternating.", "",
             "| workload | no spec tok/s | MTP tok/s | MTP / no spec | ITL p50 no spec / MTP (ms) | "
             "MTP acceptance length | MTP steps by k chosen (mean share) | failed |",
             "|---|---:|---:|---:|---:|---:|---|---:|"]
    for key in keys:
        base, mtp = med("none", key, "tok_s"), med("mtp", key, "tok_s")
        failed = sum(r[key]["failed"] for s in runs for r in runs[s])
        lines.append(f"| {key} | {base:.1f} | {mtp:.1f} | {mtp / base:.2f}x | {med('none', key, 'itl_p50'):.1f} / "
                     f"{med('mtp', key, 'itl_p50'):.1f} | {med('mtp', key, 'accept_len'):.2f} | "
                     f"{chosen_k(r[key]['chosen_k'] for r in runs['mtp'])} | {failed} |")
    text = "\n".join(lines) + "\n"
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
