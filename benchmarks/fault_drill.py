"""Fault drill and soak for a PD deployment made of separate processes on this host.

The cluster is what an operator runs: `pdserve server` (front end) plus `pdserve prefill` x2 and
`pdserve decode` x2, each its own process (own session, ipc:// sockets in a private folder, HTTP on
127.0.0.1), so single engines can be `kill -9`ed and restarted with the same flags.

Drill (default), under a steady stream of streaming completions:
  baseline -> kill -9 decode-1 -> restart it -> kill -9 prefill-1 -> restart it -> drain.
Every request has a client-side limit (whole request) and a stall limit (no bytes for `--hang-s`
seconds = hung). Each request ends as: completed, failed with a clear error (an HTTP error status
or an SSE error event with a message), failed unclearly (connection cut, stream truncated without
`[DONE]`), hung, or timed out. Recovery per fault: from the kill to the first successful probe
request (survivors take over), and from the restart to full recovery (/health 200, a probe request
succeeds, all four instances registered). Failover per fault: the requests the front end resumed
(its pdserve:requests_resumed_total before and after) and, for the streams in flight at the kill
that stalled longest -- as many as were resumed, the streams the victim held -- the time from the
kill to their next token. Afterwards: free vs total KV blocks per instance.

Soak (`--soak SECONDS`): measure capacity (completed requests/s with everything sent at once),
then run Poisson load at `--soak-load` (0.8) of it for SECONDS, sampling the RSS of every process;
report RSS growth (first vs last sample after warm-up, and a fitted slope), latency drift, and
leaked KV blocks.

Writes benchmarks/results/fault_drill.json / soak.json and fault_drill.md (from whichever exist);
the processes' logs go to `--log-dir` (a temporary folder unless given).

    python benchmarks/fault_drill.py [--model DIR] [--rate 2] [--skip-drill] [--soak 600]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.bench_serving import RequestResult, client_limits, send_request  # noqa: E402
from benchmarks.common import RANDOM_MODEL_NOTE, ensure_tokenizer, resolve_model  # noqa: E402
from server.procs import start_tied, stop_process_group  # noqa: E402

logger = logging.getLogger("fault_drill")
RESULTS = REPO / "benchmarks" / "results"
ROLES = {"prefill-0": "prefill", "prefill-1": "prefill", "decode-0": "decode", "decode-1": "decode"}


# -- the cluster --------------------------------------------------------------------------------

class Cluster:
    """Front end + named engine processes; each in its own session so a kill hits exactly one."""

    def __init__(self, model: str, port: int, threads: int, log_dir: Path, extra: list[str]) -> None:
        self.model, self.port, self.threads, self.extra = model, port, threads, extra
        self.run_dir = Path(tempfile.mkdtemp(prefix="pdserve-drill-"))
        self.server_addr = f"ipc://{self.run_dir}/frontend"
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}
        self.url = f"http://127.0.0.1:{port}"

    def argv(self, name: str) -> list[str]:
        base = [sys.executable, "-m", "server.cli"]
        common = ["--model", self.model, *self.extra]
        if name == "server":
            return [*base, "server", "--bind-addr", self.server_addr, "--host", "127.0.0.1", "--port", str(self.port),
                    "--mode", "pd", *common]
        role = ROLES[name]
        argv = [*base, role, "--name", name, "--server-addr", self.server_addr, "--num-threads", str(self.threads),
                *common]
        if role == "prefill":
            argv += ["--kv-addr", f"ipc://{self.run_dir}/{name}-kv"]
        return argv

    def start(self, name: str) -> None:
        env = dict(os.environ, PDSERVE_LOG_LEVEL="WARNING")
        env.pop("PDSERVE_DEBUG_INVARIANTS", None)
        log = (self.log_dir / f"{name}.log").open("a")
        self.procs[name] = start_tied(self.argv(name), cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        logger.info("started %s (pid %d)", name, self.procs[name].pid)

    def kill9(self, name: str) -> None:
        proc = self.procs[name]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        logger.warning("kill -9 %s (pid %d)", name, proc.pid)

    def stop(self) -> None:
        for proc in self.procs.values():
            stop_process_group(proc, grace_s=10)

    def rss_mb(self) -> dict[str, float]:
        out = {}
        for name, proc in self.procs.items():
            try:
                text = Path(f"/proc/{proc.pid}/status").read_text()
                out[name] = int(re.search(r"VmRSS:\s+(\d+)", text).group(1)) / 1024
            except (OSError, AttributeError):
                continue
        return out


def instance_table(metrics: str) -> dict[str, dict[str, float]]:
    """{instance: {ready, free, total}} from the front end's /metrics."""
    table: dict[str, dict[str, float]] = {}
    for key, field_ in (("instance_ready", "ready"), ("kv_blocks_free", "free"), ("kv_blocks_total", "total")):
        for m in re.finditer(rf'^pdserve:{key}{{instance="([^"]+)",role="[^"]+"}} (\S+)$', metrics, re.M):
            table.setdefault(m.group(1), {})[field_] = float(m.group(2))
    return table


async def probe(client: httpx.AsyncClient, url: str, prompt: list[int]) -> bool:
    """/health is 200 and a small completion succeeds."""
    try:
        if (await client.get(url + "/health", timeout=5)).status_code != 200:
            return False
        body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        r = await client.post(url + "/v1/completions", json=body, timeout=20)
        return r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    except (httpx.HTTPError, ValueError, KeyError):
        return False


async def front_end_counter(client: httpx.AsyncClient, url: str, name: str) -> float:
    """One of the front end's own counters (pdserve:<name>) from /metrics; 0 when absent."""
    text = (await client.get(url + "/metrics", timeout=5)).text
    m = re.search(rf"^pdserve:{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


DEAD_AFTER_S = 3.0  # the front end's --dead-after-s (its default)
STALLED_S = 0.5     # a wait for a token this long after a kill: the stream was the victim's (others go on)


def stalls_after_kill(records: list[Record], t_kill: float) -> list[tuple[float, float]]:
    """(stall, kill to the token that ended it) in seconds for the streams that stalled at least
    STALLED_S after the kill (perf_counter): the ones the victim held; the others go on at their usual
    pace. A stall is a wait for a chunk that starts -- at the latest of the kill, the send and the
    chunk before -- before the front end declares the victim dead (later stalls are not the kill's).
    Requests sent after the kill count too: until then the front end still routes requests to it."""
    stalls = []
    for rec in records:
        times = rec.chunk_times
        starts = [max(a, t_kill) for a in [rec.sent_perf, *times[:-1]]]
        waits = [(b - a, b - t_kill) for a, b in zip(starts, times) if b > t_kill and a < t_kill + DEAD_AFTER_S]
        if waits and max(waits)[0] >= STALLED_S:
            stalls.append(max(waits))
    return sorted(stalls)


async def registered(client: httpx.AsyncClient, url: str) -> set[str]:
    try:
        table = instance_table((await client.get(url + "/metrics", timeout=5)).text)
    except httpx.HTTPError:
        return set()
    return {name for name, row in table.items() if row.get("ready") == 1.0}


async def wait_full(client: httpx.AsyncClient, url: str, prompt: list[int], timeout: float) -> float:
    """Seconds until every instance is registered, /health is 200 and a probe succeeds."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if set(ROLES) <= await registered(client, url) and await probe(client, url, prompt):
            return time.monotonic() - start
        await asyncio.sleep(0.25)
    raise TimeoutError(f"the cluster did not fully recover within {timeout:.0f} s")


async def wait_blocks(client: httpx.AsyncClient, url: str, timeout: float) -> dict[str, dict[str, float]]:
    """Free/total KV blocks per instance once free == total everywhere (or at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        table = instance_table((await client.get(url + "/metrics", timeout=5)).text)
        live = {n: r for n, r in table.items() if r.get("ready") == 1.0}
        if live and all(r["free"] == r["total"] for r in live.values()) or time.monotonic() > deadline:
            return live
        await asyncio.sleep(0.5)


# -- load ---------------------------------------------------------------------------------------

@dataclass
class Record:
    phase: str
    start: float
    end: float = 0.0
    outcome: str = ""     # completed | failed_clear | failed_unclear | hung | timed_out
    error: str = ""
    tokens: int = 0
    ttft: float = 0.0
    chunks: int = 0       # streamed chunks received before the end (0: failed before the first token)
    chunk_times: list[float] = field(default_factory=list)  # perf_counter of each streamed chunk
    sent_perf: float = 0.0  # perf_counter when sent


def record_row(rec: Record) -> dict:
    """A record for the JSON report, without its per-chunk times (used above; ~10x the size)."""
    row = asdict(rec)
    del row["chunk_times"], row["sent_perf"]
    return row


def classify(res: RequestResult) -> str:
    if res.success:
        return "completed"
    if res.stalled:
        return "hung"
    if res.timed_out:
        return "timed_out"
    # A clear error is one the server stated: an HTTP error status with a message, or an SSE error
    # event. A cut connection or a stream truncated without [DONE] leaves the client guessing.
    return "failed_clear" if res.server_error and res.error else "failed_unclear"


class Load:
    """Streaming completions at a Poisson rate until stopped; every request is recorded."""

    def __init__(self, url: str, rate: float, vocab: int, input_len: int, output_len: int, hang_s: float,
                 timeout_s: float, seed: int) -> None:
        self.url, self.rate = url, rate
        self.vocab, self.input_len, self.output_len = vocab, input_len, output_len
        self.hang_s, self.timeout_s = hang_s, timeout_s
        self.rng = random.Random(seed)
        self.phase = "baseline"
        self.records: list[Record] = []
        self.tasks: set[asyncio.Task] = set()
        self.stopping = False
        self.t0 = time.monotonic()

    def prompt(self) -> list[int]:
        n = self.rng.randint(self.input_len // 2, self.input_len * 3 // 2)
        return [self.rng.randrange(10, self.vocab) for _ in range(n)]

    async def one(self, client: httpx.AsyncClient, rec: Record) -> None:
        payload = {"prompt": self.prompt(), "max_tokens": self.output_len, "temperature": 0, "ignore_eos": True,
                   "stream": True, "stream_options": {"include_usage": True}}
        res = await send_request(client, self.url + "/v1/completions", payload, {}, len(payload["prompt"]),
                                 self.timeout_s)
        rec.end = time.monotonic() - self.t0
        rec.outcome, rec.error = classify(res), res.error
        rec.tokens, rec.ttft, rec.chunks = res.output_tokens or 0, res.ttft, len(res.chunk_times)
        rec.chunk_times, rec.sent_perf = list(res.chunk_times), res.start
        if rec.outcome == "completed" and rec.tokens != self.output_len:
            rec.outcome, rec.error = "failed_unclear", f"{rec.tokens} tokens instead of {self.output_len}"

    async def run(self) -> None:
        # read= is the hang detector: no bytes for hang_s seconds and the request is cut and counted hung.
        timeout = httpx.Timeout(self.timeout_s, read=self.hang_s, connect=10)
        async with httpx.AsyncClient(timeout=timeout, limits=client_limits()) as client:
            while not self.stopping:
                rec = Record(self.phase, time.monotonic() - self.t0)
                self.records.append(rec)
                task = asyncio.create_task(self.one(client, rec))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
                await asyncio.sleep(self.rng.expovariate(self.rate))
            if self.tasks:
                await asyncio.wait(self.tasks, timeout=self.timeout_s + 5)


def summarize(records: list[Record]) -> dict:
    phases: dict[str, dict] = {}
    for rec in records:
        row = phases.setdefault(rec.phase, Counter())
        row["sent"] += 1
        row[rec.outcome or "unfinished"] += 1
    errors = Counter(re.sub(r"\d+", "N", r.error)[:160] for r in records if r.error)
    total = Counter()
    for row in phases.values():
        total.update(row)
    return {"phases": {k: dict(v) for k, v in phases.items()}, "total": dict(total),
            "errors": errors.most_common(12)}


# -- drill --------------------------------------------------------------------------------------

async def drill(cluster: Cluster, args: argparse.Namespace, vocab: int) -> dict:
    load = Load(cluster.url, args.rate, vocab, args.input_len, args.output_len, args.hang_s, args.timeout_s, args.seed)
    probe_prompt = [11, 12, 13, 14, 15, 16, 17, 18]
    faults = []
    async with httpx.AsyncClient() as client:
        load_task = asyncio.create_task(load.run())
        await asyncio.sleep(args.phase_s)
        for victim in ("decode-1", "prefill-1"):
            load.phase = f"{victim} killed"
            before = {k: await front_end_counter(client, cluster.url, f"requests_{k}_total")
                      for k in ("resumed", "retried")}
            t_kill, t_kill_pc = time.monotonic(), time.perf_counter()
            cluster.kill9(victim)
            # Survivors: the first probe that succeeds after the kill.
            first_ok = None
            while time.monotonic() - t_kill < args.restart_after_s:
                if first_ok is None and await probe(client, cluster.url, probe_prompt):
                    first_ok = time.monotonic() - t_kill
                await asyncio.sleep(0.25)
            load.phase = f"{victim} restarted"
            t_restart = time.monotonic()
            cluster.start(victim)
            full = await wait_full(client, cluster.url, probe_prompt, args.recover_timeout_s)
            faults.append({"victim": victim, "first_probe_ok_after_kill_s": first_ok,
                           "restart_after_kill_s": t_restart - t_kill, "full_recovery_after_restart_s": full,
                           "full_recovery_after_kill_s": time.monotonic() - t_kill,
                           "t_kill_perf": t_kill_pc})
            for k, v in before.items():
                faults[-1][k] = await front_end_counter(client, cluster.url, f"requests_{k}_total") - v
            logger.info("%s: %s", victim, faults[-1])
            load.phase = f"after {victim} recovered"
            await asyncio.sleep(args.phase_s)
        load.stopping = True
        await load_task
        blocks = await wait_blocks(client, cluster.url, args.blocks_timeout_s)
        instances = await registered(client, cluster.url)
        failed_after_resume = await front_end_counter(client, cluster.url, "requests_failed_after_resume_total")
    for f in faults:  # the streams have all ended now; the counts include the drill's own probe requests
        f["stalls_s"] = stalls_after_kill(load.records, f["t_kill_perf"])
    return {"failed_after_resume": failed_after_resume,
            "rate": args.rate, "input_len": args.input_len, "output_len": args.output_len, "hang_s": args.hang_s,
            "timeout_s": args.timeout_s, "faults": faults, "summary": summarize(load.records),
            "blocks": blocks, "leaked_blocks": {n: r["total"] - r["free"] for n, r in blocks.items()},
            "registered_at_end": sorted(instances), "records": [record_row(r) for r in load.records]}


# -- soak ---------------------------------------------------------------------------------------

async def measure_capacity(url: str, vocab: int, args: argparse.Namespace) -> float:
    """Completed requests/s with `--capacity-requests` sent at once (the engines' batch is the limit)."""
    load = Load(url, 1.0, vocab, args.input_len, args.output_len, args.hang_s, args.timeout_s, args.seed + 7)
    timeout = httpx.Timeout(args.timeout_s, read=args.hang_s, connect=10)
    async with httpx.AsyncClient(timeout=timeout, limits=client_limits()) as client:
        recs = [Record("capacity", 0.0) for _ in range(args.capacity_requests)]
        start = time.monotonic()
        await asyncio.gather(*(load.one(client, r) for r in recs))
        elapsed = time.monotonic() - start
    done = sum(r.outcome == "completed" for r in recs)
    logger.info("capacity: %d/%d requests in %.1f s", done, len(recs), elapsed)
    return done / elapsed


async def soak(cluster: Cluster, args: argparse.Namespace, vocab: int) -> dict:
    capacity = await measure_capacity(cluster.url, vocab, args)
    rate = args.soak_load * capacity
    load = Load(cluster.url, rate, vocab, args.input_len, args.output_len, args.hang_s, args.timeout_s, args.seed + 1)
    load.phase = "soak"
    samples: list[tuple[float, dict[str, float]]] = []
    async with httpx.AsyncClient() as client:
        load_task = asyncio.create_task(load.run())
        start = time.monotonic()
        while time.monotonic() - start < args.soak:
            samples.append((time.monotonic() - start, cluster.rss_mb()))
            await asyncio.sleep(min(args.rss_every_s, max(0.0, args.soak - (time.monotonic() - start))))
        load.stopping = True
        await load_task
        samples.append((time.monotonic() - start, cluster.rss_mb()))
        blocks = await wait_blocks(client, cluster.url, args.blocks_timeout_s)
    # Growth after warm-up: allocators and caches fill during the first minute; a leak keeps growing.
    warm = [s for s in samples if s[0] >= min(args.soak * 0.2, 60.0)] or samples
    rss = {}
    for name in cluster.procs:
        xs = [t for t, m in warm if name in m]
        ys = [m[name] for t, m in warm if name in m]
        if len(ys) >= 2:
            slope = float(np.polyfit(xs, ys, 1)[0]) * 60.0
            rss[name] = {"start_mb": ys[0], "end_mb": ys[-1], "growth_mb": ys[-1] - ys[0],
                         "peak_mb": max(m.get(name, 0.0) for _, m in samples), "slope_mb_per_min": slope,
                         "first_sample_mb": samples[0][1].get(name)}
    done = [r for r in load.records if r.outcome == "completed"]
    third = args.soak / 3
    drift = {}
    for label, lo, hi in (("first third", 0, third), ("last third", 2 * third, args.soak)):
        ttfts = [r.ttft * 1000 for r in done if lo <= r.start < hi]
        e2e = [(r.end - r.start) * 1000 for r in done if lo <= r.start < hi]
        drift[label] = {"requests": len(ttfts), "ttft_p50_ms": float(np.median(ttfts)) if ttfts else None,
                        "e2el_p50_ms": float(np.median(e2e)) if e2e else None}
    return {"seconds": args.soak, "capacity_rps": capacity, "rate_rps": rate, "load_fraction": args.soak_load,
            "summary": summarize(load.records), "rss": rss, "rss_samples": samples, "latency_drift": drift,
            "blocks": blocks, "leaked_blocks": {n: r["total"] - r["free"] for n, r in blocks.items()},
            "failures": [asdict(r) for r in load.records if r.outcome != "completed"]}


# -- report -------------------------------------------------------------------------------------

OUTCOMES = ("completed", "failed_clear", "failed_unclear", "hung", "timed_out")


def outcome_table(summary: dict) -> list[str]:
    lines = ["| phase | sent | completed | failed (clear error) | failed (unclear) | hung | timed out |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for phase, row in [*summary["phases"].items(), ("**total**", summary["total"])]:
        lines.append(f"| {phase} | {row.get('sent', 0)} | " + " | ".join(str(row.get(o, 0)) for o in OUTCOMES) + " |")
    return lines


def blocks_table(blocks: dict, leaked: dict) -> list[str]:
    lines = ["| instance | free KV blocks | total | leaked |", "|---|---:|---:|---:|"]
    for name in sorted(blocks):
        lines.append(f"| {name} | {blocks[name]['free']:.0f} | {blocks[name]['total']:.0f} | {leaked[name]:.0f} |")
    return lines


def write_markdown(out: Path, meta: dict) -> None:
    lines = ["# Fault drill and soak", "", f"Generated by `python benchmarks/fault_drill.py` ({meta['machine']}).", "",
             f"- model: `{meta['model']}`{RANDOM_MODEL_NOTE if meta['random_model'] else ''}",
             f"- cluster: `pdserve server` + `pdserve prefill` x2 + `pdserve decode` x2, separate processes on "
             f"127.0.0.1 (ipc:// sockets), {meta['threads']} torch thread(s) per engine, front end `--dead-after-s 3`, "
             "default KV lease (30 s) and no-progress deadline (30 s)", ""]
    drill_path, soak_path = out / "fault_drill.json", out / "soak.json"
    if drill_path.is_file():
        d = json.loads(drill_path.read_text())
        s = d["summary"]
        hung = s["total"].get("hung", 0)
        leaked = sum(d["leaked_blocks"].values())
        lines += ["## Drill: kill -9 one decode, then one prefill, under load", "",
                  f"Streaming completions, Poisson at {d['rate']} req/s, prompts {d['input_len'] // 2}-"
                  f"{d['input_len'] * 3 // 2} tokens, {d['output_len']} output tokens, greedy. Client limits: "
                  f"{d['hang_s']:.0f} s without a byte = **hung**; {d['timeout_s']:.0f} s per request = timed out."
                  + (f" KV transfer: {d['kv_transfer']}." if d.get("kv_transfer") else ""), "",
                  f"**Result: {s['total'].get('completed', 0)} completed, {s['total'].get('failed_clear', 0)} failed "
                  f"with a clear error, {s['total'].get('failed_unclear', 0)} failed unclearly, {hung} hung, "
                  f"{s['total'].get('timed_out', 0)} timed out; {leaked:.0f} leaked KV blocks; "
                  "instances registered at the "
                  f"end: {', '.join(d['registered_at_end'])}.**", "", *outcome_table(s), "",
                  "Recovery (probe = `/health` 200 and a 4-token completion succeeds):", "",
                  "| fault | first successful probe after the kill | restart issued after "
                  "| full recovery after the restart "
                  "(all 4 registered + probe) | kill to full recovery |", "|---|---:|---:|---:|---:|"]
        for f in d["faults"]:
            probe_s = f["first_probe_ok_after_kill_s"]
            first = f"{probe_s:.2f} s" if probe_s is not None else "none before restart"
            lines.append(f"| kill -9 {f['victim']} | {first} | {f['restart_after_kill_s']:.1f} s | "
                         f"{f['full_recovery_after_restart_s']:.2f} s | {f['full_recovery_after_kill_s']:.2f} s |")
        lines += ["", "Failover: requests the front end resumed (prompt + streamed tokens prefilled again on a live "
                  "P, handed to a live D) or retried (failed before their first token: a fresh prefill), the "
                  "drill's own probe requests included; and the load's streams that stalled "
                  f"{STALLED_S:g} s or more after the kill (the victim's; a request sent to it after the kill, "
                  "before it was declared dead, stalls from its t0): how long, and the time from the kill to the "
                  "token that ended the stall (both include the front end's 3 s `--dead-after-s`):", "",
                  "| fault | resumed | retried | streams stalled | stall: median | max "
                  "| kill to next token: median | max |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for f in d["faults"]:
            stalls = f.get("stalls_s") or []
            cells = ["n/a"] * 4
            if stalls:
                cells = [f"{v:.2f} s" for col in zip(*stalls) for v in (float(np.median(col)), max(col))]
            lines.append(f"| kill -9 {f['victim']} | {f.get('resumed', 0):.0f} | {f.get('retried', 0):.0f} | "
                         f"{len(stalls)} | " + " | ".join(cells) + " |")
        lines += ["", f"Resumed requests that still failed: {d.get('failed_after_resume', 0):.0f}. A prefill holds a "
                  "request after t0 only until a decode pulls its KV (milliseconds, when the decodes have memory "
                  "free), so a prefill kill mostly hits requests still prefilling: nothing was streamed, and they "
                  "are retried with a fresh prefill. tests/test_pd_failover.py kills a prefill that holds KV "
                  "after t0 (decodes short of memory)."]
        lines += ["", "KV blocks after the drill (from /metrics, once traffic stopped):", "",
                  *blocks_table(d["blocks"], d["leaked_blocks"]), "",
                  "Errors seen by clients (digits folded to N):", ""]
        lines += [f"- {n} x `{e}`" for e, n in s["errors"]] or ["- none"]
        lines.append("")
    if soak_path.is_file():
        k = json.loads(soak_path.read_text())
        s = k["summary"]
        length = f"{k['seconds'] / 60:g} minutes" if k["seconds"] >= 120 else f"{k['seconds']:g} seconds"
        lines += [f"## Soak: {length} at {k['load_fraction']:.0%} of measured capacity", "",
                  f"Capacity (everything sent at once, completed requests/s): {k['capacity_rps']:.2f} req/s; "
                  f"soak rate {k['rate_rps']:.2f} req/s (Poisson). The load generator retires idle keep-alive "
                  "connections after 2 s, before the server's 5 s: otherwise a request sent just as the server "
                  "closes an idle connection fails with a bare `ReadError` (a client-side race, seen once in "
                  "6540 requests on an earlier run).", "", *outcome_table(s), "",
                  "RSS per process (after the warm-up fifth of the run; slope fitted over all samples after it):", "",
                  "| process | first sample (MB) | after warm-up (MB) | end (MB) | growth (MB) | slope (MB/min) "
                  "| peak (MB) |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for name, r in k["rss"].items():
            lines.append(f"| {name} | {r['first_sample_mb']:.0f} | {r['start_mb']:.0f} | {r['end_mb']:.0f} | "
                         f"{r['growth_mb']:+.1f} | {r['slope_mb_per_min']:+.2f} | {r['peak_mb']:.0f} |")
        lines += ["", "Latency drift (completed requests by start time):", "",
                  "| window | requests | TTFT p50 (ms) | E2EL p50 (ms) |", "|---|---:|---:|---:|"]
        for label, row in k["latency_drift"].items():
            fmt = lambda v: f"{v:.0f}" if v is not None else "n/a"  # noqa: E731
            lines.append(f"| {label} | {row['requests']} | {fmt(row['ttft_p50_ms'])} | {fmt(row['e2el_p50_ms'])} |")
        lines += ["", "KV blocks after the soak:", "", *blocks_table(k["blocks"], k["leaked_blocks"]), ""]
        if s["errors"]:
            lines += ["Errors:", ""] + [f"- {n} x `{e}`" for e, n in s["errors"]] + [""]
    (out / "fault_drill.md").write_text("\n".join(lines) + "\n")


# -- main ---------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    ap.add_argument("--rate", type=float, default=2.0, help="drill: requests per second (Poisson)")
    ap.add_argument("--input-len", type=int, default=128, help="prompt tokens (+-50%%)")
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--phase-s", type=float, default=15.0,
                    help="drill: load before the first kill and after each recovery")
    ap.add_argument("--restart-after-s", type=float, default=8.0, help="drill: restart a killed engine after this long")
    ap.add_argument("--hang-s", type=float, default=20.0, help="a request with no bytes for this long is hung")
    ap.add_argument("--timeout-s", type=float, default=180.0, help="client-side limit per request")
    ap.add_argument("--recover-timeout-s", type=float, default=120.0)
    ap.add_argument("--blocks-timeout-s", type=float, default=60.0, help="wait this long for KV blocks to come back")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    ap.add_argument("--skip-drill", action="store_true")
    ap.add_argument("--soak", type=float, default=0.0, help="seconds of soak at --soak-load of capacity (0: none)")
    ap.add_argument("--soak-load", type=float, default=0.8)
    ap.add_argument("--capacity-requests", type=int, default=48)
    ap.add_argument("--rss-every-s", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--log-dir", default=None, help="the processes' logs (default: a fresh temporary folder)")
    ap.add_argument("--report-only", action="store_true",
                    help="rewrite fault_drill.md from the JSON files, run nothing")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)

    from engine.config import DEFAULT_MODEL_DIR, ModelConfig

    if args.report_only:
        model = args.model or str(DEFAULT_MODEL_DIR)
        write_markdown(Path(args.out), {"model": model, "random_model": False, "threads": args.threads,
                                        "machine": f"{os.cpu_count()} CPU cores"})
        print((Path(args.out) / "fault_drill.md").read_text())
        return

    model = ensure_tokenizer(resolve_model(args.model))
    random_model = args.model is None and not (DEFAULT_MODEL_DIR / "config.json").is_file()
    vocab = ModelConfig.from_dir(model).vocab_size
    out = Path(args.out)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pdserve-fault-drill-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    logger.info("process logs in %s", log_dir)
    meta = {"model": model, "random_model": random_model, "threads": args.threads,
            "machine": f"{os.cpu_count()} CPU cores"}

    async def run_cluster(task) -> dict:
        cluster = Cluster(model, free_port(), args.threads, log_dir, [])
        try:
            for name in ("server", *ROLES):
                cluster.start(name)
            async with httpx.AsyncClient() as client:
                await wait_full(client, cluster.url, [11, 12, 13, 14], args.recover_timeout_s)
            return await task(cluster, args, vocab)
        finally:
            cluster.stop()

    if not args.skip_drill:
        result = asyncio.run(run_cluster(drill))
        mode = os.environ.get("PDSERVE_KV_TRANSFER_MODE", "layerwise")  # what the engines inherit (server/cli.py)
        min_tokens = os.environ.get("PDSERVE_KV_LAYERWISE_MIN_TOKENS", "512")
        result["kv_transfer"] = (f"`--kv-transfer-mode {mode}`"
                                 + (f", `--kv-layerwise-min-tokens {min_tokens}`" if mode == "layerwise" else ""))
        (out / "fault_drill.json").write_text(json.dumps(result, indent=1))
        write_markdown(out, meta)
        logger.info("drill: %s; leaked blocks %s", result["summary"]["total"], result["leaked_blocks"])
    if args.soak > 0:
        result = asyncio.run(run_cluster(soak))
        (out / "soak.json").write_text(json.dumps(result, indent=1))
        write_markdown(out, meta)
        logger.info("soak: %s; RSS %s; leaked blocks %s", result["summary"]["total"],
                    {n: round(r["growth_mb"], 1) for n, r in result["rss"].items()}, result["leaked_blocks"])
    print((out / "fault_drill.md").read_text())


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
