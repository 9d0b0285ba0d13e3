"""benchmarks/bench_peers.py without vLLM: the MTP-free checkpoint copy it gives vLLM, and its report."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from benchmarks import bench_peers
from engine.config import DEFAULT_MODEL_DIR, ModelConfig

pytestmark = pytest.mark.skipif(not (DEFAULT_MODEL_DIR / "model.safetensors").is_file(), reason="no bundled model")


def test_strip_mtp_keeps_every_other_tensor_exactly(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    dst = bench_peers.strip_mtp(DEFAULT_MODEL_DIR, tmp_path / "no-mtp")
    before, after = load_file(DEFAULT_MODEL_DIR / "model.safetensors"), load_file(dst / "model.safetensors")
    assert any(k.startswith("model.mtp_layers.") for k in before)
    assert set(after) == {k for k in before if not k.startswith("model.mtp_layers.")}
    for name, tensor in after.items():
        assert tensor.dtype == before[name].dtype and tensor.equal(before[name]), name
    config = json.loads((dst / "config.json").read_text())
    assert "num_nextn_predict_layers" not in config
    assert ModelConfig.from_dir(str(dst)).num_mtp_layers == 0
    assert (dst / "tokenizer.json").read_bytes() == (DEFAULT_MODEL_DIR / "tokenizer.json").read_bytes()


def test_offline_prompts_are_deterministic_vocabulary_ids() -> None:
    wl = bench_peers.Offline("t", 8, 4)
    a, b = bench_peers.offline_prompts(DEFAULT_MODEL_DIR, wl, 0), bench_peers.offline_prompts(DEFAULT_MODEL_DIR, wl, 0)
    vocab = ModelConfig.from_dir(str(DEFAULT_MODEL_DIR)).vocab_size
    assert a == b and len(a) == 8
    assert all(0 <= t < vocab for p in a for t in p)
    assert bench_peers.offline_prompts(DEFAULT_MODEL_DIR, wl, 1) != a


def test_report_has_medians_ratios_and_targets(tmp_path: Path) -> None:
    offline, online = bench_peers.workloads(quick=True)
    serving = {"output_throughput": 100.0, "p50_itl_ms": 10.0, "p99_itl_ms": 20.0, "p50_ttft_ms": 50.0,
               "p99_ttft_ms": 80.0, "mean_tpot_ms": 10.0, "completed": 16, "failed": 0}
    raw = {"offline": {"vllm": {wl.name: [{"output_tok_s": 100.0}] for wl in offline},
                       "pdserve": {wl.name: [{"output_tok_s": 150.0}, {"output_tok_s": 130.0}] for wl in offline}},
           "online": {part: {"vllm": [serving], "pd": [dict(serving, output_throughput=120.0)],
                             "colocated": [{"completed": 0, "failed": 0, "error": "boom"}]} for part in online}}
    summary = bench_peers.summarize(raw)
    assert summary["offline"]["pdserve"][offline[0].name] == 140.0
    assert summary["online"]["serving"]["pd"]["output_throughput"] == 120.0
    args = argparse.Namespace(vllm_venv=str(tmp_path), vllm_preload="none", vllm_kv_gib=1, vllm_omp_bind="auto",
                              max_num_seqs=64, vllm_arg=[])
    titles = {k: s.title for k, s in bench_peers.systems(args, tmp_path, tmp_path).items()}
    meta = {k: "x" for k in ("command", "date", "commit", "machine", "load_start", "load_end", "vllm_version",
                             "vllm_torch", "pdserve_torch", "model", "vllm_flags", "vllm_env", "pdserve_flags")}
    text = bench_peers.markdown(summary, meta | {"rounds": 1, "quick": True}, offline, online, titles)
    assert "| 16 × 16 | 100 | 140 | 1.40× |" in text
    assert "| pdserve PD, no spec | 120.0 | 1.20× |" in text
    assert "pdserve colocated, no spec | failed" in text
    assert "| offline 16x16: pdserve / vLLM ≥ 1.2× | 1.40× | yes |" in text
