"""Narrow weights (issue 46, item 3): `--quantization int8` (weight-only, per output channel) and
`--dtype bfloat16` on a CPU (bf16 weights, fp32 arithmetic and KV cache).

The exactness contract: greedy output equals transformers in fp32 on the weights the engine
computes with -- for int8 the checkpoint's decoder-layer linears quantized and dequantized again,
for bf16 every checkpoint tensor rounded to bf16 -- token for token, but for a first difference
at a float-noise tie of the reference's logits (conftest.Reference.assert_matches).
"""
from __future__ import annotations

import argparse
import json
import os

import pytest
import torch
from conftest import Reference, random_prompts
from test_pd import pd_outputs

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from worker.models.linear import (
    NARROW_MAX_ROWS,
    WIDEN_BLOCK,
    Linear,
    bf16_linear_available,
    dequantize_int8,
    linear_kernels_available,
    quantize_int8,
)

VOCAB = 384
NEW = 24
WEIGHTS = {"int8": dict(quantization="int8"), "bf16": dict(dtype="bfloat16")}
ALL_WEIGHTS = {**WEIGHTS, "int8+bf16": dict(quantization="int8", dtype="bfloat16")}  # (bf16-rounded, then quantized)


class NarrowReference(Reference):
    """transformers fp32 on the weights an engine with narrow weights holds."""

    def __init__(self, model_dir, weights: str) -> None:
        super().__init__(model_dir)
        self.plain = Reference(model_dir)
        with torch.no_grad():
            if "bf16" in weights:
                for p in self.model.parameters():
                    p.copy_(p.to(torch.bfloat16))
            if "int8" in weights:  # every linear of the decoder layers; lm_head and the embedding stay as they are
                for m in self.model.model.layers.modules():
                    if isinstance(m, torch.nn.Linear):
                        m.weight.copy_(dequantize_int8(*quantize_int8(m.weight)))

    def differs_from_plain(self, prompt: list[int]) -> bool:
        """The narrowing changed the logits beyond float noise (the test compares against something)."""
        ours, plain = self.generate(prompt, NEW)[1], self.plain.generate(prompt, NEW)[1]
        return bool((ours[0] - plain[0]).abs().max() > 1e-4)


@pytest.fixture(scope="module")
def narrow_references(checkpoints):
    made: dict[tuple[str, str], NarrowReference] = {}

    def get(arch: str, weights: str) -> NarrowReference:
        if (arch, weights) not in made:
            made[arch, weights] = NarrowReference(checkpoints[arch], weights)
        return made[arch, weights]

    return get


def test_quantize_int8_per_output_channel():
    w = torch.randn(40, 70) * torch.linspace(0.01, 3, 40)[:, None]
    w[3] = 0  # an all-zero row stays zero
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (40,) and scale.dtype == torch.float32
    assert int(q.abs().max()) == 127 and torch.all(q[3] == 0)
    assert torch.all(q.abs().amax(1)[torch.arange(40) != 3] == 127)  # each row's largest weight maps to +-127
    err = (dequantize_int8(q, scale) - w).abs()
    assert torch.all(err <= scale[:, None] / 2 * (1 + 1e-5))


@pytest.mark.skipif(not linear_kernels_available(), reason="the C++ int8 kernel cannot be built here")
@pytest.mark.parametrize("shape", [(64, 128), (37, 13), (300, 33), (64, WIDEN_BLOCK * 2 + 5)])
@pytest.mark.parametrize("way", ["kernel", "widen"])
def test_int8_kernel_matches_the_dequantized_weight(shape, way):
    """Every row count a step can bring (the kernel up to NARROW_MAX_ROWS, the weight widened block
    by block above, or widened at every count where the kernel is not built), odd widths (the SIMD
    tails), several widening blocks and a part one, a bias: within rounding of F.linear on q * scale."""
    torch.manual_seed(0)
    lin = Linear(*shape, bias=True)
    weight = dequantize_int8(*quantize_int8(lin.weight))
    lin.quantize_int8()
    assert lin.int8_way == "kernel" and lin.weight.numel() == 0
    lin.int8_way = way
    for rows in (1, 2, 3, 4, 5, 7, 16, 33, NARROW_MAX_ROWS, NARROW_MAX_ROWS + 1):
        x = torch.randn(rows, shape[0])
        with torch.inference_mode():
            got, want = lin(x), torch.nn.functional.linear(x, weight, lin.bias)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(64, 128), (37, 13), (64, WIDEN_BLOCK + 3)])
def test_bf16_stored_linear_computes_in_fp32(shape):
    """store_bf16: few rows through the bf16 kernel, many through oneDNN on the weight widened block
    by block; both within rounding of fp32 F.linear on the bf16-rounded weight, and fp32 out."""
    torch.manual_seed(0)
    lin = Linear(*shape, bias=True)
    with torch.no_grad():
        lin.weight.copy_(lin.weight.to(torch.bfloat16))
    weight = lin.weight.detach().clone()
    lin.store_bf16()
    assert lin.weight.dtype == torch.bfloat16
    for rows in (1, 3, 8, NARROW_MAX_ROWS, NARROW_MAX_ROWS + 1):
        x = torch.randn(rows, shape[0])
        with torch.inference_mode():
            got, want = lin(x), torch.nn.functional.linear(x, weight, lin.bias)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def narrow_model_checks(llm: LLM, weights: str) -> None:
    """What the engine holds: int8 decoder linears, or bf16 ones and lm_head; fp32 activations and KV."""
    runner = llm.engine.runner
    layer_linears = [m for m in runner.model.model.layers.modules() if isinstance(m, Linear)]
    if "int8" in weights:
        assert all(m.int8 is not None and m.weight.numel() == 0 for m in layer_linears)
    if "bf16" in weights:
        stored = [runner.model.lm_head] + [m for m in layer_linears if m.int8 is None]
        assert all(m.weight.dtype == torch.bfloat16 for m in stored)
    assert runner.kv_cache.dtype == torch.float32
    # The tuning record (oneDNN or MKL per fp32 weight shape) never sees a narrow weight.
    record = json.loads(open(os.environ["PDSERVE_LINEAR_TUNING"]).read())
    assert all(key.endswith("float32") for section in record.values() for key in section), record


@pytest.mark.parametrize("weights", list(ALL_WEIGHTS))
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_colocated_greedy_matches_transformers_on_narrow_weights(arch, weights, checkpoints, narrow_references):
    prompts = random_prompts(10, 1, 200, VOCAB, 81)
    ref = narrow_references(arch, weights)
    # (steps of up to 256 rows: both the narrow kernels' row counts and the widened weights' above)
    llm = LLM(str(checkpoints[arch]), max_model_len=400, block_size=4, max_num_batched_tokens=256,
              **ALL_WEIGHTS[weights])
    try:
        narrow_model_checks(llm, weights)
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
    finally:
        llm.shutdown()
    exact = sum(ref.assert_matches(p, o.token_ids, NEW, f"{arch}/{weights}/prompt {i}")
                for i, (p, o) in enumerate(zip(prompts, outs)))
    assert exact >= len(prompts) - 1
    assert any(ref.differs_from_plain(p) for p in prompts)


@pytest.mark.parametrize("spec", ["mtp", "ngram"])
@pytest.mark.parametrize("weights", list(WEIGHTS))
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_speculative_greedy_matches_transformers_on_narrow_weights(arch, weights, spec, checkpoints, mtp_checkpoints,
                                                                   narrow_references):
    """Colocated with MTP (the drafter's fused bf16-weight layer, drafting for a narrow target) or
    n-gram drafts: what the target verifies is the narrow model's greedy choice all the same."""
    prompts = [p * 3 for p in random_prompts(6, 1, 60, VOCAB, 83)]  # repeats give n-gram drafts to propose
    model = str((mtp_checkpoints if spec == "mtp" else checkpoints)[arch])
    llm = LLM(model, max_model_len=400, speculative_method=spec, num_speculative_tokens=2, spec_policy="fixed",
              **WEIGHTS[weights])
    try:
        if spec == "mtp":
            assert llm.engine.runner.model.model.mtp_layers[0].fused is not None or not bf16_linear_available()
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
        drafted = llm.engine.scheduler.spec_stats.num_draft_tokens
    finally:
        llm.shutdown()
    ref = narrow_references(arch, weights)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        ref.assert_matches(p, o.token_ids, NEW, f"{arch}/{weights}/{spec}/prompt {i}")
    assert drafted > 0


@pytest.mark.parametrize("spec", [None, "mtp"])
@pytest.mark.parametrize("weights", list(WEIGHTS))
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_pd_greedy_matches_transformers_on_narrow_weights(arch, weights, spec, checkpoints, mtp_checkpoints,
                                                          narrow_references, tmp_path):
    """Prefill and decode both with narrow weights (the KV that crosses is fp32), with and without
    MTP (the drafter keeps --draft-dtype's precision: its proposals are verified by the target)."""
    prompts = random_prompts(8, 1, 200, VOCAB, 82)
    model = str((mtp_checkpoints if spec else checkpoints)[arch])
    results, cores = pd_outputs(tmp_path, model, prompts, spec=spec, **WEIGHTS[weights])
    ref = narrow_references(arch, weights)
    for i, (p, r) in enumerate(zip(prompts, results)):
        assert r["error"] is None and r["finish_reason"] == "length", r
        ref.assert_matches(p, r["tokens"], NEW, f"{arch}/{weights}/pd{'+mtp' if spec else ''}/prompt {i}")
    assert cores["decode-0"].runner.kv_cache.dtype == torch.float32
    if spec:
        assert sum(cores["decode-0"].runner.spec_policy.chosen_k_counts) > 0


def test_quantization_flag_and_validation(monkeypatch):
    from server.cli import add_engine_flags, engine_config

    monkeypatch.setenv("PDSERVE_QUANTIZATION", "int8")
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert engine_config(parser.parse_args([])).quantization == "int8"
    assert engine_config(parser.parse_args(["--quantization", "none"])).quantization == "none"
    cfg = EngineConfig(quantization="none")
    cfg.validate(_model_cfg())
    assert cfg.quantization is None
    with pytest.raises(ValueError, match="quantization must be int8"):
        EngineConfig(quantization="int4").validate(_model_cfg())
    with pytest.raises(ValueError, match="run eagerly"):
        EngineConfig(quantization="int8", enforce_eager=False).validate(_model_cfg())


def _model_cfg():
    from engine.config import ModelConfig, default_model

    return ModelConfig.from_dir(default_model())
