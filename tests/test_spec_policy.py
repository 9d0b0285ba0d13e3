"""The speculation policy on its own (worker/spec_decode/policy.py), fed synthetic step costs and
acceptance: no model, no engine. The drafter and engines it steers: tests/test_spec_drafter.py."""
from __future__ import annotations

from math import prod

import pytest

from worker.spec_decode import policy as policy_module
from worker.spec_decode.policy import SpecPolicy, SpecPolicyMode, batch_bucket

# ----------------------------------------------------------------- the policy on its own


def feed(policy: SpecPolicy, batch: int, costs_ms: list[float], accept: list[float], steps: int,
         load=lambda step: 1.0, sampled: bool = False, rows: int = 100, pending: int = 0) -> list[int]:
    """Drive the policy with synthetic step costs (times a machine load) and acceptance, verifying
    `rows` rows' drafts a step (`pending`: the MTP backfill at each decision); returns its decisions."""
    chosen, k_prev = [], None
    for step in range(steps):
        k = policy.choose(batch, pending, sampled=sampled)
        if k_prev == k:
            policy.record_step(batch, k, costs_ms[k] * load(step) / 1e3, sampled)
        if k:  # row j keeps draft i while u_j < a_1 * ... * a_i, u_j evenly spread in [0, 1)
            u = [j / rows if rows == 100 else (step * rows + j) * 0.618034 % 1 for j in range(rows)]
            accepted = [sum(1 for i in range(k) if u_j < prod(accept[: i + 1])) for u_j in u]
            policy.record_acceptance([k] * rows, accepted)
        chosen.append(k)
        k_prev = k
    return chosen


def test_expected_tokens_is_one_plus_cumulative_acceptance():
    policy = SpecPolicy(3)
    for est, a in zip(policy.acceptance, (0.8, 0.5, 0.25)):
        est.update(a, 1.0)
    assert policy.expected_tokens(0) == 1.0
    assert policy.expected_tokens(2) == pytest.approx(1 + 0.8 + 0.4)
    assert policy.expected_tokens(3) == pytest.approx(1 + 0.8 + 0.4 + 0.1)


def test_a_few_early_drafts_do_not_settle_a_later_positions_acceptance():
    """A later position's acceptance starts from the one before it, worth `PRIOR_DRAFTS` drafts:
    one unlucky warm-up measurement (4 of 16 second drafts kept where the first keeps 56%) must
    not make k=2 look hopeless, and many drafts still pull the estimate to what they show."""
    policy = SpecPolicy(2)
    policy.record_acceptance([1] * 100, [1] * 56 + [0] * 44)
    policy.record_acceptance([2] * 16, [2] * 4 + [1] * 12)
    prior = policy.acceptance[0].value  # (position 1's prior; 4 of the 16 is 0.25)
    assert policy.acceptance[1].value == pytest.approx((4 + 16 * prior) / 32) and policy.acceptance[1].value > 0.4
    for _ in range(20):
        policy.record_acceptance([2] * 50, [2] * 10 + [1] * 40)
    assert policy.acceptance[1].value == pytest.approx(0.2, abs=0.03)


@pytest.mark.parametrize("costs,accept,best", [
    ([5.0, 6.0, 6.5], [0.8, 0.8], 2),    # drafting is nearly free and mostly right: draft all K
    ([5.0, 10.0, 14.0], [0.8, 0.8], 0),  # a big batch on a CPU: verifying costs more than it gains
    ([5.0, 7.0, 12.0], [0.7, 0.3], 1),
])
def test_policy_measures_every_k_then_picks_the_fastest(costs, accept, best):
    policy = SpecPolicy(2)
    chosen = feed(policy, 8, costs, accept, 200)
    assert set(chosen[:20]) == {0, 1, 2}, "warm-up measures every k"
    assert chosen[-100:].count(best) >= 85, (chosen[-100:], policy.summary())  # the rest: re-measuring
    assert sum(policy.chosen_k_counts) == 200 and policy.chosen_k_counts[best] > 150


def test_policy_compares_k_with_k0_measured_at_the_same_time():
    """The machine slows 3x for stretches (another process on the core): each k is judged by its
    cost relative to k=0 measured just before or after it, so the drift does not fool it."""
    policy = SpecPolicy(2, explore_every=100)
    chosen = feed(policy, 4, [5.0, 6.0, 6.5], [0.8, 0.8], 600, load=lambda step: 3.0 if step // 50 % 2 else 1.0)
    assert chosen[-300:].count(2) > 240, policy.summary()


def test_a_batch_moving_within_its_bucket_does_not_make_k_look_cheap():
    """Under load the batch moves within a bucket (12..15 rows) while k is measured: here the rows
    are 12 while drafting and 15 otherwise. A verify step's cost grows with its rows faster than a
    plain one's, so k=2 at 12 rows against k=0 at 15 looks 1.85x a plain step, where it costs
    1.96x at 12 and 2.18x at 15 -- more than the 1.9 tokens it yields: k=0 wins at either size."""
    policy = SpecPolicy(2)
    cost_ms = {0: lambda rows: 4.0 + 0.1 * rows, 1: lambda rows: 5.0 + 0.35 * rows, 2: lambda rows: 3.0 + 0.6 * rows}
    chosen, k_prev = [], 0
    for _ in range(1500):
        rows = 12 if k_prev else 15
        k = 0 if policy.holds_k0(rows) else policy.choose(rows)
        if k == k_prev:
            policy.record_step(rows, k, cost_ms[k](rows) / 1e3)
        if k:  # acceptance 0.6, then 0.5: 1.6 tokens at k=1, 1.9 at k=2
            policy.record_acceptance([k] * 10, [min(k, a) for a in (2,) * 3 + (1,) * 3 + (0,) * 4])
        chosen.append(k)
        k_prev = k
    assert policy.buckets[12, False].ratio(2) > 1.9, policy.summary()
    assert chosen[-1000:].count(0) > 950, policy.summary()


def test_paired_ratio_compares_steps_of_one_batch_size():
    from worker.spec_decode.policy import paired_ratio

    k_steps, plain = [(10.2, 12), (12.0, 15), (12.1, 15)], [(5.2, 12), (5.5, 15), (5.4, 15)]
    assert paired_ratio(k_steps, plain) == pytest.approx((10.2 / 5.2 + 12.05 / 5.45) / 2)
    assert paired_ratio([(10.2, 12)], [(5.5, 15)]) == pytest.approx((10.2 / 12) / (5.5 / 15))  # per row


def test_plain_steps_slowed_by_the_drafting_before_them_do_not_make_k_look_cheap():
    """On this CPU the plain steps right after drafting run up to ~15% slower for a few steps: the
    k=0 steps a measurement compares k with are the settled ones (just before it, or past the
    slow ones after it), so the ratio is the held one and a k that loses when held is not chosen."""
    policy = SpecPolicy(2)
    held_costs = [5.0, 8.6, 12.0]  # held: k=1 1.8 tokens / 1.72x, k=2 2.44 / 2.4x -- k=0 wins
    chosen, k_prev, since_draft = [], None, 100
    for _ in range(1500):
        k = 0 if policy.holds_k0(16) else policy.choose(16)
        if k_prev == k:
            slow = (1.15 if since_draft <= 2 else 1.03 if since_draft <= 4 else 1.0) if k == 0 else 1.0
            policy.record_step(16, k, held_costs[k] * slow / 1e3)
        if k:
            policy.record_acceptance([k] * 10, [min(k, a) for a in (2,) * 6 + (1,) * 2 + (0,) * 2])
        since_draft = 0 if k else since_draft + 1
        chosen.append(k)
        k_prev = k
    ratios = [policy.buckets[16, False].ratio(k) for k in (1, 2)]
    assert ratios == pytest.approx([8.6 / 5.0, 12.0 / 5.0], rel=0.04), policy.summary()
    assert chosen[-1000:].count(0) > 970, policy.summary()


def test_while_k0_wins_only_the_closest_k_is_re_measured_on_schedule():
    """Each measurement at a big batch costs steps at 2-3x a plain one: while not drafting wins, the
    scheduled re-measurements take the k that comes closest to winning (here k=1), not every k in
    turn; the others wait `OTHERS_EVERY` intervals."""
    policy = SpecPolicy(3, explore_every=50)
    # Acceptance 0.8 per position: tokens/s against k=0 -- k=1 1.05x, k=2 1.02x, k=3 0.98x.
    chosen = feed(policy, 16, [5.0, 8.6, 12.0, 15.0], [0.8, 0.8, 0.8], 3000)
    starts = [k for i, k in enumerate(chosen) if k and chosen[i - 1] != k]
    assert starts[:6] == [3, 3, 2, 2, 1, 1], "warm-up: two measurements of each k"
    assert set(starts[6:]) == {1} and len(starts[6:]) >= 5, (starts, policy.summary())
    assert policy.best_k(16) == 0


def test_warmed_up_once_every_k_that_could_win_is_measured():
    policy = SpecPolicy(2)
    assert not policy.warmed_up(8) and SpecPolicy(2, SpecPolicyMode.FIXED).warmed_up(8)
    chosen = feed(policy, 8, [5.0, 6.0, 6.5], [0.8, 0.8], 40)
    assert set(chosen) == {0, 1, 2} and policy.warmed_up(8)
    assert not policy.warmed_up(8, sampled=True) and not policy.warmed_up(32)  # other buckets: not yet


def test_the_time_between_steps_is_a_median_that_spikes_do_not_move():
    """Some gaps between a decode engine's steps carry per-request work (a prompt's KV landing) or
    another process's turn on the core; drafting does not amortise those, so they must not count as
    the per-step overhead that makes drafting look better."""
    policy = SpecPolicy(2)
    for i in range(40):
        policy.record_overhead(0.020 if i % 4 == 0 else 0.0005)  # a 20 ms gap every 4th step
    assert policy.overhead.value == pytest.approx(0.0005)


def test_fixed_policy_always_drafts_k():
    policy = SpecPolicy(3, SpecPolicyMode.FIXED)
    assert feed(policy, 4, [1.0, 9.0, 9.0, 9.0], [0.1] * 3, 20) == [3] * 20


def test_unseen_batch_size_borrows_its_neighbours_costs():
    policy = SpecPolicy(2)
    feed(policy, 16, [5.0, 10.0, 14.0], [0.8, 0.8], 100)
    # A passing batch size (a draining batch) decides from bucket 16 instead of exploring.
    assert [policy.choose(12) for _ in range(policy_module.SETTLE_DECISIONS)] == [0] * policy_module.SETTLE_DECISIONS
    assert [batch_bucket(b) for b in (1, 4, 5, 6, 7, 12, 13, 33, 48)] == [1, 4, 4, 6, 6, 12, 12, 32, 48]


def test_a_bucket_the_batch_only_passes_through_is_not_measured():
    """Under load the batch fills up again after each wave of requests ends: a few steps at 8-12 rows
    each time, then hundreds at 16. The middle buckets come back every wave but the batch never stays:
    a measurement started there (steps at 2-4x a plain one) would be abandoned a few steps later, so
    they decide from their neighbours' timings; bucket 16, where the batch stays, is measured."""
    policy = SpecPolicy(3)
    drafted_in_passing, k_prev = [], None
    for wave in range(12):
        for rows in [8] * 4 + [12] * 4 + [16] * 150:
            k = 0 if policy.holds_k0(rows) else policy.choose(rows)
            if k_prev == k:
                policy.record_step(rows, k, (3.0 + 0.2 * rows) * (1 + 0.7 * k) / 1e3)
            if k:
                policy.record_acceptance([k] * rows, [min(k, j % 3) for j in range(rows)])
                if rows < 16 and wave:
                    drafted_in_passing.append((wave, rows, k))
            k_prev = k
    assert not drafted_in_passing, drafted_in_passing
    assert policy.buckets[16, False].explorations >= 3 and policy.best_k(16) == 0, policy.summary()


def test_re_measuring_backs_off_while_it_keeps_confirming_the_decision():
    """Near break-even (k=1, k=2 plausible but slower than k=0) each re-measurement confirms k=0 and
    costs a backfill transition: the interval doubles up to 8x explore_every instead of staying at it."""
    policy = SpecPolicy(2)
    chosen = feed(policy, 16, [5.0, 9.5, 13.0], [0.8, 0.8], 7000)  # rates vs k=0: 0.95, 0.94
    assert policy.best_k(16) == 0 and policy.buckets[16, False].confirmed >= 3
    starts = [i for i in range(1000, 7000) if chosen[i] and not chosen[i - 1]]
    assert len(starts) <= 5, starts  # every 500 decisions would be 12
    assert all(b - a > policy.explore_every for a, b in zip(starts, starts[1:])), starts


def test_greedy_and_sampling_steps_keep_their_own_costs():
    """At batch 1 a sampling verify step costs more than a greedy one (softmax, the drafter's own
    distribution): ratios measured on greedy steps must not decide for sampling ones, nor back."""
    policy = SpecPolicy(2)
    greedy, sampling = [5.0, 6.0, 6.5], [5.0, 9.0, 12.0]  # rates vs k=0 at 0.8 acceptance: 1.3x / 0.9x
    assert feed(policy, 1, greedy, [0.8, 0.8], 200)[-50:].count(2) >= 45, policy.summary()
    chosen = feed(policy, 1, sampling, [0.5, 0.5], 300, sampled=True)
    assert chosen[-100:].count(0) >= 85, policy.summary()
    assert feed(policy, 1, greedy, [0.8, 0.8], 50).count(2) >= 45, policy.summary()  # greedy still drafts


def test_a_new_sampling_bucket_borrows_from_its_own_batch_size_first():
    """Sampling steps at batch 16 first seen after greedy ones there (drafting loses) and sampling
    ones at batch 1 (drafting wins): the cost ratios depend on the batch far more than on the kind
    of step, so until it has measured for itself the new bucket borrows batch 16's and does not draft."""
    policy = SpecPolicy(2)
    feed(policy, 16, [5.0, 12.0, 17.0], [0.8, 0.8], 100)
    assert feed(policy, 1, [5.0, 6.0, 6.5], [0.8, 0.8], 200, sampled=True)[-50:].count(2) >= 45, policy.summary()
    chosen = feed(policy, 16, [5.0, 12.0, 17.0], [0.8, 0.8], 100, sampled=True)
    settle = policy_module.SETTLE_DECISIONS
    assert chosen[:settle] == [0] * settle and chosen[-40:] == [0] * 40, (chosen, policy.summary())


def test_a_bucket_between_two_measured_ones_reads_its_costs_off_both():
    """A draining batch passes through 2-6 rows a few steps at a time and measures nothing there. Its
    costs are interpolated in batch size between the buckets measured on either side: batch 1's ratios
    alone (the nearest) made drafting look far cheaper at 4 rows than it is."""
    policy = SpecPolicy(2)
    feed(policy, 1, [2.0, 2.4, 2.8], [0.9, 0.9], 300, sampled=True, rows=1)
    feed(policy, 12, [5.0, 9.0, 12.0], [0.9, 0.9], 300, sampled=True)
    assert [policy.buckets[b, True].ratio(k) for b in (1, 12) for k in (1, 2)] == pytest.approx([1.2, 1.4, 1.8, 2.4])
    base = 2.0 + 3.0 * 3 / 11  # batch 4: 3/11 of the way from batch 1 to batch 12
    expected = [base, base * (1.2 + 0.6 * 3 / 11), base * (1.4 + 1.0 * 3 / 11)]
    assert policy.cost_estimates((4, True)) == pytest.approx([ms / 1e3 for ms in expected])
    assert policy.cost_estimates((16, True)) == pytest.approx([5e-3, 9e-3, 12e-3])  # beyond: the nearest


def test_a_k_in_use_that_costs_more_than_its_estimate_is_re_measured_at_once():
    """Drafting's cost doubles (the workload changed: longer contexts, another kind of request):
    the recent steps of the k in use disagree with its estimate, so it is re-measured within a
    few dozen steps (k=2, then k=1 whose estimate turns out wrong too) instead of at the next
    scheduled re-measurement (here 2000 decisions away)."""
    policy = SpecPolicy(2, explore_every=2000, first_reexplore=2000)
    feed(policy, 4, [5.0, 6.0, 6.5], [0.8, 0.8], 100)
    assert policy.best_k(4) == 2
    chosen = feed(policy, 4, [5.0, 12.0, 13.0], [0.8, 0.8], 200)
    assert chosen[-50:].count(0) >= 45, (chosen, policy.summary())
    # Without the surprise check it keeps drafting until the scheduled re-measurement.
    blind = SpecPolicy(2, explore_every=2000, first_reexplore=2000, surprise=float("inf"))
    feed(blind, 4, [5.0, 6.0, 6.5], [0.8, 0.8], 100)
    assert feed(blind, 4, [5.0, 12.0, 13.0], [0.8, 0.8], 200)[-50:].count(2) >= 45


def test_a_due_re_measurement_waits_for_little_backfill():
    """Re-measuring k>0 after a long k=0 stretch first runs the MTP layer over every skipped position
    of every row; a due re-measurement waits until few are pending, up to 4 intervals."""
    policy = SpecPolicy(2, explore_every=50, first_reexplore=50)
    feed(policy, 16, [5.0, 9.5, 13.0], [0.8, 0.8], 300)  # warmed up; k=0 is best, k>0 still plausible
    costs = policy.buckets[16, False]
    interval = min(policy.explore_every << min(costs.confirmed, 3), policy.first_reexplore << costs.explorations)
    waited = [policy.choose(16, pending=16 * 100) for _ in range(3 * interval)]
    assert set(waited) == {0}  # due after one interval, but 100 positions per row are pending
    assert 0 < policy.choose(16, pending=16 * 2)  # few pending: it measures now


def test_a_bucket_next_to_a_measured_one_warms_up_with_one_pair_per_k():
    """Serving moves a decode batch between neighbouring buckets (12..16 rows under PD): a bucket
    whose neighbour has measured k already takes that ratio as its prior and measures k once itself,
    not `WARMUP_PAIRS` times (each measurement holds k for steps that may cost 2-3x a plain one)."""
    def pairs_at_12(policy: SpecPolicy) -> list[int]:
        feed(policy, 12, [5.0, 9.5, 13.0], [0.8, 0.8], 60)  # settles (16 decisions), warms up
        return [policy.buckets[12, False].ratios[k].count for k in (1, 2)]

    alone = SpecPolicy(2)
    assert pairs_at_12(alone) == [policy_module.WARMUP_PAIRS] * 2
    beside = SpecPolicy(2)
    feed(beside, 16, [5.0, 9.5, 13.0], [0.8, 0.8], 100)
    assert [beside.buckets[16, False].ratios[k].count >= policy_module.WARMUP_PAIRS for k in (1, 2)] == [True, True]
    assert pairs_at_12(beside) == [1, 1], beside.summary()


def test_a_warm_up_waits_for_little_backfill():
    """A bucket that settles has rows that skipped the MTP layer at their previous batch size: its
    warm-up, like a re-measurement, waits for a moment with few positions to backfill."""
    policy = SpecPolicy(2)
    feed(policy, 16, [5.0, 9.5, 13.0], [0.8, 0.8], 100)  # k=0 is best at 16; 12 will borrow that
    waited = [policy.choose(12, pending=12 * 100) for _ in range(3 * policy_module.SETTLE_DECISIONS)]
    assert set(waited) == {0} and policy.buckets[12, False].explorations == 0
    assert 0 < policy.choose(12, pending=12 * 2)  # few pending: it warms up now


def test_a_warm_up_that_never_sees_little_backfill_still_ends():
    """A bucket whose rows always have much backfill pending (long-lived rows under load) waits at most
    4 first re-measurement intervals, and then warms up every k back to back: the wait does not grow
    with each measurement taken."""
    policy = SpecPolicy(3)
    feed(policy, 16, [5.0, 9.5, 13.0, 16.0], [0.8, 0.8, 0.8], 300, pending=16 * 100)
    assert policy.warmed_up(16), policy.summary()


def test_resuming_drafting_near_break_even_takes_a_wider_margin():
    """Rows that skipped the MTP layer for a while make the first drafting step pay its backfill: a k
    that wins by less than `RESUME_MARGIN` is not resumed while much is pending (near break-even the
    decision would flip with the noise and pay a backfill at each flip); with little pending it is."""
    policy = SpecPolicy(2)
    feed(policy, 16, [5.0, 7.0, 10.0], [0.6, 0.6], 300)  # rates vs k=0: k=1 1.6/1.4 = 1.14, k=2 0.98
    assert policy.best_k(16) == 1, policy.summary()
    assert set(policy.choose(16, pending=16 * 100) for _ in range(20)) == {0}, policy.summary()
    assert policy.choose(16, pending=16 * 2) == 1
    assert policy.best_k(16, extra=policy_module.RESUME_MARGIN) == 0


@pytest.mark.parametrize("draft_ms, held_share", [(8.37, 0.0), (15.0, 0.7)])
def test_a_held_k0_decision_decides_as_re_evaluating_every_step_would(draft_ms, held_share, monkeypatch):
    """Under load k=0 wins every step, and re-evaluating the estimates each step cost ~1% of a big
    batch's step: a k=0 decision stands for `hold_decisions` decisions (holds_k0, which the runner
    asks first, does not even look at the pending backfill). It still takes every due
    re-measurement at the same step as re-evaluating would, and resumes drafting as soon as the
    backfill pending drops (which lowers the margin drafting must win by): with draft steps of
    8.37 ms k=2 wins by 1.12x, which is enough only without the resume margin (nothing is held);
    at 15 ms drafting clearly loses (most decisions are held)."""
    def drive(policy: SpecPolicy) -> list[int]:
        chosen, k_prev = [], None
        for step in range(3000):
            pending = 16 * (2 if step % 97 < 10 else 50)  # now and then little backfill pending
            # As the runner asks: the held decision first (without the pending backfill), then choose().
            k = 0 if policy.holds_k0(16) else policy.choose(16, pending=pending)
            if k_prev == k:
                policy.record_step(16, k, [5.0, draft_ms, draft_ms][k] * (1 + 0.1 * (step % 7 == 0)) / 1e3)
            if k:  # acceptance 0.5 at draft 1, 0.75 at draft 2: E(2) = 1.875
                policy.record_acceptance([k] * 8, [min(k, a) for a in (2, 2, 2, 1, 0, 0, 0, 0)])
            chosen.append(k)
            k_prev = k
        return chosen

    held, evaluated = SpecPolicy(2), SpecPolicy(2, hold_decisions=0)
    calls = {"held": 0, "evaluated": 0}
    estimates = SpecPolicy.cost_estimates

    def counted(self, *a, **kw):
        calls["held" if self is held else "evaluated"] += 1
        return estimates(self, *a, **kw)

    monkeypatch.setattr(SpecPolicy, "cost_estimates", counted)
    decisions = drive(held)
    assert decisions == drive(evaluated)
    assert decisions.count(0) > 1000
    if held_share:
        assert calls["held"] < (1 - held_share) * calls["evaluated"]
    else:
        assert decisions.count(2) > 100  # resumed in the windows of little backfill
