"""Greedy output == transformers, token for token, under every scheduling mode (issue: core engine)."""
from __future__ import annotations

import random

import pytest
from conftest import random_prompts

from engine import LLM, SamplingParams

NEW_TOKENS = 48
VOCAB = 384


def shared_prefix_prompts(n: int, seed: int) -> list[list[int]]:
    """Groups of prompts that share long prefixes (whole blocks and partial ones), plus duplicates."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(2, VOCAB) for _ in range(k)] for k in (64, 100, 157, 200)]
    prompts = []
    for i in range(n):
        tail = [rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 90))]
        prompts.append(prefixes[i % 4] + (tail if i % 5 else []))
    return prompts


MODES = {
    # name: (engine args, prompt factory)
    "chunked_prefill": (dict(block_size=4, max_num_batched_tokens=48, enable_prefix_caching=False),
                        lambda: random_prompts(32, 1, 300, VOCAB, 1)),
    "preemption": (dict(block_size=4, num_kv_blocks=140, max_num_batched_tokens=512, enable_prefix_caching=True),
                   lambda: random_prompts(32, 1, 300, VOCAB, 2)),
    "prefix_cache": (dict(block_size=4, max_num_batched_tokens=256, enable_prefix_caching=True),
                     lambda: shared_prefix_prompts(32, 3)),
    "slot_reuse": (dict(max_num_seqs=2, block_size=16, max_num_batched_tokens=128),
                   lambda: random_prompts(32, 1, 300, VOCAB, 4)),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_matches_transformers(arch, mode, checkpoints, references):
    engine_args, make_prompts = MODES[mode]
    prompts = make_prompts()
    llm = LLM(str(checkpoints[arch]), max_model_len=400, **engine_args)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    exact = sum(references[arch].assert_matches(p, o.token_ids, NEW_TOKENS, f"{arch}/{mode}/prompt {i}")
                for i, (p, o) in enumerate(zip(prompts, outs)))
    assert exact >= len(prompts) - 2, f"only {exact}/{len(prompts)} exact (ties are allowed, but not this many)"
    assert all(o.finish_reason == "length" for o in outs)

    core = llm.engine
    stats = core.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total, "KV blocks leaked"
    core.step()  # finished slots are released at the start of the next step
    assert not core.runner.states.req_id_to_slot, "slots leaked"
    # Prove each mode really exercised what it is named for.
    if mode == "chunked_prefill":
        assert max(map(len, prompts)) > engine_args["max_num_batched_tokens"]
    if mode == "preemption":
        assert stats.num_preemptions > 0
    if mode == "prefix_cache":
        assert core.block_manager.num_hit_blocks > 50
    llm.shutdown()
