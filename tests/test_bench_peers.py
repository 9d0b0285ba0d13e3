"""benchmarks/bench_peers.py without its peers: the checkpoints it writes, the command lines it builds, its reports."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np
import pytest

from benchmarks import bench_peers, peers_fair, peers_history, peers_llama, peers_load
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


# -- the fair suite (issue 46): checkpoints, llama.cpp command lines, the load tool, the history -----------


def _random_checkpoint_module():
    """scripts/make_random_checkpoint.py, imported by path (scripts/ is not a package)."""
    import importlib.util

    path = Path(bench_peers.REPO) / "scripts" / "make_random_checkpoint.py"
    spec = importlib.util.spec_from_file_location("make_random_checkpoint", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_random_checkpoint_is_a_loadable_qwen3(tmp_path: Path) -> None:
    from transformers import AutoConfig

    mrc = _random_checkpoint_module()
    out = mrc.write_checkpoint(tmp_path / "tiny-qwen3", preset="qwen3-test")
    cfg = AutoConfig.from_pretrained(out)
    assert cfg.model_type == "qwen3" and cfg.num_hidden_layers == 2
    assert (out / "tokenizer.json").read_bytes() == (DEFAULT_MODEL_DIR / "tokenizer.json").read_bytes()
    assert ModelConfig.from_dir(str(out)).num_mtp_layers == 0


def test_qwen3_0_6b_preset_has_the_real_shapes_without_writing_weights(tmp_path: Path) -> None:
    from transformers import AutoConfig

    mrc = _random_checkpoint_module()
    cfg = mrc.checkpoint_config("qwen3-0.6b")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    hf = AutoConfig.from_pretrained(tmp_path)
    assert (hf.model_type, hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers) == ("qwen3", 1024, 3072, 28)
    assert (hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim) == (16, 8, 128)
    assert hf.tie_word_embeddings and hf.vocab_size == ModelConfig.from_dir(str(DEFAULT_MODEL_DIR)).vocab_size
    shapes = mrc.checkpoint_shapes(cfg, mtp=False)
    assert shapes["model.layers.27.self_attn.k_proj.weight"] == (8 * 128, 1024)
    params = sum(int(np.prod(s)) for s in shapes.values())
    assert 0.4e9 < params < 0.6e9  # the 0.6B model's body with the bundled (small) vocabulary: 0.5B-class
    # What the fair suite sizes vLLM's KV cache by: 28 layers x 8 KV heads x 128 x (K, V) x fp32.
    assert peers_fair.kv_bytes_per_token(tmp_path) == 28 * 8 * 128 * 2 * 4


def test_gguf_conversion_command_line(tmp_path: Path) -> None:
    prefix = tmp_path / "llama.cpp"
    argv = peers_llama.convert_argv(prefix, tmp_path / "ckpt", "q8_0", tmp_path / "out.gguf", "qwen2")
    assert argv[0] == str(prefix / "gguf-venv" / "bin" / "python")  # the converter's own venv
    assert argv[1].endswith("benchmarks/peers_gguf.py") and argv[2:4] == ["--pre-tokenizer", "qwen2"]
    assert argv[4:] == [str(prefix / "src" / "convert_hf_to_gguf.py"), str(tmp_path / "ckpt"),
                        "--outtype", "q8_0", "--outfile", str(tmp_path / "out.gguf")]
    plain = peers_llama.convert_argv(prefix, tmp_path / "ckpt", "f32", tmp_path / "f.gguf", None)
    assert "--pre-tokenizer" not in plain and plain[plain.index("--outtype") + 1] == "f32"


def test_llama_server_command_line(tmp_path: Path) -> None:
    argv = peers_llama.server_argv(tmp_path, tmp_path / "m.gguf", parallel=8, threads=2, ctx_per_slot=2048,
                                   batch=2048, alias="qwen3-0.6b-random")
    flag = {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("-")}
    assert argv[0] == str(tmp_path / "bin" / "llama-server")
    assert flag["--host"] == "127.0.0.1" and "0.0.0.0" not in argv and "--port" not in argv  # the caller's free port
    assert flag["--parallel"] == "8" and flag["-c"] == str(8 * 2048)  # each slot holds a full request
    assert flag["-t"] == "2" and flag["-tb"] == "2" and "-cb" in argv and flag["-m"] == str(tmp_path / "m.gguf")


def test_bundled_tokenizer_splits_like_qwen2() -> None:
    """The converter fallback names qwen2 only because the regex is Qwen2's (benchmarks/peers_gguf.py)."""
    from benchmarks import peers_gguf

    assert peers_gguf.split_regexes(DEFAULT_MODEL_DIR) == [peers_gguf.KNOWN_REGEX["qwen2"]]


def test_vllm_scheduler_flags_are_pinned_to_pdserves(tmp_path: Path) -> None:
    from engine.config import EngineConfig

    args = argparse.Namespace(vllm_venv=str(tmp_path), vllm_preload="none", vllm_arg=[], llama_cpp=str(tmp_path))
    ck = peers_fair.Checkpoint("m", DEFAULT_MODEL_DIR, DEFAULT_MODEL_DIR, None)
    default, both = peers_fair.vllm_system(args, ck, False, 16), peers_fair.vllm_system(args, ck, True, 16)
    ours = EngineConfig(model=str(DEFAULT_MODEL_DIR))
    for s in (default, both):
        flag = {a: s.argv[i + 1] for i, a in enumerate(s.argv[:-1]) if a.startswith("--")}
        assert flag["--max-num-seqs"] == str(ours.max_num_seqs)
        assert flag["--max-num-batched-tokens"] == str(ours.max_num_batched_tokens)
        assert flag["--block-size"] == str(peers_fair.VLLM_CPU_BLOCK_SIZE) and "--enable-prefix-caching" in s.argv
        assert flag["--host"] == "127.0.0.1" and s.budget
    assert "OMP_NUM_THREADS" not in default.env and "VLLM_CPU_OMP_THREADS_BIND" not in default.env  # as a user has it
    assert both.env["VLLM_CPU_OMP_THREADS_BIND"] == f"0-{peers_fair.CORES - 1}"
    pd = peers_fair.pdserve_system(ck, "pd")
    assert pd.budget.startswith(f"{peers_fair.CORES} cores; pd: 1 prefill + 1 decode × ")
    assert "--max-num-batched-tokens" in pd.argv
    served = peers_fair.pdserve_system(ck, "default")  # `pdserve serve --model DIR`: no layout flags
    assert "--mode" not in served.argv and "--num-threads" not in served.argv and "thread(s)" in served.budget


def test_vllm_bench_command_and_client_cpu(tmp_path: Path) -> None:
    shape = peers_load.Shape(num_prompts=8, concurrency=2, input_len=200, output_len=64, ratio=0.2, seed=3)
    argv = peers_load.vllm_bench_argv(tmp_path / "python", 4321, "m", tmp_path, shape, tmp_path / "r.json")
    flag = {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("--")}
    assert flag["--base-url"] == "http://127.0.0.1:4321" and flag["--max-concurrency"] == "2"
    assert flag["--random-input-len"] == "200" and flag["--num-prompts"] == "8" and "--ignore-eos" in argv
    # Neither a ready check nor warm-ups of its own: they resend the first measured prompt (a prefix-cache hit).
    assert flag["--ready-check-timeout-sec"] == "0" and flag["--num-warmups"] == "0"
    assert peers_load.cpu_seconds(os.getpid()) > 0
    samples = [(0.0, 1.0), (1.0, 1.5), (2.0, 2.5), (3.0, 2.75)]
    assert peers_load.cpu_over_last(samples, 2.0) == 1.25  # from t=1 to t=3


def test_history_report_shows_the_latest_run_and_the_spread(tmp_path: Path) -> None:
    path = tmp_path / "peers_runs.jsonl"
    systems = {"tiny/vllm": {"title": "vLLM", "side": "vllm", "budget": "2 cores", "command": "v", "env": ""},
               "tiny/vllm-2t": {"title": "vLLM 2t", "side": "vllm", "budget": "2 cores", "command": "v", "env": ""},
               "tiny/llama-f32": {"title": "llama", "side": "llama.cpp", "budget": "-t 2", "command": "l", "env": ""},
               "tiny/pd": {"title": "pdserve PD", "side": "pdserve", "budget": "1+1", "command": "p", "env": ""}}
    wl = {"w": {"title": "W", "describe": "d", "checkpoint": "c", "systems": list(systems)}}
    tps = {"tiny/vllm": 100.0, "tiny/vllm-2t": 150.0, "tiny/llama-f32": 200.0, "tiny/pd": 300.0}
    for i, quick in enumerate((False, False, True)):
        run = {"kind": "run", "run": f"r{i}", "date": "d", "commit": "c", "command": "x", "machine": "m",
               "load_start": "0", "quick": quick, "rounds": 2, "note": "", "versions": {},
               "systems": systems, "workloads": wl}
        peers_history.append(path, run)
        for s, tp in tps.items():
            for rnd, scale in enumerate((1.0, 1.2)):
                m = {"kind": "measurement", "run": f"r{i}", "round": rnd, "workload": "w", "system": s,
                     "tool": "vllm-bench", "output_throughput": tp * scale * (i + 1), "p50_ttft_ms": 10.0,
                     "completed": 4, "failed": 0}
                peers_history.append(path, m)
    history = peers_history.load(path)
    text = peers_history.report(history)
    assert "run `r2`" in text and "Smoke run" in text  # the latest run, whatever it is
    # pdserve PD, run r2: median of 900 and 1080 = 990; best vLLM 2t: 150 x 3 x 1.1 = 495; llama 660.
    assert "| pdserve PD | 1+1 | 990.0 | 2.00× | 1.50× |" in text
    assert "| W | 990.0 (pdserve PD) | 495.0 (2.00×) | 660.0 (1.50×) |" in text  # each side's best
    assert "990.0–990.0 (1)" in text  # the smoke run's spread has only smoke runs in it
    full = peers_history.report([r for r in history if r["run"] != "r2"])
    assert "330.0–660.0 (2)" in full and "Smoke run" not in full


def test_report_keeps_each_workloads_latest_run(tmp_path: Path) -> None:
    """A run of some workloads only (e.g. --checkpoints tiny) leaves the others' latest run in the report."""
    path = tmp_path / "peers_runs.jsonl"
    pd = {"tiny/pd": {"title": "pdserve PD", "side": "pdserve", "budget": "1+1", "command": "p", "env": ""}}
    for run_id, wl_key in (("r0", "a"), ("r1", "b")):
        peers_history.append(path, {"kind": "run", "run": run_id, "date": "d", "commit": "c", "command": "x",
                                    "machine": "m", "load_start": "0", "quick": False, "rounds": 1, "note": "",
                                    "versions": {}, "systems": pd, "workloads": {wl_key: {
                                        "title": f"W{wl_key}", "describe": "d", "checkpoint": "c",
                                        "systems": ["tiny/pd"]}}})
        peers_history.append(path, {"kind": "measurement", "run": run_id, "round": 0, "workload": wl_key,
                                    "system": "tiny/pd", "tool": "vllm-bench", "output_throughput": 42.0,
                                    "p50_ttft_ms": 1.0, "completed": 1, "failed": 0})
    text = peers_history.report(peers_history.load(path))
    assert "## Wa" in text and "## Wb" in text and "From run `r0`" in text and "From run `r1`" not in text
