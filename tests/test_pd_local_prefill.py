"""Conditional disaggregation: with the prefill instance queued up, the front end prefills a request
on its decode instance instead (`--local-prefill-above`), and the output is the same as ever."""
from __future__ import annotations

from conftest import random_prompts
from pd_harness import ThreadedEngines, client_for, generate_all, running_client, wait_blocks_free, wait_ready

from engine.config import EngineConfig
from engine.types import SamplingParams

VOCAB = 384


def test_prefill_on_decode_when_prefill_is_queued(mtp_checkpoints, references, tmp_path):
    """16 prompts at once against a threshold of 64 queued tokens: some go to D whole (counted), the
    rest through P; greedy output equals transformers either way (MTP on both), no block leaks."""
    model = str(mtp_checkpoints["qwen2"])
    engines = ThreadedEngines(tmp_path)
    common = dict(model=model, max_model_len=256, num_threads=1, block_size=16, speculative_method="mtp",
                  num_speculative_tokens=2, max_num_batched_tokens=64)
    engines.add("prefill", "prefill-0", EngineConfig(**common))
    engines.add("decode", "decode-0", EngineConfig(**common))
    engines.start()
    client = client_for(engines.server_addr, model, "pd", 256, local_prefill_above=64)
    prompts = random_prompts(16, 30, 90, VOCAB, 7)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    try:
        with running_client(client) as run:
            run(wait_ready(client))
            results = run(generate_all(client, prompts, params, concurrency=16))
            for i, (prompt, res) in enumerate(zip(prompts, results)):
                assert res["error"] is None, res
                references["qwen2"].assert_matches(prompt, res["tokens"], 24, f"prompt {i}")
            local = client.counters()["requests_prefilled_on_decode_total"]
            assert 0 < local < len(prompts), f"{local} of {len(prompts)} prefilled on the decode instance"
            run(wait_blocks_free(client))
    finally:
        engines.stop()


def test_off_when_threshold_is_zero(checkpoints, tmp_path):
    model = str(checkpoints["qwen2"])
    engines = ThreadedEngines(tmp_path)
    common = dict(model=model, max_model_len=256, num_threads=1, block_size=16)
    engines.add("prefill", "prefill-0", EngineConfig(**common))
    engines.add("decode", "decode-0", EngineConfig(**common))
    engines.start()
    client = client_for(engines.server_addr, model, "pd", 256, local_prefill_above=0)
    try:
        with running_client(client) as run:
            run(wait_ready(client))
            results = run(generate_all(client, random_prompts(8, 30, 90, VOCAB, 8),
                                       SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), concurrency=8))
            assert all(r["error"] is None for r in results)
            assert client.counters()["requests_prefilled_on_decode_total"] == 0
    finally:
        engines.stop()


def test_a_request_starts_where_less_prefill_is_ahead_of_it():
    """The routing rule on its own: past the threshold, D takes a fresh request whenever it has less
    prefill queued than P (a long prompt arriving just behind another on P starts on D at once
    instead of waiting a whole prefill); never a resume, and never below the threshold."""
    import asyncio
    from types import SimpleNamespace

    from engine.types import EngineRole
    from server.engine_router import Instance
    from server.pd_client import Attempt, RemoteEngineClient, Tracked

    params = SamplingParams(max_tokens=4)
    p, d = Instance("p", EngineRole.PREFILL), Instance("d", EngineRole.DECODE)
    # P holds one prompt of 1400 tokens that has not streamed yet; D holds nothing.
    router = SimpleNamespace(local_prefill_above=1024,
                             tracked={"p0": Tracked("p0", [0] * 1400, params, asyncio.Queue(), Attempt(prefill="p"))})
    p.outstanding.add("p0")
    router._queued_prefill_tokens = lambda inst: RemoteEngineClient._queued_prefill_tokens(router, inst)

    def on_decode(prompt_len: int, streamed: list[int] | None = None) -> bool:
        tracked = Tracked("new", [0] * prompt_len, params, asyncio.Queue(), streamed=streamed or [])
        return RemoteEngineClient._prefill_on_decode(router, tracked, p, d)

    assert on_decode(1500)                   # D's 0 queued < P's 1400, though 0 + 1500 > 1400
    assert not on_decode(1500, streamed=[7])  # a resume keeps the handoff path
    router.local_prefill_above = 2048
    assert not on_decode(1500)               # P's queue is below the threshold
    router.local_prefill_above = 1024
    router.tracked["d0"] = Tracked("d0", [0] * 1400, params, asyncio.Queue(), Attempt(prefill="d"))
    d.outstanding.add("d0")
    assert not on_decode(1500)               # D holds as much as P: P, as without the rule
