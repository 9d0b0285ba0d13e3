"""benchmarks/bench_spec.py: contenders that take turns are each timed on their own decode steps."""
from __future__ import annotations

from conftest import random_prompts

from benchmarks import bench_spec
from engine import LLM, SamplingParams

VOCAB = 384


def test_interleaved_round_times_each_contenders_own_decode(mtp_checkpoints, monkeypatch):
    monkeypatch.setattr(bench_spec, "TURN_SECONDS", 0.0)  # one step a turn: the finest interleaving
    contenders = [bench_spec.Contender(name, LLM(str(mtp_checkpoints["qwen2"]), max_model_len=128, max_num_seqs=4,
                                                 speculative_method=method, num_speculative_tokens=2))
                  for name, method in (("plain", None), ("mtp", "mtp"))]
    prompts = random_prompts(3, 5, 9, VOCAB, 3)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for _ in range(2):
        bench_spec.interleaved_round(contenders, prompts, params)
    for c in contenders:
        assert [n for n, _ in c.runs] == [3 * 5] * 2  # every token after each request's first
        assert all(t > 0 for _, t in c.runs)
        assert c.llm.engine.has_unfinished() is False
        c.llm.shutdown()


def test_an_ablated_contender_runs_the_adaptive_policy_with_its_knobs_changed(mtp_checkpoints, monkeypatch):
    monkeypatch.setattr(bench_spec, "prompts_for", lambda llm, n: random_prompts(n, 5, 9, VOCAB, 4))
    llm = bench_spec.ablated_llm(str(mtp_checkpoints["qwen2"]), 2, 4, "cpu",
                                 {"hold_decisions": "0", "surprise": "0.5"})
    policy = llm.engine.runner.spec_policy
    assert str(policy.mode) == "adaptive" and policy.num_spec == 2
    assert policy.hold_decisions == 0 and policy.surprise == 0.5 and isinstance(policy.surprise, float)
    llm.shutdown()
