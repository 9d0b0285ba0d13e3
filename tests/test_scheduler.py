"""The scheduler on its own, driven by fake runner outputs (no model): which prompts share a step.

A prompt joins a step that already prefills another only while its tokens cost less than a step's
fixed part, as the engine's own steps measure it (scheduler/step_cost.py). A model whose steps are
mostly fixed cost (the bundled one) batches a burst of prompts into one step; one whose steps are
mostly arithmetic (a 0.5B model on a CPU) prefills them one a step, so the first prompt's first
token does not wait for the others' compute.
"""
from __future__ import annotations

import pytest

from engine.request import Request
from engine.types import SamplingParams
from kv_transfer.connector import KVConnector
from scheduler.block_manager import BlockManager
from scheduler.output import RunnerOutput, SchedulerOutput
from scheduler.scheduler import DEFAULT_SHARED_PREFILL_TOKENS, MIN_SHARED_PREFILL_TOKENS, Scheduler
from scheduler.step_cost import StepCost

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def make_scheduler(cost: StepCost, budget: int = 2048) -> Scheduler:
    blocks = BlockManager(num_blocks=1024, block_size=16, enable_prefix_caching=False)
    return Scheduler(max_num_seqs=16, max_num_batched_tokens=budget, max_model_len=4096, block_manager=blocks,
                     connector=KVConnector(), step_cost=cost)


def fitted(fixed_s: float, per_token_s: float) -> StepCost:
    """A cost model that has seen exact steps of a decode-sized and a prefill-sized batch."""
    cost = StepCost()
    for tokens in (1, 4, 64, 256, 8, 512):
        cost.record(tokens, fixed_s + per_token_s * tokens)
    return cost


def add_prompts(sched: Scheduler, n: int, length: int) -> list[str]:
    ids = [f"r{i}" for i in range(n)]
    for i, req_id in enumerate(ids):
        sched.add_request(Request(req_id, [5 + i] * length, PARAMS, []))
    return ids


def run_step(sched: Scheduler) -> SchedulerOutput:
    """One step with a fake runner: every request that finished its prompt samples token 7."""
    out = sched.schedule()
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = sched.requests[req_id]
        done = request.num_computed_tokens + out.num_scheduled_tokens[req_id] >= request.num_tokens_to_compute
        sampled.append([7] if done else [])
    sched.update_from_output(out, RunnerOutput(req_ids, sampled, [[] for _ in req_ids]))
    return out


def test_the_fit_recovers_fixed_and_per_token_cost():
    assert fitted(0.1, 0.01).shared_prefill_tokens() == 10
    assert fitted(0.005, 0.000002).shared_prefill_tokens() == 2500


def test_the_fit_needs_steps_of_different_sizes():
    cost = StepCost()
    assert cost.shared_prefill_tokens() is None
    for _ in range(10):
        cost.record(200, 2.0)
    assert cost.shared_prefill_tokens() is None, "one step size cannot separate fixed from per-token cost"
    cost.record(1, 0.1)
    assert cost.shared_prefill_tokens() is not None


def test_noise_without_a_per_token_cost_gives_no_answer():
    cost = StepCost()
    for tokens, seconds in ((1, 0.010), (100, 0.009), (10, 0.011), (300, 0.008)):
        cost.record(tokens, seconds)
    assert cost.shared_prefill_tokens() is None


def test_the_window_follows_a_change_of_cost():
    cost = fitted(0.1, 0.01)
    for _ in range(64):  # the machine got a core back, say: same fixed part, per-token halved
        for tokens in (1, 200):
            cost.record(tokens, 0.1 + 0.005 * tokens)
    assert cost.shared_prefill_tokens() == 20


def test_compute_bound_steps_prefill_one_prompt_at_a_time():
    sched = make_scheduler(fitted(fixed_s=0.1, per_token_s=0.01))  # break-even: 10 tokens
    ids = add_prompts(sched, 8, 200)
    firsts = []
    for _ in range(8):
        out = run_step(sched)
        firsts.append([r.req_id for r in out.new_requests])
    assert firsts == [[req_id] for req_id in ids], "one 200-token prompt a step, in arrival order"


def test_overhead_bound_steps_batch_the_burst():
    sched = make_scheduler(fitted(fixed_s=0.005, per_token_s=0.000002))  # break-even: 2500 tokens
    ids = add_prompts(sched, 8, 200)
    out = run_step(sched)
    assert [r.req_id for r in out.new_requests] == ids


def test_decodes_and_handoffs_never_wait_for_the_rule():
    """Running decodes stay in the step with a prefill, and short prompts still join it."""
    sched = make_scheduler(fitted(fixed_s=0.1, per_token_s=0.01))
    add_prompts(sched, 2, 200)
    run_step(sched)
    run_step(sched)  # both prompts done: two running decodes
    sched.add_request(Request("long", [9] * 300, PARAMS, []))
    sched.add_request(Request("short", [9, 8, 7], PARAMS, []))  # 3 tokens < 10: joins
    sched.add_request(Request("long2", [9] * 300, PARAMS, []))
    out = run_step(sched)
    assert [r.req_id for r in out.new_requests] == ["long", "short"]
    assert out.num_scheduled_tokens["r0"] == 1 and out.num_scheduled_tokens["r1"] == 1
    assert [r.req_id for r in run_step(sched).new_requests] == ["long2"]


def test_until_the_steps_tell_prompts_are_batched_up_to_the_default():
    sched = make_scheduler(StepCost())
    add_prompts(sched, 3, DEFAULT_SHARED_PREFILL_TOKENS)
    out = run_step(sched)
    assert [r.req_id for r in out.new_requests] == ["r0", "r1", "r2"]
    sched = make_scheduler(StepCost())
    add_prompts(sched, 2, DEFAULT_SHARED_PREFILL_TOKENS + 1)
    assert [r.req_id for r in run_step(sched).new_requests] == ["r0"]


@pytest.mark.parametrize("budget", [64, 2048])
def test_a_chunked_prompt_keeps_its_chunks_coming(budget):
    """A prompt longer than the budget is prefilled in chunks, step after step, with nothing of
    the rule holding it back; the next prompt starts once it is done (or joins its last chunk when
    short enough)."""
    sched = make_scheduler(fitted(fixed_s=0.1, per_token_s=0.01), budget=budget)
    sched.add_request(Request("big", [3] * 1000, PARAMS, []))
    sched.add_request(Request("next", [4] * 100, PARAMS, []))
    steps = 0
    while "next" not in {r.req_id for r in run_step(sched).new_requests}:
        steps += 1
        assert steps < 100
    assert sched.requests["big"].num_computed_tokens >= 1000


def test_the_fit_predicts_a_steps_seconds():
    cost = fitted(fixed_s=0.1, per_token_s=0.01)
    assert abs(cost.predict(200) - 2.1) < 1e-9
    assert StepCost().predict(200) is None


def test_short_prompts_share_a_step_whatever_the_fit_says():
    """A fit over steps of a few tokens is mostly noise: prompts this short batch regardless."""
    sched = make_scheduler(fitted(fixed_s=0.1, per_token_s=0.01))  # break-even: 10 tokens
    ids = add_prompts(sched, 3, MIN_SHARED_PREFILL_TOKENS)
    assert [r.req_id for r in run_step(sched).new_requests] == ids
