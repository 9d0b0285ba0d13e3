"""`pdserve bench`: load-test any OpenAI-compatible `/v1/completions` endpoint.

The metric definitions follow vLLM's `vllm bench serve`, so numbers are comparable:

- every request streams (`"stream": true`, `"stream_options": {"include_usage": true}`);
- TTFT  = time from sending the request to the first SSE chunk that carries `choices`
  (the final usage-only chunk has `"choices": []` and is not a token);
- ITL   = gaps between consecutive chunks with `choices`, pooled over all requests;
- E2EL  = time from sending the request to the last chunk with `choices`;
- TPOT  = (E2EL - TTFT) / (output tokens - 1), per request with more than one output token,
  where output tokens come from the server's `usage.completion_tokens`;
- request / output / total token throughput over the benchmark's wall-clock duration;
- goodput = requests per second that met every SLO given with `--goodput ttft:MS tpot:MS e2el:MS`;
- speculative decoding acceptance from `/metrics` deltas of `<prefix>:spec_decode_num_accepted_tokens_total`
  and `<prefix>:spec_decode_num_draft_tokens_total` (prefix `pdserve` or `vllm`), summed over all
  instance labels; when the server exports neither it is not reported.

Deliberately stricter than vLLM: a stream that carries an `{"error": ...}` event, or that ends without
`data: [DONE]`, counts as failed (vLLM counts both as successes once any token has arrived).

Datasets: `random` (token-id prompts of `--random-input-len` tokens, +- `--random-range-ratio`,
after a shared prefix of `--random-prefix-len` tokens, `ignore_eos` so every request generates
its `--random-output-len` tokens), `sharegpt` (a ShareGPT-format JSON file, `--dataset-path`) and
`mooncake` (trace replay, benchmarks/mooncake_trace.py: each request sent at its timestamp /
`--trace-speedup`, equal hash ids giving equal blocks of `--trace-block-size` tokens).
Arrivals (benchmarks/arrivals.py): `--arrival poisson` (gamma gaps with `--burstiness` as the shape; 1 is
Poisson) or `constant` at `--request-rate` (inf sends everything at once), at most `--max-concurrency`
in flight. `--request-rate 1,2,4` runs each rate in turn; `sweep` first runs a synchronous probe (one
request at a time) and a throughput probe (all at once), then `--sweep-points` rates between their
request rates, as GuideLLM does (benchmarks/bench_sweep.py: a table and one plot over the rates).
SLOs: `--goodput ttft:MS` or `--slo ttft_ms=...,itl_ms=...`; goodput is requests/s meeting all of
them, SLO attainment the share of requests sent that did.
PD hand-off: against pdserve (its /metrics has `pdserve:pd_handoff_seconds`), each request asks for
`stream_options.include_pd_handoff` and the finish chunk carries `pd_handoff_ms`; the report has
its percentiles beside TTFT/ITL, and the histogram's own over the run (estimated from its buckets).
Results: a printed report, and with `--result-dir` a JSON file per rate under vLLM's --save-result
key names, plus PNG plots (latency CDFs, per-second throughput timeline).

Every flag can also be set by environment variable `PDSERVE_BENCH_<FLAG>` (not `PDSERVE_<FLAG>`:
a container that sets `PDSERVE_MODEL` or `PDSERVE_PORT` for the server must not retarget the
load generator too).

    pdserve bench --port 8000 --num-prompts 200 --random-input-len 256 --random-output-len 64 \\
                  --request-rate 4 --max-concurrency 16 --goodput ttft:500 tpot:50 --result-dir out/
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import random
import re
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a script from a checkout: import this checkout's modules
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.arrivals import (  # noqa: E402
    Arrival,
    RunPlan,
    arrival_offsets,
    parse_rate,
    parse_rate_plan,
    sweep_rates,
)
from benchmarks.bench_sweep import format_sweep_table, save_sweep_plot, sweep_rows  # noqa: E402
from benchmarks.histograms import bucket_deltas, histogram_quantile  # noqa: E402
from benchmarks.mooncake_trace import MOONCAKE_BLOCK_SIZE, load_trace, send_offsets, trace_prompt  # noqa: E402

logger = logging.getLogger(__name__)

ENV_PREFIX = "PDSERVE_BENCH_"
MS = 1000.0
# Counters whose deltas give spec-decode acceptance; the vLLM names make the tool usable on vLLM too.
SPEC_PREFIXES = ("pdserve", "vllm")
# Server-side latency histograms (reported beside the client's numbers when the server has them).
SERVER_HISTOGRAMS = {"ttft": "time_to_first_token_seconds", "itl": "inter_token_latency_seconds",
                     "e2el": "e2e_request_latency_seconds",
                     "handoff": "pd_handoff_seconds"}  # PD: P's first token -> D's first tokens (pdserve only)
# Every percentile the hand-off is reported at, whatever --percentiles says: PD users read its tail.
HANDOFF_PERCENTILES = (50.0, 90.0, 99.0)
# Its pdserve histogram: its presence in /metrics is how the bench knows to ask for per-request values.
HANDOFF_COUNT = "pdserve:pd_handoff_seconds_count"


# -- data ---------------------------------------------------------------------------------------

@dataclass
class SampleRequest:
    prompt: list[int] | str
    prompt_len: int
    expected_output_len: int
    send_at: float | None = None  # trace replay: seconds after the run's start (else the arrival process decides)


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int | None = None  # usage.completion_tokens (None: the server sent no usage)
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0                 # perf_counter when sent
    chunk_times: list[float] = field(default_factory=list)  # perf_counter of each chunk with choices
    generated_text: str = ""
    done: bool = False                 # the stream ended with `data: [DONE]`
    stalled: bool = False              # no bytes for --stall-timeout seconds (a hung request)
    timed_out: bool = False            # over the whole-request limit
    server_error: bool = False         # the server said what went wrong (HTTP error status or SSE error event)
    handoff_ms: float | None = None    # PD: the server's `pd_handoff_ms` on the finish chunk (P's t0 -> D's first)
    cached_tokens: int | None = None   # usage.prompt_tokens_details.cached_tokens (prefix-cache hit), if sent


# -- flags --------------------------------------------------------------------------------------

def _env_default(flag: str, typ, default):
    raw = os.environ.get(ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper())
    return typ(raw) if raw is not None else default


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """The bench flags (vLLM's names where vLLM has them); used by `pdserve bench` and `main`."""
    def add(flag: str, typ, default, help_: str, **kw) -> None:
        env = ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()
        p.add_argument(flag, type=typ, default=_env_default(flag, typ, default), help=f"{help_} [{env}]", **kw)

    add("--base-url", str, None, "server URL (default http://HOST:PORT)")
    add("--host", str, "127.0.0.1", "server host")
    add("--port", int, 8000, "server port")
    add("--endpoint", str, "/v1/completions", "completions path")
    add("--model", str, None, "model name sent in requests (default: the first of GET /v1/models)")
    add("--tokenizer", str, None, "local tokenizer / checkpoint directory: vocabulary for random prompts and "
                                  "lengths for ShareGPT (default: the bundled model)")
    add("--api-key", str, os.environ.get("OPENAI_API_KEY", ""), "sent as Authorization: Bearer KEY")
    add("--dataset-name", str, "random", "random | sharegpt | mooncake (trace replay)",
        choices=["random", "sharegpt", "mooncake"])
    add("--dataset-path", str, None, "ShareGPT-format JSON file, or a Mooncake-format JSONL trace")
    add("--trace-block-size", int, MOONCAKE_BLOCK_SIZE, "mooncake: prompt tokens each hash id stands for")
    add("--trace-speedup", float, 1.0, "mooncake: divide the trace's timestamps by this (2: twice as fast)")
    add("--num-prompts", int, 100, "requests to send")
    add("--random-input-len", int, 1024, "random: prompt tokens after the shared prefix")
    add("--random-output-len", int, 128, "random: output tokens per request")
    add("--random-range-ratio", float, 0.0, "random: lengths uniform in [len*(1-r), len*(1+r)]")
    add("--random-prefix-len", int, 0, "random: tokens of a prefix shared by every prompt")
    add("--sharegpt-output-len", int, None, "sharegpt: fixed output length (default: the dataset's answer length)")
    add("--sharegpt-max-len", int, 2048, "sharegpt: skip conversations whose prompt + answer exceed this")
    add("--request-rate", str, "inf", "requests per second (inf: all at once); a comma-separated list runs "
                                      "each rate in turn; 'sweep' probes synchronous and max throughput, "
                                      "then --sweep-points rates between them (GuideLLM's sweep)")
    add("--arrival", str, Arrival.POISSON, "arrival process at a finite rate: constant | poisson",
        choices=list(Arrival))
    add("--burstiness", float, 1.0, "poisson: gamma shape of the inter-arrival times (1: Poisson; <1 burstier)")
    add("--sweep-points", int, 8, "sweep: rates between the synchronous and the max-throughput probe")
    add("--max-concurrency", int, None, "most requests in flight at once")
    add("--seed", int, 0, "dataset and arrival seed")
    add("--temperature", float, 0.0, "sampling temperature")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction,
                   default=_env_default("--ignore-eos", lambda v: v not in ("0", "false"), None),
                   help="send ignore_eos (default: on for random, off for sharegpt) [PDSERVE_BENCH_IGNORE_EOS]")
    add("--percentiles", str, "99", "comma-separated percentiles reported besides mean and median")
    p.add_argument("--goodput", nargs="+", default=_env_default("--goodput", str.split, None),
                   metavar="KEY:MS", help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000 itl:100 "
                                          "[PDSERVE_BENCH_GOODPUT]")
    add("--slo", str, None, "SLOs as one string, e.g. ttft_ms=500,itl_ms=50 (keys ttft_ms, tpot_ms, itl_ms, "
                            "e2el_ms); with --goodput, both apply")
    add("--request-timeout", float, 600.0, "client-side limit on one request, seconds")
    add("--stall-timeout", float, 120.0, "fail a request that receives no bytes for this long, seconds")
    add("--metrics-url", str, None, "Prometheus endpoint for spec-decode and server-side latency "
                                    "(default BASE_URL/metrics; 'none' disables)")
    add("--result-dir", str, None, "write RESULT.json and PNG plots here")
    add("--result-filename", str, None, "JSON file name (default bench-RATE-qps-DATE.json)")
    add("--label", str, "", "free-form label stored in the JSON")
    p.add_argument("--disable-tqdm", action="store_true", default=_env_default("--disable-tqdm", bool, False),
                   help="no progress bar [PDSERVE_BENCH_DISABLE_TQDM]")
    p.add_argument("--skip-initial-test", action="store_true",
                   default=_env_default("--skip-initial-test", bool, False),
                   help="do not send vLLM's single readiness request first [PDSERVE_BENCH_SKIP_INITIAL_TEST]")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cli_args(p)
    return p.parse_args(argv)


# -- datasets -----------------------------------------------------------------------------------

def load_tokenizer_dir(path: str | None):
    """(tokenizer or None, vocabulary size or None) of a local checkpoint/tokenizer directory."""
    from engine.config import default_model
    from engine.tokenizer import load_tokenizer

    path = path or default_model()
    tokenizer, vocab = None, None
    if Path(path).is_dir():
        tokenizer = load_tokenizer(path)
        config = Path(path) / "config.json"
        if config.is_file():
            vocab = json.loads(config.read_text()).get("vocab_size")
    if tokenizer is not None:
        vocab = min(len(tokenizer), vocab or len(tokenizer))
    return tokenizer, vocab


def _lengths(rng: np.random.Generator, mean: int, ratio: float, n: int) -> np.ndarray:
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {ratio}")
    low, high = math.floor(mean * (1 - ratio)), math.ceil(mean * (1 + ratio))
    return rng.integers(max(low, 1), max(high, 1) + 1, size=n)


def sample_random(num: int, input_len: int, output_len: int, range_ratio: float, prefix_len: int,
                  vocab_size: int, special_ids: set[int], seed: int) -> list[SampleRequest]:
    """Token-id prompts: a shared random prefix, then uniformly random ids (no special tokens)."""
    rng = np.random.default_rng(seed)
    allowed = np.array([t for t in range(vocab_size) if t not in special_ids])
    prefix = rng.choice(allowed, size=prefix_len).tolist()
    in_lens, out_lens = _lengths(rng, input_len, range_ratio, num), _lengths(rng, output_len, range_ratio, num)
    return [SampleRequest(prefix + rng.choice(allowed, size=int(n_in)).tolist(), prefix_len + int(n_in), int(n_out))
            for n_in, n_out in zip(in_lens, out_lens)]


def sample_sharegpt(path: str, num: int, tokenizer, fixed_output_len: int | None, max_len: int,
                    seed: int) -> list[SampleRequest]:
    """First human turn as the prompt, the following answer's length as the output length (vLLM's rule:
    drop pairs with fewer than 4 tokens either side unless the output length is fixed)."""
    data = json.loads(Path(path).read_text())
    convs = [d["conversations"] for d in data if len(d.get("conversations") or []) >= 2]
    random.Random(seed).shuffle(convs)

    def count(text: str) -> int:
        if tokenizer is not None:
            return len(tokenizer(text).input_ids)
        return max(1, len(text) // 4)  # no tokenizer: the usual ~4 characters per token estimate

    out: list[SampleRequest] = []
    for conv in convs:
        if len(out) >= num:
            break
        prompt, answer = conv[0]["value"], conv[1]["value"]
        prompt_len = count(prompt)
        output_len = fixed_output_len or count(answer)
        if prompt_len < 4 or (fixed_output_len is None and output_len < 4):
            continue
        if prompt_len + output_len > max_len:
            continue
        out.append(SampleRequest(prompt, prompt_len, output_len))
    if len(out) < num:
        logger.warning("ShareGPT file %s gave only %d usable conversations of the %d requested", path, len(out), num)
    return out


def sample_mooncake(path: str, num: int, block_size: int, speedup: float, vocab_size: int,
                    special_ids: set[int], seed: int) -> list[SampleRequest]:
    """The trace's first `num` requests as token-id prompts (shared hash ids: shared prefixes), each
    to be sent at its timestamp / `speedup`."""
    rows = load_trace(path, num)
    allowed = np.array([t for t in range(vocab_size) if t not in special_ids])
    return [SampleRequest(trace_prompt(row, i, block_size, allowed, seed), row.input_length, row.output_length, at)
            for i, (row, at) in enumerate(zip(rows, send_offsets(rows, speedup)))]


def make_requests(args: argparse.Namespace) -> list[SampleRequest]:
    tokenizer, vocab = load_tokenizer_dir(args.tokenizer)
    if args.dataset_name in ("sharegpt", "mooncake") and not args.dataset_path:
        raise SystemExit(f"--dataset-name {args.dataset_name} needs --dataset-path FILE")
    if args.dataset_name == "sharegpt":
        return sample_sharegpt(args.dataset_path, args.num_prompts, tokenizer, args.sharegpt_output_len,
                               args.sharegpt_max_len, args.seed)
    if vocab is None:
        raise SystemExit(f"random prompts need a vocabulary: pass --tokenizer DIR (a checkpoint or tokenizer "
                         f"directory); {args.tokenizer or 'the bundled model'} has neither tokenizer nor config.json")
    special = set(getattr(tokenizer, "all_special_ids", []) or []) if tokenizer is not None else set()
    if args.dataset_name == "mooncake":
        return sample_mooncake(args.dataset_path, args.num_prompts, args.trace_block_size, args.trace_speedup,
                               vocab, special, args.seed)
    return sample_random(args.num_prompts, args.random_input_len, args.random_output_len, args.random_range_ratio,
                         args.random_prefix_len, vocab, special, args.seed)


# -- arrivals and requests ----------------------------------------------------------------------

def send_times(requests: list[SampleRequest], rate: float, arrival: Arrival, burstiness: float,
               seed: int) -> list[float]:
    """Offsets from the run's start: a trace's own times, else the arrival process at `rate`."""
    if requests and all(r.send_at is not None for r in requests):
        return [float(r.send_at) for r in requests]
    return arrival_offsets(len(requests), rate, arrival, burstiness, seed)


async def paced(requests: list[SampleRequest], offsets: list[float], start: float) -> AsyncIterator[SampleRequest]:
    """Yield each request at `start` + its offset (perf_counter clock)."""
    for req, at in zip(requests, offsets):
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        yield req


# Servers close idle keep-alive connections (uvicorn after 5 s, httpx's default expiry is also 5 s). A
# request sent on a connection at the moment the server closes it fails with a bare ReadError, which
# is a client artefact, not a server failure: retire idle connections well before any server would.
KEEPALIVE_EXPIRY_S = 2.0


def client_limits():
    """Connection pool limits for load generators: unbounded, with idle connections retired early."""
    import httpx

    return httpx.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=KEEPALIVE_EXPIRY_S)


def build_payload(req: SampleRequest, model: str, temperature: float, ignore_eos: bool,
                  pd_handoff: bool = False) -> dict:
    """`pd_handoff` asks pdserve for the per-request hand-off time (stream_options.include_pd_handoff),
    sent only to a server whose /metrics shows it is pdserve: other servers never see the field."""
    options = {"include_usage": True, **({"include_pd_handoff": True} if pd_handoff else {})}
    return {"model": model, "prompt": req.prompt, "temperature": temperature, "max_tokens": req.expected_output_len,
            "stream": True, "stream_options": options, "ignore_eos": ignore_eos}


async def send_request(client, url: str, payload: dict, headers: dict, prompt_len: int,
                       timeout_s: float) -> RequestResult:
    """One streaming completion, timed the way vLLM's bench client times it."""
    import httpx

    out = RequestResult(prompt_len=prompt_len)
    st = out.start = time.perf_counter()
    last = st

    async def consume() -> None:
        nonlocal last
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300].decode(errors='replace')}"
                out.server_error = True
                return
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line or line.startswith(":"):  # keep-alive comments
                    continue
                data = line[5:].strip() if line.startswith("data:") else line
                if data == "[DONE]":
                    out.done = True
                    continue
                chunk = json.loads(data)
                if chunk.get("error"):
                    err = chunk["error"]
                    out.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
                    out.server_error = True
                    return
                if chunk.get("choices"):
                    now = time.perf_counter()
                    if not out.chunk_times:
                        out.ttft = now - st
                    else:
                        out.itl.append(now - last)
                    last = now
                    out.chunk_times.append(now)
                    out.generated_text += chunk["choices"][0].get("text") or ""
                if chunk.get("usage"):
                    out.output_tokens = chunk["usage"].get("completion_tokens")
                    out.cached_tokens = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
                if chunk.get("pd_handoff_ms") is not None:
                    out.handoff_ms = float(chunk["pd_handoff_ms"])

    try:
        await asyncio.wait_for(consume(), timeout_s)
    except TimeoutError:
        out.timed_out = True
        out.error = f"client timeout: no answer within {timeout_s:.0f} s"
    except httpx.ReadTimeout:
        out.stalled = True
        out.error = "client timeout: the stream stalled (no bytes within the stall timeout)"
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        out.error = f"{type(e).__name__}: {e}"
    out.latency = last - st
    if not out.error and not out.chunk_times:
        out.error = "Never received a valid chunk to calculate TTFT."
    elif not out.error and not out.done:
        # Stricter than vLLM: a stream cut off without [DONE] is not a finished request.
        out.error = "the stream ended without [DONE] (truncated)"
    out.success = not out.error
    return out


# -- /metrics -----------------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_K_LABEL = re.compile(r'[{,]k="(\d+)"')
_LE_LABEL = re.compile(r'[{,]le="([^"]+)"')


def parse_prometheus(text: str) -> dict[str, float]:
    """Sum every sample by metric name (over all label sets: instances, roles, buckets); a sample
    with a `k` label (steps by the number of drafts chosen) also under `name[k]`, a histogram
    bucket also under `name{le=BOUND}` (benchmarks/histograms.py reads those)."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        sums[m.group(1)] = sums.get(m.group(1), 0.0) + value
        if m.group(2) and (k := _K_LABEL.search(m.group(2))):
            key = f"{m.group(1)}[{k.group(1)}]"
            sums[key] = sums.get(key, 0.0) + value
        if m.group(2) and (le := _LE_LABEL.search(m.group(2))):
            key = f"{m.group(1)}{{le={le.group(1)}}}"
            sums[key] = sums.get(key, 0.0) + value
    return sums


async def scrape(client, url: str | None) -> dict[str, float] | None:
    if not url:
        return None
    try:
        r = await client.get(url, timeout=10)
        return parse_prometheus(r.text) if r.status_code == 200 else None
    except Exception as e:  # an endpoint without /metrics is fine: those numbers are just not reported
        logger.info("no metrics from %s: %s", url, e)
        return None


def spec_decode_stats(before: dict[str, float] | None, after: dict[str, float] | None) -> dict | None:
    if not before or not after:
        return None
    for prefix in SPEC_PREFIXES:
        acc, draft = f"{prefix}:spec_decode_num_accepted_tokens_total", f"{prefix}:spec_decode_num_draft_tokens_total"
        if acc in after and draft in after:
            accepted = after[acc] - before.get(acc, 0.0)
            drafted = after[draft] - before.get(draft, 0.0)
            drafts_key = f"{prefix}:spec_decode_num_drafts_total"
            drafts = after.get(drafts_key, 0.0) - before.get(drafts_key, 0.0) if drafts_key in after else None
            if drafted == 0 and not drafts:
                return None  # the counters exist but nothing was drafted: no speculative decoding in this run
            return {"accepted_tokens": accepted, "draft_tokens": drafted, "drafts": drafts,
                    "acceptance_rate": accepted / drafted if drafted > 0 else None,
                    "acceptance_length": 1.0 + accepted / drafts if drafts else None,
                    "chosen_k": chosen_k_shares(before, after, f"{prefix}:spec_decode_num_steps_by_k_total")}
    return None


def chosen_k_shares(before: dict[str, float], after: dict[str, float], name: str) -> list[float] | None:
    """Share of the run's decode steps at each number of drafts the adaptive policy chose."""
    steps = []
    while (key := f"{name}[{len(steps)}]") in after:
        steps.append(after[key] - before.get(key, 0.0))
    total = sum(steps)
    return [n / total for n in steps] if total > 0 else None


def server_latency_means(before: dict[str, float] | None, after: dict[str, float] | None,
                         percentiles: tuple[float, ...] = HANDOFF_PERCENTILES) -> dict | None:
    """Server-side TTFT/ITL/E2EL/hand-off (ms) over the run from histogram deltas: the mean from
    sum/count, percentiles estimated from the buckets (so only as fine as the server's buckets)."""
    if not before or not after:
        return None
    out = {}
    for key, name in SERVER_HISTOGRAMS.items():
        for prefix in SPEC_PREFIXES:
            s, c = f"{prefix}:{name}_sum", f"{prefix}:{name}_count"
            if s in after and c in after:
                count = after[c] - before.get(c, 0.0)
                if count > 0:
                    out[f"mean_{key}_ms"] = (after[s] - before.get(s, 0.0)) / count * MS
                    out[f"{key}_count"] = count
                    buckets = bucket_deltas(before, after, f"{prefix}:{name}")
                    for p in percentiles:
                        q = histogram_quantile(buckets, p / 100.0)
                        if q is not None:
                            out[f"p{_pct_label(p)}_{key}_ms"] = q * MS
                break
    return out or None


# -- metrics ------------------------------------------------------------------------------------

SLO_KEYS = ("ttft", "tpot", "itl", "e2el")


def parse_goodput(items: list[str] | None, slo: str | None = None) -> dict[str, float]:
    """SLOs in ms by metric, from `--goodput ttft:500 tpot:50` and/or `--slo ttft_ms=500,itl_ms=50`."""
    pairs = [("--goodput", *item.partition(":")[::2]) for item in items or []]
    pairs += [("--slo", *item.strip().partition("=")[::2]) for item in (slo or "").split(",") if item.strip()]
    slos: dict[str, float] = {}
    for flag, key, value in pairs:
        key = key.strip().removesuffix("_ms")
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if key not in SLO_KEYS or ms < 0:
            raise SystemExit(f"{flag}: expected {', '.join(SLO_KEYS)} with a number of ms >= 0, got {key}={value!r}")
        slos[key] = ms
    return slos


def meets_slos(measured: dict[str, float], slos: dict[str, float]) -> bool:
    """Every SLO met; the ITL SLO holds for every gap of the request (its largest), so a stalled
    hand-off or a preemption misses it even when the mean gap is fine."""
    return all(measured[k] <= ms / MS for k, ms in slos.items())


def calculate_metrics(requests: list[SampleRequest], outputs: list[RequestResult], duration: float,
                      percentiles: list[float], goodput: dict[str, float], tokenizer=None) -> dict[str, Any]:
    """vLLM's `calculate_metrics`: per-request TTFT/TPOT/E2EL, pooled ITL, throughputs, goodput."""
    ttfts, tpots, all_tpots, e2els, itls, out_lens, in_lens = [], [], [], [], [], [], []
    completed = good = 0
    for req, out in zip(requests, outputs):
        if not out.success:
            out_lens.append(0)
            continue
        n = out.output_tokens
        if n is None:  # no usage from the server: count tokens of the text, or chunks as a last resort
            if tokenizer:
                n = len(tokenizer(out.generated_text, add_special_tokens=False).input_ids)
            else:
                n = len(out.chunk_times)
        out_lens.append(n)
        in_lens.append(req.prompt_len)
        tpot = (out.latency - out.ttft) / (n - 1) if n > 1 else 0.0
        if n > 1:
            tpots.append(tpot)
        all_tpots.append(tpot)
        itls += out.itl
        ttfts.append(out.ttft)
        e2els.append(out.latency)
        completed += 1
        measured = {"ttft": out.ttft, "tpot": tpot, "e2el": out.latency, "itl": max(out.itl, default=0.0)}
        if goodput and meets_slos(measured, goodput):
            good += 1
    total_out = sum(out_lens)
    metrics: dict[str, Any] = {
        "duration": duration, "completed": completed, "failed": len(outputs) - completed,
        "total_input_tokens": sum(in_lens), "total_output_tokens": total_out,
        "request_throughput": completed / duration, "output_throughput": total_out / duration,
        "total_token_throughput": (sum(in_lens) + total_out) / duration,
        "request_goodput": good / duration if goodput else None,
        # Share of the requests sent (failures miss) that met every SLO: GuideLLM/DistServe's attainment.
        "slo_attainment": good / len(outputs) if goodput and outputs else None,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        arr = np.asarray(values or [0.0]) * MS
        metrics[f"mean_{name}_ms"] = float(arr.mean())
        metrics[f"median_{name}_ms"] = float(np.median(arr))
        metrics[f"std_{name}_ms"] = float(arr.std())
        for p in percentiles:
            metrics[f"p{_pct_label(p)}_{name}_ms"] = float(np.percentile(arr, p))
    metrics.update(handoff_stats([o.handoff_ms for o in outputs if o.success and o.handoff_ms is not None],
                                 percentiles))
    return metrics


def handoff_stats(values_ms: list[float], percentiles: list[float]) -> dict[str, Any]:
    """The PD hand-off of the requests that had one (as the server stamped it on the stream)."""
    out: dict[str, Any] = {"pd_handoff_count": len(values_ms)}
    if not values_ms:
        return out
    arr = np.asarray(values_ms)
    out["mean_pd_handoff_ms"], out["median_pd_handoff_ms"] = float(arr.mean()), float(np.median(arr))
    for p in sorted({*HANDOFF_PERCENTILES, *percentiles}):
        out[f"p{_pct_label(p)}_pd_handoff_ms"] = float(np.percentile(arr, p))
    return out


def _pct_label(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def throughput_timeline(outputs: list[RequestResult], bench_start: float) -> dict[str, list[float]]:
    """Per-second output tokens, finished requests and mean requests in flight.

    A chunk may carry several tokens (MTP), and only the request's total is known (usage), so each
    request's tokens are spread evenly over its chunks."""
    ends = [o.chunk_times[-1] for o in outputs if o.chunk_times]
    if not ends:
        return {"second": [], "output_tokens": [], "finished_requests": [], "in_flight": []}
    seconds = int(math.ceil(max(ends) - bench_start)) or 1
    tokens, finished, in_flight = np.zeros(seconds), np.zeros(seconds), np.zeros(seconds)
    for o in outputs:
        if not o.chunk_times:
            continue
        per_chunk = (o.output_tokens or len(o.chunk_times)) / len(o.chunk_times)
        for t in o.chunk_times:
            tokens[min(int(t - bench_start), seconds - 1)] += per_chunk
        if o.success:
            finished[min(int(o.chunk_times[-1] - bench_start), seconds - 1)] += 1
        # Time-weighted: a request in flight for half of a second counts 0.5 in that second.
        start, end = o.start - bench_start, o.chunk_times[-1] - bench_start
        for sec in range(max(int(start), 0), min(int(end), seconds - 1) + 1):
            in_flight[sec] += max(0.0, min(end, sec + 1) - max(start, sec))
    return {"second": list(range(seconds)), "output_tokens": tokens.tolist(),
            "finished_requests": finished.tolist(), "in_flight": in_flight.tolist()}


def peak_concurrency(outputs: list[RequestResult]) -> int:
    """Most requests in flight at any instant (send to last chunk)."""
    events = sorted([(o.start, 1) for o in outputs] + [(o.start + o.latency, -1) for o in outputs],
                    key=lambda e: (e[0], e[1]))
    peak = cur = 0
    for _, delta in events:
        cur += delta
        peak = max(peak, cur)
    return peak


# -- the run ------------------------------------------------------------------------------------

async def _served_model(client, base_url: str, headers: dict) -> str:
    r = await client.get(base_url + "/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


async def run_benchmark(args: argparse.Namespace, requests: list[SampleRequest],
                        plan: RunPlan | None = None) -> tuple[dict, list[RequestResult]]:
    """One run of `requests` (the flags' rate and concurrency unless `plan` says otherwise)."""
    import httpx

    if plan is None:
        plan = RunPlan(parse_rate(args.request_rate), args.max_concurrency, not args.skip_initial_test)
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    metrics_url = None if (args.metrics_url or "").lower() == "none" else (args.metrics_url or base_url + "/metrics")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    ignore_eos = args.ignore_eos if args.ignore_eos is not None else args.dataset_name in ("random", "mooncake")
    # read= is the stall timeout: the longest silence between two bytes of one response.
    timeout = httpx.Timeout(args.request_timeout, read=args.stall_timeout, connect=30.0)
    async with httpx.AsyncClient(limits=client_limits(), timeout=timeout) as client:
        model = args.model or await _served_model(client, base_url, headers)
        if plan.initial_test:
            await _initial_test(client, base_url + args.endpoint, requests[0], model, args, headers, ignore_eos)
        before = await scrape(client, metrics_url)
        pd_handoff = bool(before) and HANDOFF_COUNT in before
        offsets = send_times(requests, plan.rate, Arrival(args.arrival), args.burstiness, args.seed)
        outputs, bench_start, duration = await _send_all(
            client, base_url + args.endpoint, headers, requests, offsets, plan.max_concurrency,
            lambda req: build_payload(req, model, args.temperature, ignore_eos, pd_handoff), args)
        # Engines publish counters in heartbeats (every 0.2 s in pdserve): wait for the last ones.
        await asyncio.sleep(0.5 if metrics_url else 0.0)
        after = await scrape(client, metrics_url)

    tokenizer, _ = load_tokenizer_dir(args.tokenizer) if any(o.output_tokens is None for o in outputs) else (None, None)
    percentiles = [float(p) for p in str(args.percentiles).split(",") if p.strip()]
    slos = parse_goodput(args.goodput, args.slo)
    result = calculate_metrics(requests, outputs, duration, percentiles, slos, tokenizer)
    result.update(_run_info(args, plan, base_url, model, len(requests), percentiles, slos, ignore_eos))
    result.update(_spec_keys(spec_decode_stats(before, after)))
    result.update({
        "server_side": server_latency_means(before, after),
        "errors": [o.error for o in outputs if o.error],
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": [o.output_tokens if o.success else 0 for o in outputs],
        "ttfts": [o.ttft for o in outputs], "e2els": [o.latency for o in outputs],
        "latencies": [o.latency for o in outputs], "itls": [o.itl for o in outputs],
        "start_times": [o.start - bench_start for o in outputs],
        "pd_handoffs_ms": [o.handoff_ms for o in outputs],
        "cached_tokens": [o.cached_tokens for o in outputs],
        "total_cached_tokens": sum(o.cached_tokens or 0 for o in outputs if o.success),
        "generated_texts": [o.generated_text for o in outputs],
        "timeline": throughput_timeline(outputs, bench_start),
    })
    timeline = result["timeline"]["output_tokens"]
    result["max_output_tokens_per_s"] = max(timeline) if timeline else 0.0
    result["max_concurrent_requests"] = peak_concurrency(outputs)
    return result, outputs


async def _initial_test(client, url: str, first: SampleRequest, model: str, args: argparse.Namespace,
                        headers: dict, ignore_eos: bool) -> None:
    """vLLM's single readiness request before the measured ones."""
    logger.info("initial single-request test run")
    probe = SampleRequest(first.prompt, first.prompt_len, min(first.expected_output_len, 8))
    res = await send_request(client, url, build_payload(probe, model, args.temperature, ignore_eos), headers,
                             probe.prompt_len, args.request_timeout)
    if not res.success:
        raise SystemExit(f"initial test request failed: {res.error}")


async def _send_all(client, url: str, headers: dict, requests: list[SampleRequest], offsets: list[float],
                    max_concurrency: int | None, payload_of, args: argparse.Namespace,
                    ) -> tuple[list[RequestResult], float, float]:
    """Send every request at its offset, at most `max_concurrency` in flight (a request over the
    limit waits for a slot, as in vLLM); (outputs in request order, start, duration)."""
    from tqdm.asyncio import tqdm

    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    pbar = None if args.disable_tqdm else tqdm(total=len(requests), desc="requests")

    async def one(req: SampleRequest) -> RequestResult:
        if semaphore is None:
            res = await send_request(client, url, payload_of(req), headers, req.prompt_len, args.request_timeout)
        else:
            async with semaphore:
                res = await send_request(client, url, payload_of(req), headers, req.prompt_len, args.request_timeout)
        if pbar is not None:
            pbar.update(1)
        return res

    bench_start = time.perf_counter()
    tasks = [asyncio.create_task(one(req)) async for req in paced(requests, offsets, bench_start)]
    outputs = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - bench_start
    if pbar is not None:
        pbar.close()
    return outputs, bench_start, duration


def _run_info(args: argparse.Namespace, plan: RunPlan, base_url: str, model: str, num_prompts: int,
              percentiles: list[float], slos: dict[str, float], ignore_eos: bool) -> dict[str, Any]:
    """The run's set-up, under `vllm bench serve --save-result`'s key names where it has them."""
    traced = args.dataset_name == "mooncake"
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "endpoint_type": "openai", "backend": "openai",
        "label": args.label, "model_id": model, "tokenizer_id": args.tokenizer, "num_prompts": num_prompts,
        # vLLM writes an infinite rate as the string "inf" (JSON has no Infinity).
        "request_rate": "inf" if math.isinf(plan.rate) else plan.rate,
        "burstiness": args.burstiness, "max_concurrency": plan.max_concurrency,
        "base_url": base_url, "endpoint": args.endpoint, "dataset_name": args.dataset_name,
        "arrival": "trace" if traced else ("burst" if math.isinf(plan.rate) else str(args.arrival)),
        "trace_speedup": args.trace_speedup if traced else None, "run_kind": plan.name or None,
        "percentiles": percentiles, "goodput_slos_ms": slos, "ignore_eos": ignore_eos,
    }


def _spec_keys(spec: dict | None) -> dict[str, Any]:
    """Ours under "spec_decode", and vLLM's flat spec_decode_* keys (its acceptance rate in %)."""
    if spec is None:
        return {"spec_decode": None}
    rate = spec["acceptance_rate"]
    return {"spec_decode": spec,
            "spec_decode_acceptance_rate": rate * 100 if rate is not None else None,
            "spec_decode_acceptance_length": spec["acceptance_length"],
            "spec_decode_num_drafts": int(spec["drafts"] or 0),
            "spec_decode_draft_tokens": int(spec["draft_tokens"]),
            "spec_decode_accepted_tokens": int(spec["accepted_tokens"])}


# -- report -------------------------------------------------------------------------------------

def format_report(r: dict) -> str:
    """The report in vLLM's layout."""
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]

    def row(name: str, value, fmt: str = "<10.2f") -> None:
        lines.append("{:<40} {}".format(name, "n/a" if value is None else format(value, fmt)))

    row("Successful requests:", r["completed"], "<10")
    row("Failed requests:", r["failed"], "<10")
    if r["max_concurrency"]:
        row("Maximum request concurrency:", r["max_concurrency"], "<10")
    row("Request rate configured (RPS):", math.inf if r["request_rate"] == "inf" else r["request_rate"])
    row("Arrivals:", r["arrival"], "<10")
    if r.get("trace_speedup") is not None:
        row("Trace speed-up:", r["trace_speedup"])
    row("Benchmark duration (s):", r["duration"])
    row("Total input tokens:", r["total_input_tokens"], "<10")
    row("Total generated tokens:", r["total_output_tokens"], "<10")
    row("Prompt tokens from the prefix cache:", r.get("total_cached_tokens"), "<10")
    row("Request throughput (req/s):", r["request_throughput"])
    if r["request_goodput"] is not None:
        row("Request goodput (req/s):", r["request_goodput"])
        row("SLO attainment (%):", r["slo_attainment"] * 100)
    row("Output token throughput (tok/s):", r["output_throughput"])
    row("Peak output token throughput (tok/s):", r["max_output_tokens_per_s"])
    row("Peak concurrent requests:", r["max_concurrent_requests"], "<10")
    row("Total Token throughput (tok/s):", r["total_token_throughput"])
    titles = {"ttft": ("Time to First Token", "TTFT"), "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
              "itl": ("Inter-token Latency", "ITL"), "e2el": ("End-to-end Latency", "E2EL")}
    for key, (title, short) in titles.items():
        lines.append("{s:{c}^50}".format(s=title, c="-"))
        row(f"Mean {short} (ms):", r[f"mean_{key}_ms"])
        row(f"Median {short} (ms):", r[f"median_{key}_ms"])
        for p in r["percentiles"]:
            row(f"P{_pct_label(p)} {short} (ms):", r[f"p{_pct_label(p)}_{key}_ms"])
    if r.get("pd_handoff_count"):
        lines.append("{s:{c}^50}".format(s="PD hand-off (P's first token -> D's)", c="-"))
        row("Requests with a hand-off:", r["pd_handoff_count"], "<10")
        row("Mean hand-off (ms):", r["mean_pd_handoff_ms"])
        for p in sorted({*HANDOFF_PERCENTILES, *r["percentiles"]}):
            row(f"P{_pct_label(p)} hand-off (ms):", r[f"p{_pct_label(p)}_pd_handoff_ms"])
    spec = r.get("spec_decode")
    if spec:
        lines.append("{s:{c}^50}".format(s="Speculative Decoding", c="-"))
        rate = spec["acceptance_rate"]
        row("Acceptance rate (%):", rate * 100 if rate is not None else None)
        row("Acceptance length:", spec["acceptance_length"])
        row("Drafts:", spec["drafts"], "<10.0f")
        row("Draft tokens:", spec["draft_tokens"], "<10.0f")
        row("Accepted tokens:", spec["accepted_tokens"], "<10.0f")
        if spec.get("chosen_k"):
            lines.append("{:<40}{}".format("Steps by drafts chosen (k: share):",
                                           " ".join(f"{k}:{x:.2f}" for k, x in enumerate(spec["chosen_k"]))))
    server = r.get("server_side")
    if server:
        lines.append("{s:{c}^50}".format(s="Server-side (/metrics)", c="-"))
        for key, short in (("ttft", "TTFT"), ("itl", "ITL"), ("e2el", "E2EL"), ("handoff", "PD hand-off")):
            if f"mean_{key}_ms" in server:
                row(f"Mean {short} (ms):", server[f"mean_{key}_ms"])
        for p in HANDOFF_PERCENTILES:
            if f"p{_pct_label(p)}_handoff_ms" in server:
                row(f"P{_pct_label(p)} PD hand-off, from buckets (ms):", server[f"p{_pct_label(p)}_handoff_ms"])
    if r["errors"]:
        lines.append("{s:{c}^50}".format(s="Errors (first 3)", c="-"))
        lines += [f"  {e[:120]}" for e in r["errors"][:3]]
    lines.append("=" * 50)
    return "\n".join(lines)


def save_plots(result: dict, outputs: list[RequestResult], stem: Path) -> list[Path]:
    """Latency CDFs (TTFT, TPOT, ITL, E2EL), the per-second throughput timeline and, in PD, each
    request's hand-off against its prompt length, as PNGs."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    ok = [o for o in outputs if o.success]
    series = {
        "TTFT": [o.ttft * MS for o in ok],
        "TPOT": [(o.latency - o.ttft) / (o.output_tokens - 1) * MS for o in ok if (o.output_tokens or 0) > 1],
        "ITL": [g * MS for o in ok for g in o.itl],
        "E2EL": [o.latency * MS for o in ok],
    }
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (name, values) in zip(axes.flat, series.items()):
        if values:
            xs = np.sort(values)
            ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), drawstyle="steps-post")
        ax.set_title(f"{name} CDF ({len(values)} samples)")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction")
        ax.grid(alpha=0.3)
    fig.suptitle(result.get("label") or "pdserve bench")
    fig.tight_layout()
    cdf_path = stem.with_name(stem.name + "_latency_cdf.png")
    fig.savefig(cdf_path, dpi=90)
    plt.close(fig)

    tl = result["timeline"]
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot(tl["second"], tl["output_tokens"], label="output tokens/s")
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("tokens/s")
    ax2 = ax.twinx()
    ax2.plot(tl["second"], tl["in_flight"], color="tab:orange", alpha=0.6, label="mean requests in flight")
    ax2.bar(tl["second"], tl["finished_requests"], color="tab:green", alpha=0.3, label="finished/s")
    ax2.set_ylabel("requests")
    handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], loc="upper right")
    ax.set_title("throughput timeline")
    fig.tight_layout()
    tl_path = stem.with_name(stem.name + "_throughput.png")
    fig.savefig(tl_path, dpi=90)
    plt.close(fig)
    handoffs = [(o.prompt_len, o.handoff_ms) for o in outputs if o.success and o.handoff_ms is not None]
    return [cdf_path, tl_path, *([_handoff_plot(handoffs, stem, plt)] if handoffs else [])]


def _handoff_plot(points: list[tuple[int, float]], stem: Path, plt) -> Path:
    """PD hand-off per request against its prompt length: how the KV a hand-off carries shows in it."""
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.scatter([p for p, _ in points], [h for _, h in points], s=12)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("hand-off (ms): P's first token -> D's")
    ax.set_title(f"PD hand-off ({len(points)} requests)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = stem.with_name(stem.name + "_handoff.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _rate_tag(rate: float | str) -> str:
    return "inf" if rate == "inf" or (isinstance(rate, float) and math.isinf(rate)) else f"{rate:g}"


def save_result(args: argparse.Namespace, result: dict, outputs: list[RequestResult],
                name: str | None = None) -> list[Path]:
    """RESULT.json (vLLM's --save-result keys, plus ours) and its PNGs."""
    out_dir = Path(args.result_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    traffic = "trace" if result["arrival"] == "trace" else f"{_rate_tag(result['request_rate'])}qps"
    name = name or args.result_filename or f"bench-{traffic}-{result['date']}.json"
    json_path = out_dir / name
    json_path.write_text(json.dumps(result, indent=1, default=float))
    return [json_path, *save_plots(result, outputs, json_path.with_suffix(""))]


def benchmark(args: argparse.Namespace) -> dict:
    """Run the whole benchmark for parsed flags; print the report; save JSON + plots if asked.
    Several rates (a list or a sweep) give one report and JSON per rate, a table and one plot."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    try:
        rate_plan = parse_rate_plan(args.request_rate)
    except ValueError as e:
        raise SystemExit(f"--request-rate: {e}") from None
    if args.dataset_name == "mooncake" and rate_plan.rates != (math.inf,):
        raise SystemExit("--dataset-name mooncake sends each request at its trace time: scale time with "
                         "--trace-speedup instead of --request-rate")
    requests = make_requests(args)
    if not requests:
        raise SystemExit("no requests to send")
    if rate_plan.is_sweep or len(rate_plan.rates) > 1:
        return run_rates(args, requests, rate_plan.rates)
    result, outputs = asyncio.run(run_benchmark(args, requests))
    print(format_report(result), flush=True)
    if args.result_dir:
        paths = save_result(args, result, outputs)
        result["files"] = [str(p) for p in paths]
        print("results: " + ", ".join(result["files"]), flush=True)
    return result


def run_rates(args: argparse.Namespace, requests: list[SampleRequest], rates: tuple[float, ...]) -> dict:
    """Each rate in turn on the same requests (a sweep first runs its two probes, GuideLLM's way:
    one request at a time, then all at once, and spreads --sweep-points rates between their
    request rates). The returned dict has every run, the per-rate summary and the files."""
    def run(plan: RunPlan) -> dict:
        result, outputs = asyncio.run(run_benchmark(args, requests, plan))
        print(format_report(result), flush=True)
        if args.result_dir:
            stem = Path(args.result_filename or f"bench-{result['date']}").stem
            name = f"{stem}-{plan.name or 'rate'}-{_rate_tag(result['request_rate'])}qps.json"
            result["files"] = [str(p) for p in save_result(args, result, outputs, name)]
        return result

    first_test = not args.skip_initial_test
    runs: list[dict] = []
    if not rates:
        runs.append(run(RunPlan(math.inf, 1, first_test, "synchronous")))
        runs.append(run(RunPlan(math.inf, args.max_concurrency, False, "throughput")))
        rates = tuple(sweep_rates(runs[0]["request_throughput"], runs[1]["request_throughput"], args.sweep_points))
    for i, rate in enumerate(rates):
        runs.append(run(RunPlan(rate, args.max_concurrency, first_test and not runs and i == 0, str(args.arrival))))
    rows = sweep_rows(runs)
    print(format_sweep_table(rows), flush=True)
    out = {"runs": runs, "sweep": rows, "failed": sum(r["failed"] for r in runs), "files": []}
    if args.result_dir:
        stem = Path(args.result_filename or f"bench-{runs[0]['date']}").stem
        summary = Path(args.result_dir) / f"{stem}-sweep.json"
        plot = save_sweep_plot(rows, summary.with_suffix(".png"), args.label)
        out["files"] = [str(summary), str(plot)] + [f for r in runs for f in r.get("files", [])]
        summary.write_text(json.dumps({"label": args.label, "sweep": rows, "files": out["files"]}, indent=1))
        print("results: " + ", ".join(out["files"][:2]), flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(level=os.environ.get("PDSERVE_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return benchmark(parse_args(argv))


if __name__ == "__main__":
    main()
