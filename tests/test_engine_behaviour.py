"""Seeded sampling, the invariant checker, bad input, abort (issue: core engine)."""
from __future__ import annotations

import pytest
from conftest import random_prompts

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.core import EngineCore
from worker.invariants import InvariantViolation
from worker.states import RequestStates

VOCAB = 384


@pytest.fixture(scope="module")
def qwen2_llm(checkpoints):
    llm = LLM(str(checkpoints["qwen2"]), max_model_len=256, block_size=4, max_num_seqs=8)
    yield llm
    llm.shutdown()


def run_to_completion(core: EngineCore) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while core.has_unfinished():
        for u in core.step():
            out.setdefault(u.req_id, []).extend(u.new_token_ids)
    return out


def test_seeded_sampling_reproducible_across_batches_and_runs(qwen2_llm, checkpoints):
    prompt = random_prompts(1, 20, 20, VOCAB, 7)[0]
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)
    alone = qwen2_llm.generate([prompt], seeded)[0].token_ids

    others = random_prompts(6, 5, 60, VOCAB, 8)
    mixed_params = [SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True),
                    SamplingParams(temperature=0.5, seed=9, max_tokens=10, ignore_eos=True),
                    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * 2
    batch = others[:3] + [prompt] + others[3:]
    params = mixed_params[:3] + [seeded] + mixed_params[3:]
    in_batch = qwen2_llm.generate(batch, params)[3].token_ids
    assert in_batch == alone

    fresh = LLM(str(checkpoints["qwen2"]), max_model_len=256, block_size=16, max_num_seqs=2, seed=99)
    assert fresh.generate([prompt], seeded)[0].token_ids == alone
    fresh.shutdown()
    different = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=4321, max_tokens=24, ignore_eos=True)
    assert qwen2_llm.generate([prompt], different)[0].token_ids != alone


def resume_in_decode_setup(llm: LLM) -> tuple[EngineCore, list[int]]:
    """A 9-token prompt with block size 4: the second submission hits 8 cached tokens, so it is
    admitted with num_computed_tokens = total_len - 1, straight into decode (like a PD handoff)."""
    core = llm.engine
    prompt = random_prompts(1, 9, 9, VOCAB, 11)[0]
    core.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    run_to_completion(core)
    core.step()  # release the finished slot
    return core, prompt


def test_invariant_checker_catches_planted_stale_last_sampled(checkpoints, monkeypatch):
    llm = LLM(str(checkpoints["qwen2"]), max_model_len=128, block_size=4, max_num_seqs=2)
    core, prompt = resume_in_decode_setup(llm)
    states = core.runner.states
    freed = states.free_slots[-1]  # LIFO: the next admission gets this slot
    states.last_sampled_tokens[freed] = (prompt[-1] + 1) % VOCAB  # plausible but wrong
    monkeypatch.setattr(RequestStates, "seed_last_sampled", lambda self, slot, token: None)
    req = core.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    with pytest.raises(InvariantViolation, match=rf"I2 violated for slot {freed} \(request '{req}'\)"):
        core.step()


def test_stale_slot_changes_output_without_seeding(checkpoints, references, monkeypatch):
    """The stale-slot bug, reproduced: without seeding, the resumed request decodes from the
    previous occupant's token; with seeding it matches transformers."""
    monkeypatch.setenv("PDSERVE_DEBUG_INVARIANTS", "0")
    outputs = {}
    for seeding in (True, False):
        llm = LLM(str(checkpoints["qwen2"]), max_model_len=128, block_size=4, max_num_seqs=2)
        core, prompt = resume_in_decode_setup(llm)
        states = core.runner.states
        states.last_sampled_tokens[states.free_slots[-1]] = (prompt[-1] + 1) % VOCAB
        with monkeypatch.context() as m:
            if not seeding:
                m.setattr(RequestStates, "seed_last_sampled", lambda self, slot, token: None)
            req = core.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
            outputs[seeding] = run_to_completion(core)[req]
        assert core.block_manager.num_hit_blocks >= 2
    assert references["qwen2"].assert_matches(prompt, outputs[True], 16)
    assert outputs[False] != outputs[True]


@pytest.mark.parametrize("bad, field", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-3), "top_k"),
    (dict(min_p=2.0), "min_p"),
])
def test_bad_sampling_params_name_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**bad)


def test_bad_prompts_rejected_and_running_requests_unaffected(qwen2_llm, references):
    core = qwen2_llm.engine
    prompts = random_prompts(3, 10, 40, VOCAB, 21)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    ids = [core.add_request(p, params) for p in prompts]
    outputs: dict[str, list[int]] = {}
    for _ in range(3):
        for u in core.step():
            outputs.setdefault(u.req_id, []).extend(u.new_token_ids)
    for bad_prompt, field in [([], "prompt"), ([5] * 300, "max_model_len"), ([3, VOCAB], "vocabulary"),
                              ([3, -1], "vocabulary")]:
        with pytest.raises(ValueError, match=field):
            core.add_request(bad_prompt, params)
    with pytest.raises(ValueError, match="prompt"):
        qwen2_llm.generate(["text needs a tokenizer"], params)
    while core.has_unfinished():
        for u in core.step():
            outputs.setdefault(u.req_id, []).extend(u.new_token_ids)
    for req_id, prompt in zip(ids, prompts):
        references["qwen2"].assert_matches(prompt, outputs[req_id], 20)


def test_abort_frees_blocks_at_any_point(qwen2_llm):
    core = qwen2_llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    waiting = core.add_request(random_prompts(1, 30, 30, VOCAB, 31)[0], params)
    core.abort_request(waiting)  # still waiting
    running = [core.add_request(p, params) for p in random_prompts(4, 50, 120, VOCAB, 32)]
    core.step()
    core.abort_request(running[0])  # mid-prefill or decoding
    for _ in range(5):
        core.step()
    for r in running[1:]:
        core.abort_request(r)
    core.step()
    stats = core.stats()
    assert not core.has_unfinished()
    assert stats.kv_blocks_free == stats.kv_blocks_total
    assert not core.runner.states.req_id_to_slot


def test_stop_token_ids_min_tokens_and_eos(checkpoints):
    llm = LLM(str(checkpoints["llama"]), max_model_len=128)
    prompt = random_prompts(1, 12, 12, VOCAB, 41)[0]
    greedy = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0].token_ids
    stop_at = greedy[5]
    first = greedy.index(stop_at)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop_at]))[0]
    assert out.token_ids == greedy[: first + 1] and out.finish_reason == "stop"
    # min_tokens bans stop tokens until reached.
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop_at],
                                                min_tokens=first + 3))[0]
    assert len(out.token_ids) >= first + 3 and stop_at not in out.token_ids[: first + 3]
    # logprobs: the sampled token's logprob is the max under greedy, with n alternatives.
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True))[0]
    assert len(out.logprobs) == 4
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok and lp.rank == 1 and len(lp.top) == 3 and lp.top[0][0] == tok
    llm.shutdown()


def test_config_errors_are_clear(checkpoints, tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        EngineCore(EngineConfig(model=str(tmp_path)))
    with pytest.raises(ValueError, match="num_kv_blocks"):
        EngineCore(EngineConfig(model=str(checkpoints["qwen2"]), num_kv_blocks=2, max_model_len=256))


def test_plain_greedy_batches_take_the_argmax_fast_path(qwen2_llm, references, monkeypatch):
    """A step of plain greedy rows skips the per-position sampling metadata; rows that need it
    (min_tokens not reached, logprobs, penalties) take the general path, and the tokens are
    transformers' greedy tokens either way."""
    runner = qwen2_llm.engine.runner
    general = {"steps": 0}
    metadata = runner.verifier.position_metadata

    def counted(*a, **kw):
        general["steps"] += 1
        return metadata(*a, **kw)

    monkeypatch.setattr(runner.verifier, "position_metadata", counted)
    prompts = random_prompts(3, 6, 12, VOCAB, 31)
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = qwen2_llm.generate(prompts, plain)
    assert [o.token_ids for o in outs] == [references["qwen2"].generate(p, 12)[0] for p in prompts]
    assert general["steps"] == 0  # every step took a fast path (the prefill step too)

    general["steps"] = 0
    late = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=5, ignore_eos=True)
    assert qwen2_llm.generate(prompts[:1], late)[0].token_ids == outs[0].token_ids
    assert general["steps"] == 5  # while min_tokens holds EOS back: the general path
    general["steps"] = 0
    qwen2_llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, logprobs=1, ignore_eos=True))
    assert general["steps"] == 4
