"""The MTP drafter inside engines (issue 12): min_tokens inside a verify window, the MTP layer's KV
when drafting resumes, and placement-independent seeded sampling. The policy that decides when
to draft is unit-tested on its own in tests/test_spec_policy.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import random_prompts
from pd_harness import ThreadedEngines, client_for, generate_all, running_client, wait_blocks_free, wait_ready

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.core import EngineCore
from worker.spec_decode.mtp import MTPDrafter

VOCAB = 384


# ----------------------------------------------------------------- min_tokens inside a verify window


def test_min_tokens_ending_inside_the_verify_window(mtp_checkpoints, references, monkeypatch):
    """Drafts that are certain to be accepted (the target's own greedy tokens) over a window in
    which min_tokens ends: the stop token is banned only before min_tokens, so the speculative
    output is the non-speculative one, which is transformers' greedy output up to the stop."""
    model = str(mtp_checkpoints["qwen2"])
    prompt = random_prompts(1, 12, 12, VOCAB, 81)[0]
    ref = references["qwen2"].generate(prompt, 16)[0]
    j = next(i for i in range(2, 5) if ref[i] not in ref[:i])  # stop token first produced at index j
    params = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=j, stop_token_ids=[ref[j]], ignore_eos=True)

    def planted(self, batch, rows, h, last_pos, k, draft_meta):
        st = self.states
        outs = [int(st.total_len_np[s] - st.prompt_len[s]) for s in batch.slots[rows]]
        return [(ref + [2] * 16)[n : n + k] for n in outs], None

    base = LLM(model, max_model_len=64, block_size=4).generate([prompt], params)[0]
    assert base.token_ids == ref[: j + 1] and base.finish_reason == "stop"
    monkeypatch.setattr(MTPDrafter, "_draft", planted)
    llm = LLM(model, max_model_len=64, block_size=4, speculative_method="mtp", num_speculative_tokens=4,
              spec_policy="fixed")
    llm.engine.runner.drafter.fused_chain = False  # every draft through _draft (the C++ chain would bypass it)
    out = llm.generate([prompt], params)[0]
    spec = llm.engine.scheduler.spec_stats
    assert spec.num_draft_tokens and spec.num_accepted_tokens == spec.num_draft_tokens  # all accepted
    assert out.token_ids == base.token_ids and out.finish_reason == "stop"


# ----------------------------------------------------------------- MTP KV when drafting resumes


def drafts_by_position(model: str, prompts, schedule=None, stash_positions: int = 256, monkeypatch=None,
                       window: int = 0) -> dict:
    """Greedy run recording every draft by (request, output index); `schedule(step)` forces k;
    `window`: EngineConfig.mtp_window (0: the MTP layer attends every position)."""
    core = EngineCore(EngineConfig(model=model, max_model_len=160, block_size=4, max_num_seqs=4,
                                   speculative_method="mtp", num_speculative_tokens=2, spec_policy="fixed",
                                   mtp_window=window))
    runner = core.runner
    runner.drafter.stash_positions = stash_positions
    if schedule is not None:
        step = iter(range(10**6))
        runner.spec_policy.choose = lambda b, pending=0, sampled=False: schedule(next(step))
    seen: dict[tuple[str, int], tuple[int, ...]] = {}
    original = MTPDrafter.propose

    flushes = 0

    def recording(self, batch, *args):
        nonlocal flushes
        drafts = original(self, batch, *args)
        flushes += drafts.flushed
        for req_id, slot, d in zip(batch.req_ids, batch.slots, drafts.token_ids):
            if d:
                seen[(req_id, int(self.states.total_len_np[slot]))] = tuple(d[:1])
        return drafts

    monkeypatch.setattr(MTPDrafter, "propose", recording)
    for i, p in enumerate(prompts):
        core.add_request(p, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True), req_id=f"r{i}")
    max_pending = 0
    while core.has_unfinished():
        core.step()
        max_pending = max(max_pending, int(runner.states.mtp_pending.max()))
    monkeypatch.setattr(MTPDrafter, "propose", original)
    return {"drafts": seen, "max_pending": max_pending, "flushes": flushes}


def test_drafts_after_skipped_steps_match_always_drafting(mtp_checkpoints, monkeypatch):
    """Steps without drafting skip the MTP layer and backfill its KV when drafting resumes (or
    when the stash is full): the drafts then equal those of a run that drafted every step."""
    model = str(mtp_checkpoints["llama"])
    prompts = random_prompts(4, 5, 60, VOCAB, 82)
    always = drafts_by_position(model, prompts, monkeypatch=monkeypatch)["drafts"]
    bursty = drafts_by_position(model, prompts, lambda s: 2 if s % 7 in (5, 6) else 0, monkeypatch=monkeypatch)
    flushed = drafts_by_position(model, prompts, lambda s: 2 if s % 11 == 10 else 0, stash_positions=3,
                                 monkeypatch=monkeypatch)
    for run in (bursty, flushed):
        common = set(run["drafts"]) & set(always)
        assert len(common) >= 10 and run["max_pending"] >= 3
        same = sum(run["drafts"][key] == always[key] for key in common)
        assert same >= len(common) - 1, f"{same}/{len(common)} drafts agree"
    assert flushed["max_pending"] <= 3 and flushed["flushes"] > 0


def test_a_windowed_mtp_layer_drops_what_it_will_not_attend(mtp_checkpoints, monkeypatch):
    """mtp_window: the MTP layer attends only the last `window` positions, so a full stash drops its
    oldest positions instead of running the layer over them (no flush), and the drafts equal those of
    a run that drafted every step with the same window (older positions are never attended)."""
    model = str(mtp_checkpoints["llama"])
    prompts = random_prompts(4, 5, 60, VOCAB, 82)
    always = drafts_by_position(model, prompts, monkeypatch=monkeypatch, window=5)["drafts"]
    bursty = drafts_by_position(model, prompts, lambda s: 2 if s % 11 == 10 else 0, stash_positions=7,
                                monkeypatch=monkeypatch, window=5)
    assert bursty["flushes"] == 0 and bursty["max_pending"] == 7
    common = set(bursty["drafts"]) & set(always)
    assert len(common) >= 10
    same = sum(bursty["drafts"][key] == always[key] for key in common)
    assert same >= len(common) - 1, f"{same}/{len(common)} drafts agree"


@pytest.mark.parametrize("window,stash_positions", [(0, 256), (5, 256), (5, 7), (0, 3)])
def test_the_mtp_pass_reads_the_target_hidden_state_of_every_position(mtp_checkpoints, monkeypatch, window,
                                                                      stash_positions):
    """The stash (copies of steady k=0 steps deferred, dropped once out of the window) hands the MTP
    pass exactly the target's hidden state of every position it covers: bitwise, whether the
    position was stashed directly, deferred, compacted or flushed."""

    core = EngineCore(EngineConfig(model=str(mtp_checkpoints["llama"]), max_model_len=160, block_size=4,
                                   max_num_seqs=4, speculative_method="mtp", num_speculative_tokens=2,
                                   spec_policy="fixed", mtp_window=window))
    runner = core.runner
    runner.drafter.stash_positions = stash_positions
    step = iter(range(10**6))
    runner.spec_policy.choose = lambda b, pending=0, sampled=False: 2 if next(step) % 11 == 10 else 0
    target: dict[tuple[int, int], object] = {}  # (first block of the request, position) -> hidden state
    forward = runner.forward

    def recording_forward(input_ids, positions, ctx):
        hidden = forward(input_ids, positions, ctx)
        lay = ctx.layout
        rows = np.repeat(np.arange(len(lay.query_lens)), lay.query_lens)
        for i, (row, pos) in enumerate(zip(rows.tolist(), lay.positions().tolist())):
            target[(int(lay.block_tables[row, 0]), pos)] = hidden[i].clone()
        return hidden

    runner.forward = recording_forward
    in_pass, checked = [False], [0]
    mtp_pass = MTPDrafter._mtp_pass

    def pass_flag(self, *args):
        in_pass[0] = True
        try:
            return mtp_pass(self, *args)
        finally:
            in_pass[0] = False

    def check(hidden, pos, attn):
        if in_pass[0]:
            lay = attn.layout
            rows = np.repeat(np.arange(len(lay.query_lens)), lay.query_lens)
            for i, (row, p) in enumerate(zip(rows.tolist(), pos.tolist())):
                assert torch.equal(hidden[i], target[(int(lay.block_tables[row, 0]), p)]), (row, p)
                checked[0] += 1

    monkeypatch.setattr(MTPDrafter, "_mtp_pass", pass_flag)
    on_mtp_layer(monkeypatch, lambda hidden, input_ids, pos, attn: check(hidden, pos, attn))
    for i, p in enumerate(random_prompts(4, 5, 40, VOCAB, 84)):
        core.add_request(p, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True), req_id=f"r{i}")
    max_pending = 0
    while core.has_unfinished():
        core.step()
        max_pending = max(max_pending, int(runner.states.mtp_pending.max()))
    assert max_pending == min(stash_positions, 10) and checked[0] > 100


def on_mtp_layer(monkeypatch, hook) -> None:
    """Call hook(hidden, input_ids, positions, attention context) on every run of the MTP layer,
    whole (CausalLM.mtp_forward) or only its K/V (CausalLM.mtp_write_kv)."""
    from worker.models.llama import CausalLM

    def hooked(original):
        def run(self, layer, hidden, input_ids, pos, attn, has_position0=True):
            hook(hidden, input_ids, pos, attn)
            return original(self, layer, hidden, input_ids, pos, attn, has_position0)
        return run

    for name in ("mtp_forward", "mtp_write_kv"):
        monkeypatch.setattr(CausalLM, name, hooked(getattr(CausalLM, name)))


def test_a_prompt_pass_covers_the_mtp_window_only(mtp_checkpoints, references, monkeypatch):
    """With mtp_window=8 the MTP layer runs over the positions a query at the prompt's last one
    attends (plus one: counted before the handoff token is known) and the last position of every
    earlier chunk (each row of a pass keeps one: a tapped prompt reports its MTP layer from the pass);
    the output is still transformers'."""

    prompt = random_prompts(1, 100, 100, VOCAB, 83)[0]
    llm = LLM(str(mtp_checkpoints["qwen2"]), max_model_len=200, block_size=4, max_num_batched_tokens=32,
              speculative_method="mtp", num_speculative_tokens=2, spec_policy="fixed", mtp_window=8)
    positions: list[list[int]] = []
    on_mtp_layer(monkeypatch, lambda hidden, input_ids, pos, attn: positions.append(pos.tolist()))
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0]
    prefill = [p for p in positions if p and p[-1] < len(prompt)]
    # Chunks of 32, 32, 32 and 4 tokens: 31, 63, then 91..95 and 96..99.
    assert sorted(q for p in prefill for q in p) == [31, 63, *range(len(prompt) - 9, len(prompt))], prefill
    references["qwen2"].assert_matches(prompt, out.token_ids, 16, "mtp_window=8")


# ----------------------------------------------------------------- seeded sampling across placements


def outputs(tmp_path, model: str, prompts, params, placement: str, spec: str | None) -> list[list[int]]:
    engines = ThreadedEngines(tmp_path)
    common = dict(model=model, max_model_len=400, num_threads=1, speculative_method=spec)
    if placement == "colocated":
        engines.add("colocated", "colocated-0", EngineConfig(**common, max_num_seqs=8))
    else:
        decode = dict(num_kv_blocks=26, block_size=16) if placement == "pd-preempt" else {}
        engines.add("prefill", "prefill-0", EngineConfig(**{**common, "num_speculative_tokens": 1},
                                                         max_num_batched_tokens=128))
        engines.add("decode", "decode-0", EngineConfig(**common, max_num_seqs=4, **decode))
    engines.start()
    client = client_for(engines.server_addr, model, "colocated" if placement == "colocated" else "pd", 400)
    try:
        with running_client(client) as run:
            run(wait_ready(client))
            results = run(generate_all(client, prompts, params, concurrency=8))
            run(wait_blocks_free(client))
            if placement == "pd-preempt":
                assert engines.procs["decode-0"].core.stats().num_preemptions > 0
            assert all(r["error"] is None for r in results), results
            return [r["tokens"] for r in results]
    finally:
        engines.stop()


@pytest.mark.parametrize("spec", [None, "mtp"])
def test_seeded_sampling_is_the_same_wherever_it_runs(spec, mtp_checkpoints, tmp_path):
    model = str(mtp_checkpoints["qwen2"])
    prompts = random_prompts(12, 100, 300, VOCAB, 83)
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    colocated = outputs(tmp_path, model, prompts, params, "colocated", spec)
    assert len({tuple(t) for t in colocated}) == len(prompts)
    for placement in ("pd", "pd-preempt"):
        assert outputs(tmp_path, model, prompts, params, placement, spec) == colocated, placement


def test_engines_with_the_same_seed_do_not_share_unseeded_noise(checkpoints, tmp_path):
    model = str(checkpoints["qwen2"])
    prompts = random_prompts(6, 5, 20, VOCAB, 84)
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)

    def run(name: str) -> list[list[int]]:
        return [o.token_ids for o in LLM(model, max_model_len=64, seed=7, instance_name=name).generate(prompts, params)]

    assert run("prefill-0") == run("prefill-0")  # one instance's noise is reproducible from --seed
    assert run("prefill-0") != run("decode-0")
    engines = ThreadedEngines(tmp_path)  # the engine process names its instance
    proc = engines.add("colocated", "colocated-7", EngineConfig(model=model, max_model_len=64, seed=7))
    try:
        assert proc.core.config.instance_name == "colocated-7"
    finally:
        proc.close()


def assert_seeded_tie(model, prompt: list[int], ours: list[int], theirs: list[int], params: SamplingParams,
                      label: str) -> None:
    """Two seeded outputs of one request that differ must first differ at a float-noise tie: the
    exponential race (worker/sample/sampler.py) over the reference's distribution there, with that output
    index's noise, has the two tokens on top, their log scores within the conftest logit-gap
    tolerance scaled by the temperature."""
    from worker.sample.sampler import position_generator

    i = next(n for n, (a, b) in enumerate(zip(ours, theirs)) if a != b)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ours[:i]])).logits[0, -1].float() / params.temperature
    if params.top_k:
        logits[logits < logits.topk(params.top_k).values[-1]] = float("-inf")
    noise = torch.empty(logits.shape[0]).uniform_(generator=position_generator(params.seed, i))
    scores = torch.log_softmax(logits, -1) - torch.log(-torch.log1p(-noise))  # log(p / Exp(1) draw)
    top2 = scores.topk(2)
    gap = float(top2.values[0] - top2.values[1])
    assert set(top2.indices.tolist()) == {ours[i], theirs[i]} and gap < 1e-4 / params.temperature, (
        f"{label}: output {i} differs ({ours[i]} against {theirs[i]}) and the race's top two are "
        f"{top2.indices.tolist()} {gap:.3g} apart, not a float-noise tie")


def test_seeded_output_does_not_depend_on_speculation(mtp_checkpoints, references):
    """Verification samples every position with its (seed, index) noise and keeps matching drafts,
    so a seeded request's tokens are those of non-speculative sampling, whatever was drafted:
    equal, or apart from a float-noise tie on (assert_seeded_tie)."""
    model = str(mtp_checkpoints["qwen3"])
    prompts = random_prompts(8, 5, 60, VOCAB, 85)
    params = [SamplingParams(temperature=0.8, top_k=50, seed=i, max_tokens=24, ignore_eos=True) for i in range(8)]
    base = LLM(model, max_model_len=128).generate(prompts, params)
    llm = LLM(model, max_model_len=128, speculative_method="mtp", num_speculative_tokens=3, spec_policy="fixed")
    spec = llm.generate(prompts, params)
    assert llm.engine.scheduler.spec_stats.num_draft_tokens > 100
    for i, (prompt, a, b, p) in enumerate(zip(prompts, base, spec, params)):
        assert len(a.token_ids) == len(b.token_ids) == 24
        if a.token_ids != b.token_ids:  # the target without its MTP layer: the same weights
            assert_seeded_tie(references["qwen3"].model, prompt, a.token_ids, b.token_ids, p, f"prompt {i}")
