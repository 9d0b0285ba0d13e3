"""The compiled model (torch.compile with dynamic shapes; the default on CUDA, `--no-enforce-eager`
elsewhere) is as exact as the eager one: Llama, Mistral with a sliding window, Qwen2 and Qwen3;
colocated (with chunked prefill and prefix-cache hits), PD and PD+MTP; and a server's mix of
batch sizes and lengths compiles a bounded number of graphs."""
from __future__ import annotations

import pytest
import torch
from conftest import Reference, random_prompts
from pd_harness import ThreadedEngines, client_for, generate_all, running_client, wait_blocks_free, wait_ready

from engine import LLM
from engine.config import EngineConfig
from engine.types import SamplingParams

VOCAB = 384
NEW = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def mistral_window(tmp_path_factory):
    import transformers

    path = tmp_path_factory.mktemp("mistral-window")
    cfg = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                     initializer_range=0.08, sliding_window=40, eos_token_id=1)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path, Reference(path)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_compiled_greedy_matches_transformers(arch, checkpoints, references, mistral_window):
    model, ref = mistral_window if arch == "mistral" else (checkpoints[arch], references[arch])
    shared = random_prompts(1, 60, 60, VOCAB, 91)[0]
    prompts = random_prompts(10, 1, 150, VOCAB, 90) + [shared + p for p in random_prompts(3, 1, 20, VOCAB, 92)]
    llm = LLM(str(model), max_model_len=256, block_size=4, max_num_batched_tokens=64, enforce_eager=False)
    outs = llm.generate(prompts, GREEDY)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        ref.assert_matches(p, o.token_ids, NEW, f"compiled/{arch}/prompt {i}")
    forward = llm.engine.runner.forward
    assert forward.compiled is not None
    assert forward.num_graphs <= 2, f"{forward.num_graphs} graphs: shapes are recompiling"
    assert llm.engine.block_manager.num_hit_blocks > 0  # the shared prefix was served from the cache
    llm.shutdown()


@pytest.mark.parametrize("spec", [None, "mtp"])
def test_compiled_pd_matches_transformers(spec, checkpoints, mtp_checkpoints, references, tmp_path):
    model = str((mtp_checkpoints if spec else checkpoints)["qwen2"])
    prompts = random_prompts(12, 1, 200, VOCAB, 93)
    common = dict(model=model, max_model_len=400, num_threads=1, speculative_method=spec, enforce_eager=False)
    engines = ThreadedEngines(tmp_path)
    engines.add("prefill", "prefill-0", EngineConfig(**{**common, "num_speculative_tokens": 1}))
    engines.add("decode", "decode-0", EngineConfig(**common, max_num_seqs=4))
    engines.start()
    client = client_for(engines.server_addr, model, "pd", 400)
    try:
        with running_client(client) as run:
            run(wait_ready(client, timeout=300))
            results = run(generate_all(client, prompts, GREEDY, concurrency=6), timeout=600)
            run(wait_blocks_free(client))
        for i, (p, r) in enumerate(zip(prompts, results)):
            assert r["error"] is None, r
            references["qwen2"].assert_matches(p, r["tokens"], NEW, f"compiled pd/{spec}/prompt {i}")
        assert all(e.core.runner.forward.num_graphs <= 2 for e in engines.procs.values())
    finally:
        engines.stop()
