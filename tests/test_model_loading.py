"""Checkpoint loading: sharded files, unused keys, missing keys, dtypes (issue: core engine)."""
from __future__ import annotations

import json
import logging

import pytest
import torch
from conftest import make_checkpoint, random_prompts
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_sharded_checkpoint_loads(tmp_path, references):
    src = references["llama"].model
    src.save_pretrained(tmp_path, max_shard_size="60KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    prompts = random_prompts(4, 3, 40, 384, 51)
    llm = LLM(str(tmp_path), max_model_len=128)
    for p, o in zip(prompts, llm.generate(prompts, GREEDY)):
        references["llama"].assert_matches(p, o.token_ids, 12)


def test_unused_keys_ignored_with_one_log_line_and_missing_key_named(tmp_path, caplog):
    ckpt = make_checkpoint("qwen2", tmp_path / "m")
    weights = load_file(ckpt / "model.safetensors")
    extra = dict(weights)
    extra["model.mtp_layers.0.input_proj.weight"] = torch.zeros(64, 128)
    extra["model.mtp_layers.0.final_layernorm.weight"] = torch.ones(64)
    save_file(extra, ckpt / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="worker.model_loader"):
        LLM(str(ckpt), max_model_len=64).shutdown()
    lines = [r.getMessage() for r in caplog.records if "ignoring" in r.getMessage()]
    assert len(lines) == 1 and "2 checkpoint keys" in lines[0] and "mtp_layers" in lines[0]

    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, ckpt / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing key 'model.layers.1.mlp.up_proj.weight'"):
        LLM(str(ckpt), max_model_len=64)


def test_rope_theta_read_from_top_level_and_rope_parameters(tmp_path, references):
    """transformers 5 writes rope_parameters; older checkpoints carry top-level rope_theta."""
    import shutil

    src = references["qwen2"].model
    src.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    theta = cfg.pop("rope_parameters")["rope_theta"]
    cfg["rope_theta"] = theta
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    prompts = random_prompts(3, 50, 120, 384, 52)
    llm = LLM(str(tmp_path), max_model_len=256)
    for p, o in zip(prompts, llm.generate(prompts, GREEDY)):
        references["qwen2"].assert_matches(p, o.token_ids, 12)
    shutil.rmtree(tmp_path)


def test_bfloat16_runs_and_mostly_agrees(checkpoints, references):
    prompts = random_prompts(6, 5, 60, 384, 53)
    llm = LLM(str(checkpoints["qwen3"]), max_model_len=128, dtype="bfloat16")
    assert llm.engine.runner.model.lm_head.weight.dtype == torch.bfloat16
    outs = llm.generate(prompts, GREEDY)
    first_agree = sum(o.token_ids[0] == references["qwen3"].generate(p, 12)[0][0] for p, o in zip(prompts, outs))
    assert all(len(o.token_ids) == 12 for o in outs) and first_agree >= 4


@pytest.mark.parametrize("sliding_window", [None, 40])
def test_mistral_with_and_without_sliding_window(tmp_path, sliding_window):
    import transformers
    from conftest import Reference

    cfg = transformers.MistralConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                     initializer_range=0.08, sliding_window=sliding_window, eos_token_id=1)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    ref = Reference(tmp_path)
    prompts = random_prompts(6, 20, 120, 384, 54)  # longer than the window
    llm = LLM(str(tmp_path), max_model_len=256, block_size=4, max_num_batched_tokens=32)
    for i, (p, o) in enumerate(zip(prompts, llm.generate(prompts, GREEDY))):
        ref.assert_matches(p, o.token_ids, 12, f"mistral/window={sliding_window}/{i}")


def test_stacked_projections_take_each_checkpoint_tensor(checkpoints):
    """q/k/v and gate/up are loaded into row slices of one stacked GEMM each (and packed on CPU):
    every layer computes exactly what the separate checkpoint tensors would."""
    path = checkpoints["qwen2"]  # qkv bias too
    weights = load_file(str(path / "model.safetensors"))
    llm = LLM(str(path), max_model_len=64)
    layer = llm.engine.runner.model.model.layers[1]
    assert layer.self_attn.qkv_proj.packed is not None  # CPU fp32: the oneDNN path is the one under test
    pre = "model.layers.1."
    x = torch.randn(5, weights[pre + "self_attn.q_proj.weight"].shape[1])
    with torch.inference_mode():
        qkv = layer.self_attn.qkv_proj(x)
        gate_up = layer.mlp.gate_up_proj(x)
    want_qkv = torch.cat([x @ weights[pre + f"self_attn.{n}_proj.weight"].T + weights[pre + f"self_attn.{n}_proj.bias"]
                          for n in "qkv"], dim=-1)
    want_gate_up = torch.cat([x @ weights[pre + f"mlp.{n}_proj.weight"].T for n in ("gate", "up")], dim=-1)
    torch.testing.assert_close(qkv, want_qkv, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gate_up, want_gate_up, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 17])
def test_packed_linear_matches_f_linear(rows):
    from worker.models.linear import Linear

    torch.manual_seed(rows)
    lin = Linear(48, 80, bias=True)
    x = torch.randn(rows, 48)
    with torch.inference_mode():
        want = torch.nn.functional.linear(x, lin.weight, lin.bias)
        lin.pack(keep_weight=False)
        assert lin.weight.numel() == 0  # the packed copy is the only one left
        torch.testing.assert_close(lin(x), want, atol=1e-5, rtol=1e-5)
