"""`pdserve bench` as a load tool (issue 48 item 4): rate lists and sweeps, arrival processes, SLO
goodput, Mooncake trace replay with shared prefixes, the per-request PD hand-off, and results JSON
under `vllm bench serve --save-result`'s key names.

The live tests run the bench in this process against the HTTP harness (tests/http_harness.py: the
real front end over engine threads), a few short requests each, every request bounded by the
bench's own --request-timeout / --stall-timeout.

The hand-off check: the server stamps each PD request's finish chunk with the very value it puts
in pdserve:pd_handoff_seconds, so the stream's values and the histogram's delta must agree exactly
in count and sum (up to float rounding of the ms conversion). The percentiles /metrics can give
are estimates from buckets, so the tolerance there is the bucket resolution: Prometheus's estimate
must lie in the span of the buckets that hold the two samples the exact percentile lies between
(its rank q*n picks sample ceil(q*n), which is one of numpy's two neighbours at rank q*(n-1)).
"""
from __future__ import annotations

import json
import math

import httpx
import numpy as np
import pytest
from conftest import BUNDLED_MODEL
from http_harness import served

from benchmarks import bench_serving
from benchmarks.arrivals import Arrival, arrival_offsets, parse_rate_plan, sweep_rates
from benchmarks.bench_serving import RequestResult, SampleRequest, calculate_metrics, parse_goodput, parse_prometheus
from benchmarks.histograms import bucket_deltas, bucket_of, histogram_quantile
from benchmarks.mooncake_trace import load_trace, synthetic_trace, write_trace

MODEL = "pdserve-tiny"


# The keys `vllm bench serve --save-result --save-detailed` writes that this tool writes too.
VLLM_KEYS = ("date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
             "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
             "total_output_tokens", "request_throughput", "request_goodput", "output_throughput",
             "total_token_throughput", "input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times",
             "generated_texts", "errors", "max_output_tokens_per_s", "max_concurrent_requests",
             *(f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "std", "p99")))


def strict_json(path) -> dict:
    """JSON as a strict parser reads it: NaN and Infinity are refused."""
    def refuse(name: str):
        raise AssertionError(f"{path} holds {name}, which is not JSON")
    return json.loads(path.read_text(), parse_constant=refuse)


def bench_argv(url: str, *flags: str) -> list[str]:
    return ["--base-url", url, "--tokenizer", str(BUNDLED_MODEL), "--disable-tqdm", "--skip-initial-test",
            "--request-timeout", "120", "--stall-timeout", "60", "--seed", "1", *flags]


# -- unit: arrivals, rates, SLOs, histograms, traces --------------------------------------------

def gaps(offsets: list[float]) -> np.ndarray:
    return np.diff(np.asarray(offsets))


def test_poisson_arrivals_have_the_configured_mean_and_spread():
    rate, n = 5.0, 4001
    poisson = gaps(arrival_offsets(n, rate, Arrival.POISSON, 1.0, seed=7))
    # The mean of n-1 exponential gaps has standard error (1/rate)/sqrt(n-1); 4 of them is a
    # fixed-seed check that a wrong rate (or a rate/shape mix-up) cannot pass.
    assert abs(poisson.mean() - 1 / rate) < 4 * (1 / rate) / math.sqrt(n - 1)
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, abs=0.08)  # exponential: CV 1
    bursty = gaps(arrival_offsets(n, rate, Arrival.POISSON, 0.25, seed=7))
    assert abs(bursty.mean() - 1 / rate) < 4 * 2 * (1 / rate) / math.sqrt(n - 1)  # gamma(0.25): CV 2
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, abs=0.25)
    assert np.allclose(gaps(arrival_offsets(n, rate, Arrival.CONSTANT, 1.0, seed=7)), 1 / rate)
    assert arrival_offsets(3, math.inf, Arrival.POISSON, 1.0, seed=7) == [0.0, 0.0, 0.0]
    assert arrival_offsets(5, rate, Arrival.POISSON, 1.0, seed=3) == arrival_offsets(5, rate, Arrival.POISSON, 1.0, 3)
    assert arrival_offsets(5, rate, Arrival.POISSON, 1.0, seed=3)[0] == 0.0


def test_rate_plans_and_sweep_rates():
    assert parse_rate_plan("4").rates == (4.0,) and parse_rate_plan("inf").rates == (math.inf,)
    assert parse_rate_plan("1, 2,4").rates == (1.0, 2.0, 4.0)
    assert parse_rate_plan("sweep").is_sweep
    for bad in ("0", "-1", "fast", ","):
        with pytest.raises(ValueError):
            parse_rate_plan(bad)
    assert sweep_rates(1.0, 4.0, 2) == pytest.approx([2.0, 3.0])  # strictly between the probes
    assert sweep_rates(4.0, 1.0, 1) == pytest.approx([2.5])


def test_slo_flags_and_itl_goodput():
    assert parse_goodput(["ttft:500"], "itl_ms=50, e2el_ms=2000") == {"ttft": 500.0, "itl": 50.0, "e2el": 2000.0}
    for bad in ("foo_ms=1", "ttft_ms=-1", "ttft_ms=x"):
        with pytest.raises(SystemExit):
            parse_goodput(None, bad)
    reqs = [SampleRequest([1] * 4, 4, 3)] * 3
    outs = [RequestResult(success=True, output_tokens=3, ttft=0.1, latency=0.3, itl=[0.1, 0.1], handoff_ms=4.0),
            RequestResult(success=True, output_tokens=3, ttft=0.1, latency=0.35, itl=[0.19, 0.06], handoff_ms=8.0),
            RequestResult(success=False, error="boom")]
    r = calculate_metrics(reqs, outs, duration=1.0, percentiles=[99], goodput=parse_goodput(None, "itl_ms=150"))
    # The second request's mean gap (125 ms) is within the SLO, its largest (190 ms) is not.
    assert r["request_goodput"] == 1.0 and r["slo_attainment"] == pytest.approx(1 / 3)
    assert r["pd_handoff_count"] == 2 and r["mean_pd_handoff_ms"] == 6.0
    assert r["p50_pd_handoff_ms"] == 6.0 and r["p90_pd_handoff_ms"] == pytest.approx(7.6)


def test_histogram_quantiles_from_scraped_buckets():
    text = "\n".join(f'pdserve:pd_handoff_seconds_bucket{{le="{le}"}} {n}'
                     for le, n in (("0.01", 2), ("0.02", 6), ("0.04", 10), ("+Inf", 10)))
    before = parse_prometheus("\n".join(f'pdserve:pd_handoff_seconds_bucket{{le="{le}"}} 2'
                                         for le in ("0.01", "0.02", "0.04", "+Inf")))
    buckets = bucket_deltas(before, parse_prometheus(text), "pdserve:pd_handoff_seconds")
    assert buckets == [(0.01, 0.0), (0.02, 4.0), (0.04, 8.0), (math.inf, 8.0)]
    assert histogram_quantile(buckets, 0.5) == pytest.approx(0.02)
    assert histogram_quantile(buckets, 0.75) == pytest.approx(0.03)
    assert bucket_of(buckets, 0.015) == (0.01, 0.02) and bucket_of(buckets, 1.0) == (0.04, math.inf)
    assert histogram_quantile([], 0.5) is None


def test_mooncake_trace_gives_equal_blocks_for_equal_hash_ids(tmp_path):
    path = tmp_path / "trace.jsonl"
    write_trace(path, synthetic_trace(12, num_prefixes=3, prefix_blocks=2, unique_blocks=1, output_length=4,
                                      rate=5.0, block_size=16, seed=0))
    rows = load_trace(path)
    reqs = bench_serving.sample_mooncake(str(path), 100, 16, 2.0, 4096, {0, 1}, seed=0)
    assert len(reqs) == len(rows) == 12
    for row, req in zip(rows, reqs):
        assert req.prompt_len == len(req.prompt) == row.input_length and req.expected_output_len == 4
        assert not {0, 1} & set(req.prompt)  # special ids excluded
    by_first = {}
    for row, req in zip(rows, reqs):
        by_first.setdefault(row.hash_ids[:2], []).append(req.prompt)
    assert len(by_first) > 1 and any(len(group) > 1 for group in by_first.values())
    for group in by_first.values():
        assert all(p[:32] == group[0][:32] for p in group)  # same hash ids: the same 2 blocks of tokens
        assert all(p[32:48] != q[32:48] for p in group for q in group if p is not q)  # own blocks differ
    firsts = [g[0][:16] for g in by_first.values()]
    assert all(a != b for i, a in enumerate(firsts) for b in firsts[i + 1:])
    # Replay times: the trace's milliseconds, relative to its first request, over the speed-up.
    assert [r.send_at for r in reqs] == pytest.approx([(r.timestamp_ms - rows[0].timestamp_ms) / 2000 for r in rows])
    again = bench_serving.sample_mooncake(str(path), 100, 16, 2.0, 4096, {0, 1}, seed=0)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]


def test_malformed_trace_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 4, "output_length": 2, "hash_ids": [0]}\n'
                    '{"timestamp": 5, "input_length": 4}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_trace(path)


# -- live: colocated -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def colocated(tmp_path_factory, tokenizer):
    with served(tmp_path_factory.mktemp("colocated"), "colocated", tokenizer, MODEL, model=str(BUNDLED_MODEL),
                max_model_len=512, block_size=16) as s:
        yield s


def test_sweep_gives_per_rate_results_a_table_and_one_plot(colocated, tmp_path, capsys):
    out_dir = tmp_path / "sweep"
    result = bench_serving.main(bench_argv(
        colocated.url, "--request-rate", "sweep", "--sweep-points", "1", "--arrival", "constant",
        "--num-prompts", "4", "--random-input-len", "32", "--random-output-len", "4", "--percentiles", "50,90,99",
        "--slo", "ttft_ms=60000,itl_ms=60000", "--result-dir", str(out_dir), "--result-filename", "s.json"))
    report = capsys.readouterr().out
    runs = result["runs"]
    assert [r["run_kind"] for r in runs] == ["synchronous", "throughput", "constant"] and result["failed"] == 0
    assert runs[0]["max_concurrent_requests"] == 1  # the synchronous probe: one request at a time
    low, high = sorted((runs[0]["request_throughput"], runs[1]["request_throughput"]))
    assert low < runs[2]["request_rate"] < high and runs[2]["arrival"] == "constant"
    for r in runs:
        assert r["completed"] == 4 and r["slo_attainment"] == 1.0 and r["request_goodput"] == r["request_throughput"]
        assert r["pd_handoff_count"] == 0  # colocated: no hand-off, so no request carries one
    assert len(result["sweep"]) == 3 and "Rate sweep" in report and "SLO attainment (%):" in report
    summary = strict_json(out_dir / "s-sweep.json")
    assert [row["request_rate"] for row in summary["sweep"]] == ["inf", "inf", runs[2]["request_rate"]]
    png = (out_dir / "s-sweep.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    per_rate = sorted(p.name for p in out_dir.glob("s-*qps.json"))
    assert len(per_rate) == 3 and "s-synchronous-infqps.json" in per_rate
    saved = strict_json(out_dir / "s-synchronous-infqps.json")
    missing = [k for k in VLLM_KEYS if k not in saved]
    assert not missing, f"keys of vllm bench serve --save-result missing: {missing}"
    assert saved["request_rate"] == "inf" and saved["max_concurrency"] == 1
    assert saved["output_lens"] == [4] * 4 and saved["input_lens"] == [32] * 4 and len(saved["itls"]) == 4


def test_trace_replay_shares_prefixes_in_the_server_cache(colocated, tmp_path):
    """One request at a time, so every request after the first of its group finds that group's
    prefix in the cache whatever the timing; the first of a group finds nothing."""
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, synthetic_trace(8, num_prefixes=2, prefix_blocks=2, unique_blocks=1, output_length=3,
                                       rate=20.0, block_size=32, seed=4))
    rows = load_trace(trace)
    hits_before = colocated.hit_blocks("colocated-0")
    result = bench_serving.main(bench_argv(
        colocated.url, "--dataset-name", "mooncake", "--dataset-path", str(trace), "--trace-block-size", "32",
        "--trace-speedup", "4", "--max-concurrency", "1", "--num-prompts", "8",
        "--result-dir", str(tmp_path), "--result-filename", "trace.json"))
    assert result["completed"] == 8 and result["arrival"] == "trace"
    assert result["input_lens"] == [r.input_length for r in rows] and result["output_lens"] == [3] * 8
    seen: set = set()
    for row, cached in zip(rows, result["cached_tokens"]):
        group = row.hash_ids[:2]
        if group in seen:
            assert cached >= 64, f"a request of a group seen before had {cached} cached tokens"
        else:
            assert cached == 0
        seen.add(group)
    assert result["total_cached_tokens"] >= 64 * (8 - len(seen))
    assert colocated.hit_blocks("colocated-0") - hits_before >= 4 * (8 - len(seen))  # 16-token KV blocks
    offsets = [(r.timestamp_ms - rows[0].timestamp_ms) / 4000 for r in rows]
    assert all(start >= at - 1e-3 for start, at in zip(result["start_times"], offsets)), "sent before its time"
    strict_json(tmp_path / "trace.json")


def test_a_trace_refuses_a_rate_list(tmp_path):
    trace = tmp_path / "t.jsonl"
    write_trace(trace, synthetic_trace(2, 1, 1, 1, 2, 1.0, 16, 0))
    with pytest.raises(SystemExit, match="trace-speedup"):
        bench_serving.main(bench_argv("http://127.0.0.1:9", "--dataset-name", "mooncake", "--dataset-path",
                                      str(trace), "--request-rate", "1,2"))


# -- live: PD + MTP: the hand-off ------------------------------------------------------------------

@pytest.fixture(scope="module")
def pd(tmp_path_factory, tokenizer):
    with served(tmp_path_factory.mktemp("pd"), "pd", tokenizer, MODEL, model=str(BUNDLED_MODEL), max_model_len=512,
                block_size=16, speculative_method="mtp", num_speculative_tokens=2) as s:
        yield s


def stream_chunks(url: str, stream_options: dict) -> list[dict]:
    body = {"model": MODEL, "prompt": list(range(2, 40)), "max_tokens": 6, "ignore_eos": True, "stream": True,
            "stream_options": stream_options}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
    return [json.loads(x) for x in lines if x != "[DONE]"]


def test_handoff_only_when_asked(pd):
    plain = stream_chunks(pd.url, {"include_usage": True})
    assert not any("pd_handoff_ms" in c for c in plain)
    asked = stream_chunks(pd.url, {"include_usage": True, "include_pd_handoff": True})
    stamped = [c for c in asked if "pd_handoff_ms" in c]
    assert len(stamped) == 1 and stamped[0]["choices"][0]["finish_reason"] == "length"
    assert stamped[0]["pd_handoff_ms"] >= 0
    bad = httpx.post(pd.url + "/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2, "stream": True,
        "stream_options": {"include_pd_handoff": [1]}})
    assert bad.status_code == 400 and "include_pd_handoff" in bad.json()["error"]["param"]


def test_handoff_from_the_stream_matches_the_metrics_histogram(pd, tmp_path, capsys):
    n = 6
    before = parse_prometheus(httpx.get(pd.url + "/metrics", timeout=10).text)
    result = bench_serving.main(bench_argv(
        pd.url, "--request-rate", "20", "--arrival", "poisson", "--num-prompts", str(n), "--random-input-len", "48",
        "--random-range-ratio", "0.5", "--random-output-len", "6", "--result-dir", str(tmp_path),
        "--result-filename", "pd.json"))
    after = parse_prometheus(httpx.get(pd.url + "/metrics", timeout=10).text)
    report = capsys.readouterr().out
    assert result["completed"] == n and result["pd_handoff_count"] == n
    values = [v for v in result["pd_handoffs_ms"] if v is not None]
    name = "pdserve:pd_handoff_seconds"
    assert after[name + "_count"] - before.get(name + "_count", 0.0) == n
    assert sum(values) == pytest.approx((after[name + "_sum"] - before.get(name + "_sum", 0.0)) * 1000, rel=1e-9)
    buckets = bucket_deltas(before, after, name)
    server = result["server_side"]
    assert server["handoff_count"] == n
    ordered = sorted(values)
    for p in (50, 90, 99):
        exact = result[f"p{p}_pd_handoff_ms"]
        assert exact == pytest.approx(float(np.percentile(values, p)))
        rank = p / 100 * (n - 1)  # numpy's linear percentile lies between these two samples
        lo = bucket_of(buckets, ordered[math.floor(rank)] / 1000)[0]
        hi = bucket_of(buckets, ordered[math.ceil(rank)] / 1000)[1]
        assert lo * 1000 <= server[f"p{p}_handoff_ms"] <= hi * 1000, (p, exact, server[f"p{p}_handoff_ms"], lo, hi)
    for line in ("PD hand-off (P's first token -> D's)", "P90 hand-off (ms):", "P99 PD hand-off, from buckets (ms):",
                 "Acceptance rate (%):"):
        assert line in report, f"{line!r} missing from the report:\n{report}"
    assert (tmp_path / "pd_handoff.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # hand-off vs prompt length
    saved = strict_json(tmp_path / "pd.json")
    assert saved["spec_decode_draft_tokens"] > 0 and not [k for k in VLLM_KEYS if k not in saved]
