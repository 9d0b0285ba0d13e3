"""`pdserve serve` end to end over HTTP: PD (2 prefill + 2 decode) == colocated == transformers,
load spread over every instance, per-instance metrics (issue: PD)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import REPO, random_prompts
from pd_harness import free_port, wait_until

from server.procs import start_tied, stop_process_group

NEW = 20


class Served:
    def __init__(self, model: str, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, PDSERVE_LOG_LEVEL="WARNING")
        self.proc = start_tied([sys.executable, "-m", "server.cli", "serve", "--model", model,
                                "--port", str(self.port), *flags], cwd=REPO, env=env,
                               start_new_session=True, stdout=subprocess.DEVNULL)

    def wait_healthy(self, timeout: float = 90) -> None:
        def healthy() -> bool:
            assert self.proc.poll() is None, "pdserve serve exited early"
            try:
                return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        wait_until(healthy, timeout, "pdserve serve to become healthy", interval=0.3)

    def complete(self, prompt: list[int]) -> list[int]:
        body = {"prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        r = httpx.post(f"{self.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=10).text

    def stop(self) -> None:
        stop_process_group(self.proc)


def metric(text: str, name: str, instance: str) -> float:
    m = re.search(rf'^pdserve:{name}{{[^}}]*instance="{instance}"[^}}]*}} (\S+)$', text, re.M)
    assert m, f"pdserve:{name} for {instance} not in /metrics"
    return float(m.group(1))


@pytest.fixture(scope="module")
def http_outputs(checkpoints):
    """64 prompts through `pdserve serve` in PD (2+2, decode max_num_seqs=2) and colocated mode."""
    model = str(checkpoints["qwen3"])
    prompts = random_prompts(64, 1, 300, 384, 95)
    results = {}
    common = ["--max-model-len", "400", "--max-num-seqs", "2", "--block-size", "16"]
    for mode, flags in (("pd", ["--mode", "pd", "--num-prefill", "2", "--num-decode", "2"]),
                        ("colocated", ["--mode", "colocated"])):
        served = Served(model, *common, *flags)
        try:
            served.wait_healthy()
            with ThreadPoolExecutor(8) as pool:  # concurrency 8
                results[mode] = list(pool.map(served.complete, prompts))
            if mode == "pd":  # every block back within 2 s of the last answer (heartbeats are 0.2 s apart)
                names = [f"{r}-{i}" for r in ("prefill", "decode") for i in (0, 1)]
                wait_until(lambda served=served, names=names: all(
                               metric(served.metrics(), "kv_blocks_free", n) == metric(served.metrics(),
                                                                                       "kv_blocks_total", n)
                               for n in names),
                           2.0, "free KV blocks == total on every instance", interval=0.2)
            results[mode + "_metrics"] = served.metrics()
        finally:
            served.stop()
    return prompts, results


def test_http_pd_equals_colocated_equals_transformers(http_outputs, references):
    prompts, results = http_outputs
    for i, (p, a, b) in enumerate(zip(prompts, results["pd"], results["colocated"])):
        assert a == b, f"prompt {i}: PD and colocated differ over HTTP"
        references["qwen3"].assert_matches(p, a, NEW, f"http/pd/prompt {i}")


def test_http_pd_spreads_load_and_exports_instance_metrics(http_outputs):
    _, results = http_outputs
    text = results["pd_metrics"]
    for p in ("prefill-0", "prefill-1"):
        assert metric(text, "kv_transfer_transfers_sent_total", p) > 0, f"{p} never used"
    for d in ("decode-0", "decode-1"):
        assert metric(text, "kv_transfer_transfers_received_total", d) > 0, f"{d} never used"
    for inst in ("prefill-0", "prefill-1", "decode-0", "decode-1"):
        assert metric(text, "kv_blocks_free", inst) == metric(text, "kv_blocks_total", inst) > 0
    assert metric(text, "kv_transfer_bytes_sent_total", "prefill-0") > 0
    assert metric(text, "kv_transfer_latency_seconds_count_total", "decode-0") > 0
