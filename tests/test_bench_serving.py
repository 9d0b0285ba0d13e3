"""`pdserve bench` against a running `pdserve serve`: report, JSON and PNGs, and client-side TTFT /
TPOT / ITL means that agree with the server's own /metrics histograms (issue: deployment + load test).

How the two sides are aligned (they measure the same events from two ends of one socket):

- The server observes TTFT when the first token-carrying engine chunk reaches the front end, and
  ITL between consecutive token-carrying chunks; the client times SSE chunks that carry `choices`.
  With a word-level tokenizer every token decodes to text, and no stop strings hold text back, so
  each token-carrying engine chunk becomes exactly one SSE chunk with choices (and the usage-only
  chunk has `"choices": []`). The test asserts the chunk counts are equal before comparing means.
- The server has no TPOT histogram. With `ignore_eos` and a fixed output length n, every request
  has n tokens, so mean TPOT on the server is (sum E2E - sum TTFT) / requests / (n - 1) — the same
  per-request formula the client uses, (E2EL - TTFT) / (n - 1), averaged.
- The client's TTFT also holds the HTTP request's trip into the handler and the first event's trip
  back (about a millisecond each on loopback; more on a loaded 2-core box). Prompts of 1024 tokens
  on a model the size of the bundled one make prefill dominate, so 10% covers that offset.
- The bench's own warm-up request is skipped (`--skip-initial-test`) so the /metrics deltas taken
  around the run cover exactly the measured requests.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import httpx
import pytest
from conftest import REPO, add_mtp_layer
from test_pd_http import Served

from benchmarks.bench_serving import parse_prometheus

logger = logging.getLogger(__name__)

NUM_PROMPTS = 24
INPUT_LEN = 1024
OUTPUT_LEN = 32


@pytest.fixture(scope="module")
def bench_model(tmp_path_factory) -> str:
    """A random-weight Qwen2 the size of the bundled model, with an MTP layer and a word-level tokenizer."""
    import torch
    import transformers

    from benchmarks.common import ensure_tokenizer

    path = tmp_path_factory.mktemp("bench") / "qwen2"
    cfg = transformers.Qwen2Config(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                   bos_token_id=None, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    add_mtp_layer(path)
    return ensure_tokenizer(str(path))


def histogram_delta(before: dict[str, float], after: dict[str, float], name: str) -> tuple[float, float]:
    key = f"pdserve:{name}"
    return after[key + "_sum"] - before.get(key + "_sum", 0.0), after[key + "_count"] - before.get(key + "_count", 0.0)


def test_bench_report_files_and_agreement_with_server_metrics(bench_model, tmp_path):
    served = Served(bench_model, "--mode", "pd", "--num-threads", "1", "--max-model-len", "2048",
                    "--num-kv-blocks", "1024")
    try:
        served.wait_healthy(120)
        before = parse_prometheus(served.metrics())
        out_dir = tmp_path / "results"
        argv = [sys.executable, "-m", "server.cli", "bench", "--port", str(served.port), "--tokenizer", bench_model,
                "--num-prompts", str(NUM_PROMPTS), "--random-input-len", str(INPUT_LEN),
                "--random-output-len", str(OUTPUT_LEN), "--max-concurrency", "4", "--request-rate", "inf",
                "--percentiles", "50,99", "--goodput", "ttft:60000", "tpot:60000", "--skip-initial-test",
                "--disable-tqdm", "--result-dir", str(out_dir), "--result-filename", "run.json", "--label", "test"]
        proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=180,
                              env=dict(os.environ, PDSERVE_LOG_LEVEL="WARNING"))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        after = parse_prometheus(served.metrics())
    finally:
        served.stop()

    report = proc.stdout
    for line in ("Serving Benchmark Result", f"Successful requests:                     {NUM_PROMPTS}",
                 "Mean TTFT (ms):", "P99 ITL (ms):", "P50 TPOT (ms):", "Request goodput (req/s):",
                 "Output token throughput (tok/s):", "Acceptance rate (%):"):
        assert line in report, f"{line!r} missing from the report:\n{report}"
    result = json.loads((out_dir / "run.json").read_text())
    for png in ("run_latency_cdf.png", "run_throughput.png"):
        data = (out_dir / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, png
    assert result["completed"] == NUM_PROMPTS and result["failed"] == 0
    assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    assert result["total_input_tokens"] == NUM_PROMPTS * INPUT_LEN
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])  # SLOs no request can miss

    # Spec decode: the bench's numbers are the /metrics deltas summed over instances.
    spec = result["spec_decode"]
    drafted = after["pdserve:spec_decode_num_draft_tokens_total"] - before["pdserve:spec_decode_num_draft_tokens_total"]
    assert spec is not None and spec["draft_tokens"] == drafted > 0
    assert 0.0 <= spec["acceptance_rate"] <= 1.0
    # The steps by k the policy chose (the per-k counter, by its k label), as shares of the run's steps.
    steps = [after[f"pdserve:spec_decode_num_steps_by_k_total[{k}]"]
             - before.get(f"pdserve:spec_decode_num_steps_by_k_total[{k}]", 0.0) for k in range(len(spec["chosen_k"]))]
    assert sum(steps) > 0 and spec["chosen_k"] == pytest.approx([n / sum(steps) for n in steps])

    ttft_sum, ttft_count = histogram_delta(before, after, "time_to_first_token_seconds")
    itl_sum, itl_count = histogram_delta(before, after, "inter_token_latency_seconds")
    e2e_sum, e2e_count = histogram_delta(before, after, "e2e_request_latency_seconds")
    assert ttft_count == e2e_count == NUM_PROMPTS
    client_gaps = sum(len(x) for x in result["itls"])
    assert client_gaps == itl_count, "client and server count different chunks: the ITL definitions differ"

    server = {"ttft": ttft_sum / ttft_count * 1000, "itl": itl_sum / itl_count * 1000,
              "tpot": (e2e_sum - ttft_sum) / e2e_count / (OUTPUT_LEN - 1) * 1000}
    client = {k: result[f"mean_{k}_ms"] for k in server}
    logger.info("means (ms), bench vs server /metrics: %s",
                {k: (round(client[k], 2), round(server[k], 2)) for k in server})
    for key in server:
        assert client[key] == pytest.approx(server[key], rel=0.10), (
            f"mean {key}: bench {client[key]:.2f} ms vs server /metrics {server[key]:.2f} ms (client {client}, "
            f"server {server})")


def test_bench_against_a_dead_endpoint_fails_fast(tmp_path):
    """Every request has a client-side limit and a clear error; the command exits non-zero."""
    from pd_harness import free_port

    port = free_port()  # nothing listens here
    argv = [sys.executable, "-m", "server.cli", "bench", "--port", str(port), "--model", "m",
            "--tokenizer", str(tmp_path), "--dataset-name", "sharegpt", "--dataset-path", str(tmp_path / "sg.json"),
            "--num-prompts", "2", "--skip-initial-test", "--disable-tqdm", "--metrics-url", "none"]
    sharegpt = [{"conversations": [{"from": "human", "value": "tell me about python lists " * 3},
                                   {"from": "gpt", "value": "lists are mutable sequences " * 3}]}] * 3
    (tmp_path / "sg.json").write_text(json.dumps(sharegpt))
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Failed requests:                         2" in proc.stdout
    assert "ConnectError" in proc.stdout
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)


def test_metric_definitions_match_vllm_on_synthetic_requests():
    """TPOT per request, ITL pooled, goodput against every SLO, throughputs over the duration."""
    from benchmarks.bench_serving import RequestResult, SampleRequest, calculate_metrics, spec_decode_stats

    reqs = [SampleRequest([1] * 10, 10, 5), SampleRequest([1] * 20, 20, 3), SampleRequest([1] * 5, 5, 1)]
    outs = [RequestResult(success=True, prompt_len=10, output_tokens=5, ttft=0.1, latency=0.5, itl=[0.1] * 4),
            RequestResult(success=True, prompt_len=20, output_tokens=3, ttft=0.3, latency=0.5, itl=[0.1, 0.1]),
            RequestResult(success=False, error="boom", prompt_len=5)]
    r = calculate_metrics(reqs, outs, duration=2.0, percentiles=[50, 99], goodput={"ttft": 200, "tpot": 150})
    assert r["completed"] == 2 and r["failed"] == 1
    assert r["total_input_tokens"] == 30 and r["total_output_tokens"] == 8
    assert r["mean_tpot_ms"] == pytest.approx(((0.4 / 4) + (0.2 / 2)) / 2 * 1000)
    assert r["mean_itl_ms"] == pytest.approx(100.0) and r["median_ttft_ms"] == pytest.approx(200.0)
    assert r["request_throughput"] == 1.0 and r["output_throughput"] == 4.0 and r["total_token_throughput"] == 19.0
    assert r["request_goodput"] == 0.5  # the second request misses the 200 ms TTFT SLO
    before = {"pdserve:spec_decode_num_accepted_tokens_total": 10, "pdserve:spec_decode_num_draft_tokens_total": 40,
              "pdserve:spec_decode_num_drafts_total": 20}
    after = {"pdserve:spec_decode_num_accepted_tokens_total": 40, "pdserve:spec_decode_num_draft_tokens_total": 100,
             "pdserve:spec_decode_num_drafts_total": 50}
    spec = spec_decode_stats(before, after)
    assert spec["acceptance_rate"] == pytest.approx(0.5) and spec["acceptance_length"] == pytest.approx(2.0)
    assert spec["chosen_k"] is None  # no per-k counter scraped
    text = ('pdserve:spec_decode_num_steps_by_k_total{k="0",role="decode"} 30\n'
            'pdserve:spec_decode_num_steps_by_k_total{role="decode",k="1"} 10\n'
            'pdserve:spec_decode_num_steps_by_k_total{k="0",role="decode",instance="b"} 20\n')
    scraped = {**after, **parse_prometheus(text)}
    assert scraped["pdserve:spec_decode_num_steps_by_k_total"] == 60  # summed over label sets, as before
    assert spec_decode_stats(before, scraped)["chosen_k"] == pytest.approx([50 / 60, 10 / 60])
    no_spec = {"pdserve:time_to_first_token_seconds_sum": 1.0}
    assert spec_decode_stats(no_spec, no_spec) is None  # absent: not reported
