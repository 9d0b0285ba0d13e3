"""Speculative decoding (MTP and n-gram): exact greedy output, the I4 mirror, stale drafts (issue: MTP)."""
from __future__ import annotations

import json
import random

import pytest
from conftest import random_prompts

from engine import LLM, SamplingParams
from worker.invariants import InvariantViolation
from worker.states import RequestStates

VOCAB = 384
NEW = 40


def repetitive_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts with repeated spans so n-gram lookup finds matches (and sometimes right ones)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        motif = [rng.randrange(2, VOCAB) for _ in range(rng.randint(3, 8))]
        out.append((motif * rng.randint(2, 6) + [rng.randrange(2, VOCAB) for _ in range(rng.randint(0, 20))])[:200])
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("method,k,draft_dtype,policy", [
    ("mtp", 1, "auto", "fixed"), ("mtp", 2, "auto", "fixed"), ("mtp", 2, "float32", "fixed"),
    ("mtp", 4, "auto", "fixed"), ("ngram", 3, "auto", "fixed"), ("mtp", 2, "auto", "adaptive")])
def test_spec_greedy_matches_transformers(arch, method, k, draft_dtype, policy, mtp_checkpoints, references):
    prompts = random_prompts(10, 1, 200, VOCAB, 61) + repetitive_prompts(6, 62)
    llm = LLM(str(mtp_checkpoints[arch]), max_model_len=320, max_num_seqs=2, block_size=4,
              max_num_batched_tokens=64, speculative_method=method, num_speculative_tokens=k, draft_dtype=draft_dtype,
              spec_policy=policy)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
    exact = sum(references[arch].assert_matches(p, o.token_ids, NEW, f"{arch}/{method}{k}/prompt {i}")
                for i, (p, o) in enumerate(zip(prompts, outs)))
    assert exact >= len(prompts) - 1
    core = llm.engine
    spec = core.scheduler.spec_stats
    if policy == "fixed":
        assert spec.num_drafts > 100 and spec.num_draft_tokens >= spec.num_drafts
    else:  # a random MTP layer is never right: after measuring every k the policy settles on 0
        chosen = core.runner.spec_policy.chosen_k_counts
        assert all(n > 0 for n in chosen) and chosen[0] > sum(chosen[1:]), chosen
    if method == "ngram":  # repeated motifs make some drafts right
        assert spec.num_accepted_tokens > 0
    core.step()
    stats = core.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total and not core.runner.states.req_id_to_slot


@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_spec_greedy_with_a_draft_vocabulary_matches_transformers(policy, mtp_checkpoints, references, tmp_path):
    """Drafting over a token subset (FR-Spec, --draft-vocab) changes which drafts are proposed, never the output."""
    vocab = tmp_path / "draft_vocab.json"
    vocab.write_text(json.dumps({"token_ids": list(range(0, VOCAB, 3))}))
    prompts = random_prompts(8, 1, 200, VOCAB, 71) + repetitive_prompts(4, 72)
    llm = LLM(str(mtp_checkpoints["qwen2"]), max_model_len=320, max_num_seqs=2, block_size=4,
              max_num_batched_tokens=64, speculative_method="mtp", num_speculative_tokens=2, spec_policy=policy,
              draft_vocab=str(vocab))
    model = llm.engine.runner.model
    assert model.draft_head.out_features == len(model.draft_vocab) == len(range(0, VOCAB, 3))
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
    exact = sum(references["qwen2"].assert_matches(p, o.token_ids, NEW, f"draft vocab/{policy}/prompt {i}")
                for i, (p, o) in enumerate(zip(prompts, outs)))
    assert exact >= len(prompts) - 1
    spec = llm.engine.scheduler.spec_stats
    assert spec.num_draft_tokens > 0


def test_draft_vocabulary_logits_and_bad_files(mtp_checkpoints, tmp_path):
    import torch

    from worker.model_loader import resolve_draft_vocab

    llm = LLM(str(mtp_checkpoints["qwen2"]), max_model_len=64, max_num_seqs=1, speculative_method="mtp",
              draft_vocab="full", draft_dtype="float32")
    model = llm.engine.runner.model
    h = torch.randn(3, model.config.hidden_size)
    full = model.compute_draft_logits(h)
    ids = [5, 1, 200, 7]
    model.set_draft_vocab(ids)
    sub = model.compute_draft_logits(h)
    keep = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    keep[ids] = True
    torch.testing.assert_close(sub[:, keep], full[:, keep])
    assert torch.isneginf(sub[:, ~keep]).all()
    with pytest.raises(ValueError, match="draft vocabulary"):
        model.set_draft_vocab([0, model.config.vocab_size])
    assert resolve_draft_vocab("auto", tmp_path) is None and resolve_draft_vocab("full", tmp_path) is None
    bad = tmp_path / "bad.json"
    bad.write_text('{"ids": [1, 2]}')
    with pytest.raises(ValueError, match="draft_vocab"):
        resolve_draft_vocab(str(bad), tmp_path)
    bad.write_text('{"token_ids": ["a"]}')
    with pytest.raises(ValueError, match="draft_vocab"):
        resolve_draft_vocab(str(bad), tmp_path)


def test_runner_mirror_equals_scheduler_every_step(mtp_checkpoints, monkeypatch):
    """500+ decode steps with rejections: the runner's CPU mirror is the scheduler's value every step.
    With the runner switched to incrementing its mirror, the invariant checker fails the run."""

    def run(increment: bool) -> tuple[int, int]:
        llm = LLM(str(mtp_checkpoints["qwen2"]), max_model_len=256, max_num_seqs=4, speculative_method="mtp",
                  num_speculative_tokens=3, spec_policy="fixed")
        core = llm.engine
        runner = core.runner
        if increment:
            last_scheduled: dict[str, int] = {}

            def buggy_update(self, cached):  # the seed bug: mirror += scheduled, never refreshed
                slot = self.req_id_to_slot[cached.req_id]
                self.num_computed_tokens_np[slot] += last_scheduled.get(cached.req_id, 0)
                self.append_blocks(slot, cached.new_block_ids)

            monkeypatch.setattr(RequestStates, "update_request", buggy_update)
        for p in random_prompts(8, 5, 40, VOCAB, 63):
            core.add_request(p, SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True))
        decode_steps = rejections = 0
        while core.has_unfinished():
            sched = core.scheduler.schedule()
            if increment:
                last_scheduled.update(sched.num_scheduled_tokens)
            result = runner.execute_model(sched)
            for c in sched.cached_requests:  # checked independently of the invariant checker too
                slot = runner.states.req_id_to_slot[c.req_id]
                assert runner.states.num_computed_tokens_np[slot] == c.num_computed_tokens
            for rid, toks in zip(result.req_ids, result.sampled_token_ids):
                k = sched.num_draft_tokens.get(rid, 0)
                if toks and k:
                    decode_steps += 1
                    rejections += k + 1 - len(toks)
            core.scheduler.update_from_output(sched, result)
        return decode_steps, rejections

    steps, rejected = run(increment=False)
    assert steps >= 500 and rejected > 100
    with pytest.raises((InvariantViolation, AssertionError), match="I4|num_computed"):
        run(increment=True)


def test_stale_drafts_in_reused_slot_do_not_change_output(mtp_checkpoints, references, monkeypatch):
    """Fill every free slot's drafts with plausible tokens, then admit requests that resume in
    decode. Output stays exact; with the admission reset disabled the checker names the slot (I2)."""
    prompt = random_prompts(1, 9, 9, VOCAB, 64)[0]
    ref_tokens = references["qwen2"].generate(prompt, 20)[0]

    def admit_after_planting(llm) -> list[int]:
        core = llm.engine
        core.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
        while core.has_unfinished():
            core.step()
        core.step()
        states = core.runner.states
        for slot in states.free_slots:
            states.draft_tokens[slot] = states.draft_tokens.new_tensor(ref_tokens[1:1 + states.draft_tokens.shape[1]])
            states.draft_tokens_np[slot] = ref_tokens[1:1 + states.draft_tokens.shape[1]]
            states.num_draft_tokens[slot] = states.draft_tokens.shape[1]
        req = core.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
        out: list[int] = []
        while core.has_unfinished():
            for u in core.step():
                if u.req_id == req:
                    out.extend(u.new_token_ids)
        return out

    llm = LLM(str(mtp_checkpoints["qwen2"]), max_model_len=128, block_size=4, max_num_seqs=2,
              speculative_method="mtp", num_speculative_tokens=2)
    assert admit_after_planting(llm) == ref_tokens
    monkeypatch.setattr(RequestStates, "reset_drafts", lambda self, slot: None)
    llm = LLM(str(mtp_checkpoints["qwen2"]), max_model_len=128, block_size=4, max_num_seqs=2,
              speculative_method="mtp", num_speculative_tokens=2)
    with pytest.raises(InvariantViolation, match=r"I2/I3 violated for slot \d+"):
        admit_after_planting(llm)


def test_ngram_lookup():
    from worker.spec_decode.ngram import NgramDrafter

    d = NgramDrafter(states=None, num_tokens=3)  # type: ignore[arg-type]
    assert d.lookup([1, 2, 3, 4, 1, 2]) == [3, 4, 1]
    assert d.lookup([5, 6, 7]) == []
    assert d.lookup([9, 9, 9]) == [9]
