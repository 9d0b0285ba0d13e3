"""Prefill/decode disaggregation: exactness against transformers, the stale-slot regression (issue: PD)."""
from __future__ import annotations

import pytest
from conftest import random_prompts
from pd_harness import ThreadedEngines, client_for, generate_all, running_client, wait_blocks_free, wait_ready

from engine.config import EngineConfig, KVTransferConfig
from engine.types import SamplingParams
from worker.states import RequestStates

VOCAB = 384
NEW = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


def pd_outputs(tmp_path, model: str, prompts, params=GREEDY, decode_kwargs=None, prefill_kwargs=None, spec=None,
               colocated=False, prefill_kv=None, **common_kwargs):
    engines = ThreadedEngines(tmp_path)
    common = dict(model=model, max_model_len=400, num_threads=1, speculative_method=spec, **common_kwargs)
    if colocated:
        engines.add("colocated", "colocated-0", EngineConfig(**common, max_num_seqs=8))
        mode = "colocated"
    else:
        prefill_common = {**common, "speculative_method": spec, "num_speculative_tokens": 1}
        engines.add("prefill", "prefill-0", EngineConfig(**prefill_common, max_num_batched_tokens=128,
                                                         **(prefill_kwargs or {})), prefill_kv)
        engines.add("decode", "decode-0", EngineConfig(**common, **{"max_num_seqs": 2, **(decode_kwargs or {})}))
        mode = "pd"
    engines.start()
    client = client_for(engines.server_addr, model, mode, 400)
    try:
        with running_client(client) as run:
            run(wait_ready(client))
            results = run(generate_all(client, prompts, params, concurrency=8))
            run(wait_blocks_free(client))
            return results, {name: p.core for name, p in engines.procs.items()}
    finally:
        engines.stop()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_pd_equals_colocated_equals_transformers(arch, checkpoints, references, tmp_path):
    prompts = random_prompts(64, 1, 300, VOCAB, 71)
    model = str(checkpoints[arch])
    pd, _ = pd_outputs(tmp_path, model, prompts)
    colo, _ = pd_outputs(tmp_path, model, prompts, colocated=True)
    for i, (p, a, b) in enumerate(zip(prompts, pd, colo)):
        assert a["error"] is None and a["finish_reason"] == "length", a
        assert a["tokens"] == b["tokens"], f"prompt {i}: PD and colocated differ"
        references[arch].assert_matches(p, a["tokens"], NEW, f"{arch}/pd/prompt {i}")


def test_pd_with_preemption_forced_on_decode(checkpoints, references, tmp_path):
    prompts = random_prompts(24, 100, 300, VOCAB, 72)
    results, cores = pd_outputs(tmp_path, str(checkpoints["qwen2"]), prompts,
                                decode_kwargs=dict(num_kv_blocks=26, block_size=16))
    assert cores["decode-0"].stats().num_preemptions > 0
    for i, (p, r) in enumerate(zip(prompts, results)):
        assert r["error"] is None
        references["qwen2"].assert_matches(p, r["tokens"], NEW, f"preempt/prompt {i}")


@pytest.mark.parametrize("spec", [None, "mtp"])
def test_stale_slot_regression_under_pd(spec, checkpoints, mtp_checkpoints, references, tmp_path, monkeypatch):
    """The seed bug: decode admits a handed-off request into a reused slot. Without seeding
    last_sampled_token with t0 the first decode step feeds the previous occupant's token."""
    model = str((mtp_checkpoints if spec else checkpoints)["qwen2"])
    prompts = random_prompts(12, 5, 80, VOCAB, 73)
    good, _ = pd_outputs(tmp_path, model, prompts, spec=spec)
    for p, r in zip(prompts, good):
        references["qwen2"].assert_matches(p, r["tokens"], NEW)
    monkeypatch.setenv("PDSERVE_DEBUG_INVARIANTS", "0")  # let the bug through to the output
    monkeypatch.setattr(RequestStates, "seed_last_sampled", lambda self, slot, token: None)
    bad, _ = pd_outputs(tmp_path, model, prompts, spec=spec)
    differing = sum(a["tokens"] != b["tokens"] for a, b in zip(good, bad))
    assert differing >= len(prompts) // 2, f"only {differing} outputs changed without seeding"


def test_pd_with_mtp_equals_transformers(mtp_checkpoints, references, tmp_path):
    prompts = random_prompts(24, 1, 250, VOCAB, 74)
    results, cores = pd_outputs(tmp_path, str(mtp_checkpoints["llama"]), prompts, spec="mtp")
    for i, (p, r) in enumerate(zip(prompts, results)):
        assert r["error"] is None
        references["llama"].assert_matches(p, r["tokens"], NEW, f"pd+mtp/prompt {i}")
    # Prefill hands every request off after t0: it never drafts, nor asks the policy (whose chosen-k
    # counts are the metric); decode does both.
    assert sum(cores["prefill-0"].runner.spec_policy.chosen_k_counts) == 0
    assert sum(cores["decode-0"].runner.spec_policy.chosen_k_counts) > 0


@pytest.mark.parametrize("kv_mode", ["after-prefill", "layerwise"])
def test_decode_drafts_from_the_hidden_states_prefill_hands_over(kv_mode, mtp_checkpoints, tmp_path, monkeypatch):
    """P runs no MTP layer: it hands D the target's hidden states of each prompt's last mtp_window
    positions (with the whole KV, or with the done message of a layer-wise stream), and D's
    drafter runs the layer over them when it first drafts. D's first drafts are then the
    colocated engine's (the same hidden states, the same layer); without them (the handed-over
    states dropped on D) they are not."""
    from worker.spec_decode.mtp import MTPDrafter

    prompts = random_prompts(12, 40, 120, VOCAB, 76)
    model = str(mtp_checkpoints["qwen2"])
    first: dict[tuple[int, ...], list[int]] = {}  # prompt + t0 + t1 -> the drafts proposed after it
    propose = MTPDrafter.propose

    def recording(self, batch, hidden, accepted, k, draft_meta, kv_tap=None):
        drafts = propose(self, batch, hidden, accepted, k, draft_meta, kv_tap)
        for slot, d in zip(batch.slots.tolist(), drafts.token_ids):
            key = tuple(self.states.all_token_ids[slot, : self.states.total_len_np[slot]].tolist())
            if d and any(len(key) == len(p) + 2 and list(key[: len(p)]) == p for p in prompts):
                first[key] = d
        return drafts

    monkeypatch.setattr(MTPDrafter, "propose", recording)

    def first_drafts(**kwargs) -> dict[tuple[int, ...], list[int]]:
        first.clear()
        kv = None if kwargs.get("colocated") else KVTransferConfig(mode=kv_mode, layerwise_min_tokens=0)
        results, _ = pd_outputs(tmp_path, model, prompts, spec="mtp", spec_policy="fixed", prefill_kv=kv, **kwargs)
        assert all(r["error"] is None for r in results)
        assert len(first) == len(prompts)
        return dict(first)

    colocated = first_drafts(colocated=True)
    pd = first_drafts()
    assert sum(pd[key] == colocated[key] for key in colocated) >= len(prompts) - 1
    monkeypatch.setattr(MTPDrafter, "seed_from_handoff", lambda self, slot, num_computed, hidden: None)
    monkeypatch.setenv("PDSERVE_DEBUG_INVARIANTS", "0")
    dropped = first_drafts()
    assert sum(dropped[key] == colocated[key] for key in colocated) <= len(prompts) // 2


def test_request_finished_by_t0_on_prefill_releases_decode_reservation(checkpoints, references, tmp_path):
    """max_tokens=1, or t0 is a stop token: P finishes the request itself and D's blocks come back."""
    prompts = random_prompts(6, 5, 100, VOCAB, 75)
    results, _ = pd_outputs(tmp_path, str(checkpoints["qwen2"]), prompts,
                            params=SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    for p, r in zip(prompts, results):
        assert r["finish_reason"] == "length" and r["tokens"] == references["qwen2"].generate(p, NEW)[0][:1]
    t0 = references["qwen2"].generate(prompts[0], NEW)[0][0]
    results, _ = pd_outputs(tmp_path, str(checkpoints["qwen2"]), prompts[:1],
                            params=SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[t0]))
    assert results[0]["finish_reason"] == "stop" and results[0]["tokens"] == [t0]
