"""One workload, side by side on this machine: pdserve PD (MTP), pdserve colocated (MTP; also with
OpenMP's spinning barriers instead of pdserve's passive default), pdserve PD without MTP, and plain
transformers `generate` behind a minimal streaming server.

Each server runs alone (started, measured with `pdserve bench`, stopped) under the same thread
budget of the machine's cores, split as the table says; the load generator and each front end are
single-threaded asyncio processes outside that budget. Writes `benchmarks/results/compare.md`
(Markdown tables + ratios), `compare.json` (the numbers behind them, each run's headline numbers
included) and one latency-CDF and one throughput plot per workload. Per-run bench JSON/PNGs, server
logs and the generated datasets go to `--work-dir` (a temporary folder unless given).

Workloads (the same requests, the same arrival times, for every server):
- `code`: ShareGPT-format conversations cut from this Python's standard library sources (prompt:
  a run of source lines; the model continues it) — text the bundled model was trained on, so MTP
  acceptance is what real traffic would see;
- `random`: vLLM's random dataset (uniform random token ids) — the standard, model-agnostic load.

    python benchmarks/compare.py [--model DIR] [--num-prompts 64] [--request-rate 3] [--workloads code,random]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import bench_serving  # noqa: E402
from benchmarks.common import RANDOM_MODEL_NOTE, ensure_tokenizer, resolve_model  # noqa: E402
from server.procs import start_tied, stop_process_group  # noqa: E402

logger = logging.getLogger("compare")
RESULTS = REPO / "benchmarks" / "results"


@dataclass
class Server:
    key: str
    title: str
    argv: list[str]   # without --model/--port
    threads: str      # how the cores were split, for the table
    env: dict[str, str] = field(default_factory=dict)


def servers(cores: int) -> list[Server]:
    half = max(1, cores // 2)
    pdserve = [sys.executable, "-m", "server.cli", "serve"]
    return [
        Server("pd", "pdserve PD, MTP", [*pdserve, "--mode", "pd", "--num-threads", str(half)],
               f"P {half} thread + D {half} thread"),
        Server("colocated", "pdserve colocated, MTP", [*pdserve, "--mode", "colocated", "--num-threads", str(cores)],
               f"1 engine, {cores} threads"),
        # pdserve bounds OpenMP's spinning (server/openmp.py) unless told otherwise. This row shows why:
        # with ACTIVE every thread spins at every barrier, and when the engine's threads fill every core
        # while the front end and the load generator need CPU too, a descheduled thread stalls every
        # barrier of every step (and the heartbeats with them).
        Server("colocated_spin", "pdserve colocated, MTP, spinning OpenMP",
               [*pdserve, "--mode", "colocated", "--num-threads", str(cores)],
               f"1 engine, {cores} threads, OMP_WAIT_POLICY=ACTIVE", {"OMP_WAIT_POLICY": "ACTIVE"}),
        Server("pd_no_mtp", "pdserve PD, no MTP", [*pdserve, "--mode", "pd", "--num-threads", str(half),
                                                   "--speculative-method", "none"],
               f"P {half} thread + D {half} thread"),
        # The same OpenMP policy as pdserve's default, so the baseline is not handicapped by spinning.
        Server("transformers", "transformers generate", [sys.executable, str(REPO / "benchmarks" / "hf_server.py"),
                                                         "--num-threads", str(cores)],
               f"1 process, {cores} threads, one request at a time", {"OMP_WAIT_POLICY": "PASSIVE"}),
    ]


# -- workloads ----------------------------------------------------------------------------------

def stdlib_sharegpt(path: Path, num: int, prompt_lines: int, seed: int) -> Path:
    """A ShareGPT-format file of source-continuation prompts cut from the standard library."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size > 4000)
    rng = random.Random(seed)
    convs = []
    while len(convs) < num * 2:  # extra: bench drops pairs that do not fit
        lines = rng.choice(files).read_text(errors="replace").splitlines()
        if len(lines) < 2 * prompt_lines:
            continue
        start = rng.randrange(0, len(lines) - 2 * prompt_lines)
        prompt = "\n".join(lines[start:start + prompt_lines]) + "\n"
        answer = "\n".join(lines[start + prompt_lines:start + 2 * prompt_lines])
        if len(prompt.strip()) > 40:
            convs.append({"conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": answer}]})
    path.write_text(json.dumps(convs))
    return path


def workload_description(name: str, args: argparse.Namespace) -> str:
    if name == "burst":
        return (f"capacity: {args.num_prompts} random-token requests ({args.input_len} +-50% prompt tokens, "
                f"{args.output_len} new tokens) sent at once, at most {args.burst_concurrency} in flight")
    arrivals = f"Poisson arrivals at {args.request_rate:g} req/s"
    if name == "code":
        return (f"{args.num_prompts} requests of {args.prompt_lines}-line stdlib source prompts (ShareGPT format), "
                f"{args.output_len} new tokens, {arrivals}")
    return (f"{args.num_prompts} requests of random token ids, {args.input_len} +-50% prompt tokens, "
            f"{args.output_len} new tokens, {arrivals}")


def workload_flags(name: str, args: argparse.Namespace, model: str, tmp: Path, seed: int) -> list[str]:
    rate = "inf" if name == "burst" else str(args.request_rate)
    common = ["--num-prompts", str(args.num_prompts), "--request-rate", rate,
              "--burstiness", "1.0", "--seed", str(seed), "--tokenizer", model, "--percentiles", "50,99",
              "--ignore-eos", "--disable-tqdm"]
    concurrency = args.burst_concurrency if name == "burst" else args.max_concurrency
    if concurrency:
        common += ["--max-concurrency", str(concurrency)]
    if name == "code":
        data = stdlib_sharegpt(tmp / f"stdlib_sharegpt_{seed}.json", args.num_prompts, args.prompt_lines, seed)
        return [*common, "--dataset-name", "sharegpt", "--dataset-path", str(data),
                "--sharegpt-output-len", str(args.output_len), "--sharegpt-max-len", "1024"]
    return [*common, "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--random-range-ratio", "0.5"]


# -- running one server -------------------------------------------------------------------------

def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(server: Server, model: str, port: int, log: Path) -> subprocess.Popen:
    env = dict(os.environ, PDSERVE_LOG_LEVEL="WARNING", **server.env)
    env.pop("PDSERVE_DEBUG_INVARIANTS", None)  # measure the production path, not the debug checks
    return start_tied([*server.argv, "--model", model, "--port", str(port)], cwd=REPO, env=env,
                      stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def wait_healthy(proc: subprocess.Popen, port: int, timeout: float = 180.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before becoming healthy")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"server on port {port} not healthy after {timeout:.0f} s")


def run_one(server: Server, model: str, flag_sets: list[list[str]], out_dir: Path) -> list[dict]:
    """One server, started once, measured once per request set (repeat), then stopped."""
    port = free_port()
    proc = start(server, model, port, out_dir / f"{server.key}.log")
    results = []
    try:
        wait_healthy(proc, port)
        for i, flags in enumerate(flag_sets):
            argv = ["--port", str(port), *flags, "--result-dir", str(out_dir), "--result-filename",
                    f"{server.key}-{i}.json", "--label", f"{server.title}, run {i + 1}"]
            print(f"\n### {server.title} ({server.threads}), run {i + 1}/{len(flag_sets)}", flush=True)
            results.append(bench_serving.benchmark(bench_serving.parse_args(argv)))
        return results
    finally:
        stop_process_group(proc)


# Scalar metrics that are medians over repeats; the per-request lists are pooled over repeats.
POOLED = ("ttfts", "itls", "e2els", "input_lens", "output_lens", "errors")


def combine(runs: list[dict]) -> dict:
    """The median of every scalar metric over the repeats, the pooled samples, and each run's headline numbers."""
    import numpy as np

    out = dict(runs[0])
    for key, value in runs[0].items():
        if key in POOLED:
            out[key] = [x for r in runs for x in r[key]]
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and all(
                isinstance(r.get(key), (int, float)) for r in runs):
            out[key] = float(np.median([r[key] for r in runs]))
    specs = [r["spec_decode"] for r in runs if r.get("spec_decode")]
    if specs:
        out["spec_decode"] = {k: float(np.median([s[k] for s in specs])) if specs[0][k] is not None else None
                              for k in specs[0]}
    out["completed"] = int(sum(r["completed"] for r in runs))
    out["failed"] = int(sum(r["failed"] for r in runs))
    out["runs"] = [{k: r[k] for k in ("p50_ttft_ms", "p99_ttft_ms", "p99_itl_ms", "mean_tpot_ms", "output_throughput",
                                      "completed", "failed")} for r in runs]
    return out


# -- report -------------------------------------------------------------------------------------

def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a is not None and b else "n/a"


def markdown(results: dict[str, dict[str, dict]], srvs: list[Server], meta: dict) -> str:
    lines = ["# pdserve vs colocated vs no-MTP vs transformers", "",
             f"Generated by `python benchmarks/compare.py` on {meta['date']}: {meta['machine']}.", "",
             f"- model: `{meta['model']}`{RANDOM_MODEL_NOTE if meta['random_model'] else ''}"
             f", {meta['mtp_layers']} MTP layer(s) (0: the MTP rows run without speculation)",
             "- every server gets the same requests at the same arrival times; greedy, `ignore_eos` (every "
             "request generates exactly its output length)",
             f"- each workload runs {meta.get('repeats', 1)} times with different request sets (seeds); every number "
             "is the median over those runs (ok / failed: totals), and `compare.json` keeps each run's values. "
             "On this shared 2-core machine single runs vary by tens of percent.",
             "- thread budget: each server runs alone on the machine; its torch threads are split as the "
             "`cores` column says. The HTTP front end (pdserve) and the load generator are single-threaded "
             "asyncio processes outside that budget, identical for all servers.",
             "- metrics as vLLM `bench serve` defines them (client-side, streaming): TTFT to the first chunk, "
             "ITL between chunks (a chunk carries 1 + accepted draft tokens with MTP), TPOT = (E2EL - TTFT) / "
             "(tokens - 1)", ""]
    lines += ["Notes on reading the tables:", "",
              "- OpenMP: `pdserve` bounds OpenMP's spin (`GOMP_SPINCOUNT`, server/openmp.py) by default (the "
              "transformers baseline gets `OMP_WAIT_POLICY=PASSIVE`). "
              "The `spinning OpenMP` row is the colocated engine with OpenMP's own default (`ACTIVE`): its 2 "
              "threads spin at the barrier of every parallel region, the front end and the load generator need "
              "CPU too, so a descheduled thread stalls every barrier of every step, and a stalled loop sends no "
              "heartbeats (the front end declares an engine dead after 3 s). How badly depends on timing: in "
              "earlier single runs on this machine the spinning engine collapsed (TPOT 0.2-0.5 s, 52-64 of 64 "
              "requests failed with `colocated instance colocated-0 died`), which is why pdserve now defaults to "
              "passive; in other runs, like these, it only adds jitter. PD's engines run one thread each and "
              "have no barriers to stall.",
              "- MTP costs work on both sides: P runs the MTP layer over every prompt (D needs its KV), and every "
              "decode step verifies 1 + 2 tokens and runs the draft layer twice. With a 4-layer model on CPU a "
              "step is dominated by per-op overhead rather than FLOPs, and P, D, the front end and the load "
              "generator share the same 2 cores, so the speed-up per accepted token is smaller than on a GPU.",
              "- Under a fixed Poisson rate every server that keeps up delivers the offered load, so output "
              "throughput ratios there are ~1; the `burst` workload (everything at once, bounded concurrency) "
              "measures capacity.",
              ""]
    for workload, res in results.items():
        lines += [f"## Workload `{workload}`: {meta['workloads'][workload]}", "",
                  "| server | cores | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | ITL p99 (ms) | TPOT mean (ms) | "
                  "output tok/s | req/s | ok / failed | MTP acceptance |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for s in srvs:
            r = res.get(s.key)
            if r is None:
                lines.append(f"| {s.title} | {s.threads} | not run |" + " |" * 9)
                continue
            if not r["completed"]:
                first_error = (r.get("errors") or ["?"])[0][:80]
                lines.append(f"| {s.title} | {s.threads} | all {r['failed']} requests failed: `{first_error}` |"
                             + " |" * 9)
                continue
            spec = r.get("spec_decode") or {}
            acc = spec.get("acceptance_rate")
            acc_text = f"{acc:.1%} (length {spec.get('acceptance_length') or 0:.2f})" if acc is not None else "—"
            lines.append(
                f"| {s.title} | {s.threads} | {r['p50_ttft_ms']:.1f} | {r['p99_ttft_ms']:.1f} | "
                f"{r['p50_itl_ms']:.1f} | "
                f"{r['p99_itl_ms']:.1f} | {r['mean_tpot_ms']:.1f} | {r['output_throughput']:.1f} | "
                f"{r['request_throughput']:.2f} | {r['completed']} / {r['failed']} | "
                f"{acc_text} |")
        lines += ["", "Ratios (latency: lower is better for the first; throughput: higher is better for the first):",
                  "", "| ratio | TTFT p50 | TTFT p99 | ITL p99 | TPOT mean | output tok/s |",
                  "|---|---:|---:|---:|---:|---:|"]
        for a, b, title in (("pd", "colocated", "PD / colocated"),
                            ("pd", "colocated_spin", "PD / colocated with spinning OpenMP"),
                            ("pd", "pd_no_mtp", "MTP / no-MTP (both PD)"),
                            ("pd", "transformers", "pdserve PD / transformers")):
            ra, rb = res.get(a), res.get(b)
            if ra is None or rb is None:
                continue
            if not ra["completed"] or not rb["completed"]:
                lines.append(f"| {title} | n/a (every request failed on one side) | | | | |")
                continue
            lines.append(f"| {title} | {_ratio(ra['p50_ttft_ms'], rb['p50_ttft_ms'])} | "
                         f"{_ratio(ra['p99_ttft_ms'], rb['p99_ttft_ms'])} | "
                         f"{_ratio(ra['p99_itl_ms'], rb['p99_itl_ms'])} | "
                         f"{_ratio(ra['mean_tpot_ms'], rb['mean_tpot_ms'])} | "
                         f"{_ratio(ra['output_throughput'], rb['output_throughput'])} |")
        lines += ["", f"![latency CDFs](compare_{workload}_cdf.png)",
                  f"![throughput](compare_{workload}_throughput.png)", ""]
    return "\n".join(lines) + "\n"


def plot(results: dict[str, dict], srvs: list[Server], workload: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for s in srvs:
        r = results.get(s.key)
        if r is None:
            continue
        for ax, values in zip(axes, ([t * 1000 for t in r["ttfts"] if t > 0],
                                     [g * 1000 for req in r["itls"] for g in req])):
            if values:
                xs = np.sort(values)
                ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), drawstyle="steps-post", label=s.title)
    for ax, name in zip(axes, ("TTFT", "ITL")):
        ax.set_xscale("log")
        ax.set_xlabel(f"{name} (ms, log scale)")
        ax.set_ylabel("fraction of samples")
        ax.set_title(f"{name} CDF, workload {workload}")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"compare_{workload}_cdf.png", dpi=90)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(12, 4))
    for s in srvs:
        r = results.get(s.key)
        if r is not None:
            ax.plot(r["timeline"]["second"], r["timeline"]["output_tokens"], label=s.title)
    ax.set_xlabel("seconds since the first request")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"throughput timeline, workload {workload} (first request set)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"compare_{workload}_throughput.png", dpi=90)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    ap.add_argument("--workloads", default="code,random,burst")
    ap.add_argument("--burst-concurrency", type=int, default=16, help="burst workload: most requests in flight")
    ap.add_argument("--merge", action="store_true",
                    help="keep the other workloads' results already in compare.json (re-run only --workloads)")
    ap.add_argument("--servers", default="pd,colocated,colocated_spin,pd_no_mtp,transformers")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--request-rate", type=float, default=3.0)
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--input-len", type=int, default=256, help="random workload: prompt tokens (+-50%%)")
    ap.add_argument("--prompt-lines", type=int, default=24, help="code workload: source lines per prompt")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3,
                    help="request sets per workload (seeds seed..seed+N-1); the tables show medians over them")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--work-dir", default=None,
                    help="per-run results, server logs, datasets (default: a fresh temporary folder)")
    ap.add_argument("--report-only", action="store_true", help="rewrite compare.md from compare.json, run nothing")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.report_only:
        saved = json.loads((Path(args.out) / "compare.json").read_text())
        text = markdown(saved["results"], servers(args.cores), saved["meta"])
        (Path(args.out) / "compare.md").write_text(text)
        print(text)
        return

    from engine.config import DEFAULT_MODEL_DIR

    model = resolve_model(args.model)
    random_model = args.model is None and not (DEFAULT_MODEL_DIR / "config.json").is_file()
    ensure_tokenizer(model)  # a random-weight fallback has none; the bench needs text to time chunks
    out = Path(args.out)
    run_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="pdserve-compare-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    logger.info("per-run results and server logs in %s", run_dir)
    wanted = set(args.servers.split(","))
    srvs = [s for s in servers(args.cores) if s.key in wanted]
    results: dict[str, dict[str, dict]] = {}
    descriptions: dict[str, str] = {}
    if args.merge and (out / "compare.json").is_file():
        saved = json.loads((out / "compare.json").read_text())
        wanted_now = set(args.workloads.split(","))
        results = {w: r for w, r in saved["results"].items() if w not in wanted_now}
        descriptions = {w: d for w, d in saved["meta"]["workloads"].items() if w in results}
    for workload in args.workloads.split(","):
        # Each repeat is a different request set (seed), and every server gets the same sets.
        flag_sets = [workload_flags(workload, args, model, run_dir, args.seed + i) for i in range(args.repeats)]
        descriptions[workload] = workload_description(workload, args)
        results[workload] = {}
        for s in srvs:
            wl_dir = run_dir / workload
            wl_dir.mkdir(exist_ok=True)
            try:
                results[workload][s.key] = combine(run_one(s, model, flag_sets, wl_dir))
            except (Exception, SystemExit):  # the bench exits on a dead server: report the others anyway
                logger.exception("%s on %s failed", s.title, workload)
        plot(results[workload], srvs, workload, out)
    from engine.config import ModelConfig

    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "model": model, "random_model": random_model,
            "repeats": args.repeats,
            "mtp_layers": ModelConfig.from_dir(model).num_mtp_layers,
            "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}, Python {platform.python_version()}",
            "workloads": {w: descriptions[w] for w in results}}
    (out / "compare.md").write_text(markdown(results, srvs, meta))
    raw = ("itls", "ttfts", "e2els", "input_lens", "output_lens", "files")  # per request, or in the work folder
    slim = {w: {k: {m: v for m, v in r.items() if m not in raw}
                for k, r in res.items()} for w, res in results.items()}
    (out / "compare.json").write_text(json.dumps({"meta": meta, "results": slim}, indent=1, default=float))
    print((out / "compare.md").read_text())


if __name__ == "__main__":
    main()
