"""The CUDA path (`device="cuda"`): Triton kernels live, greedy output still equals transformers.

Skipped where there is no GPU (CI never has one); run by scripts/gpu_check.sh on a GPU machine.
"""
from __future__ import annotations

import pytest
import torch
from conftest import random_prompts

from engine import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
NEW = 32


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("engine_args", [
    dict(block_size=4, max_num_batched_tokens=48),                       # chunked prefill
    dict(block_size=4, num_kv_blocks=140, max_num_batched_tokens=512),   # preemption
    dict(max_num_seqs=2, speculative_method="mtp", num_speculative_tokens=3),
], ids=["chunked", "preempt", "mtp-slots2"])
def test_cuda_greedy_matches_transformers(arch, engine_args, checkpoints, mtp_checkpoints, references):
    from worker import kernels

    model = mtp_checkpoints[arch] if engine_args.get("speculative_method") else checkpoints[arch]
    prompts = random_prompts(24, 1, 300, 384, 91)
    llm = LLM(str(model), device="cuda", max_model_len=400, **engine_args)
    assert kernels.select_backend(llm.engine.runner.states.all_token_ids) == "triton"
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
    exact = sum(references[arch].assert_matches(p, o.token_ids, NEW, f"cuda/{arch}/{i}")
                for i, (p, o) in enumerate(zip(prompts, outs)))
    assert exact >= len(prompts) - 2
    stats = llm.engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total


def test_cuda_bf16_and_sampling(checkpoints):
    llm = LLM(str(checkpoints["qwen2"]), device="cuda", dtype="bfloat16", max_model_len=256)
    prompts = random_prompts(8, 5, 100, 384, 92)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
    a = llm.generate(prompts, seeded)
    b = llm.generate(prompts[:1], seeded)
    assert a[0].token_ids == b[0].token_ids and all(len(o.token_ids) == 16 for o in a)


def test_cuda_compiled_forward_and_triton_attention(checkpoints, references):
    """On CUDA the model is compiled by default and attention runs the Triton paged kernel."""
    from worker.attention import default_backend

    assert default_backend(torch.device("cuda")) == "triton"
    llm = LLM(str(checkpoints["qwen2"]), device="cuda", max_model_len=400, block_size=4, max_num_batched_tokens=64)
    assert llm.engine.runner.forward.compiled is not None
    prompts = random_prompts(16, 1, 300, 384, 93)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
    exact = sum(references["qwen2"].assert_matches(p, o.token_ids, NEW, f"cuda-compiled/{i}")
                for i, (p, o) in enumerate(zip(prompts, outs)))
    assert exact >= len(prompts) - 2
    assert llm.engine.runner.forward.num_graphs <= 2
